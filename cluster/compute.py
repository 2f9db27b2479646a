"""Compute-time models: seconds one worker needs for one micro-batch.

A model is sampled only by the clock (`cluster/clock.py`), never by the math. Every model is vectorised over
workers and takes the worker ids and the per-worker index of the unit of work (so that a trace can be replayed
by position), plus the clock's seeded `numpy.random.Generator`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np


class ComputeModel(Protocol):
  """Seconds of compute for one micro-batch of each given worker."""

  def sample(self, rng: np.random.Generator, workers: np.ndarray, units: np.ndarray) -> np.ndarray:
    """Returns float64 seconds, one per entry of `workers`.

    Args:
      rng: the clock's generator; the only source of randomness.
      workers: int array of worker ids.
      units: int array (same shape): how many micro-batches that worker had started before this one.
    """


@dataclasses.dataclass(frozen=True)
class Constant:
  """Every micro-batch takes `base_s` seconds on every worker (no stragglers)."""
  base_s: float

  def sample(self, rng, workers, units):
    del rng, units
    return np.full(np.shape(workers), self.base_s, dtype=np.float64)
