"""What every time rule returns, and small helpers shared by the rule families."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class Iteration:
  """What one iteration did, on the host.

  Attributes:
    schedule: per-worker arrays for the math, each with leading dimension P. Always holds
      `microbatches_done`: int32 (P,), the micro-batches of data each worker's contribution consumed.
    idle: float64 (P,), seconds each worker waited (barriers, blocked collectives) in this iteration; time
      spent communicating, and compute that was cancelled or abandoned, is not idle.
    bytes_communicated: bytes put on the network by all workers together in this iteration.
    staleness: float64 (P,), staleness of each worker's contribution (0 for synchronous rules).
    mean_staleness: mean staleness of the contributions applied in this iteration, weighted by gradients;
      None means `staleness.mean()`.
    counters: rule-specific event counts of this iteration (same keys every iteration).
  """
  schedule: dict[str, np.ndarray]
  idle: np.ndarray
  bytes_communicated: float
  staleness: np.ndarray
  mean_staleness: Optional[float] = None
  counters: Mapping[str, float] = dataclasses.field(default_factory=dict)


def full(p: int, value, dtype) -> np.ndarray:
  """A per-worker schedule field holding the same value for every worker."""
  return np.full((p,), value, dtype)


def check_positive_int(value, name: str, minimum: int = 1) -> None:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
    raise ValueError(f'{name}={value!r} must be an integer >= {minimum}')


@dataclasses.dataclass(frozen=True)
class Steps:
  """n iterations at once, from a rule's optional `iterate_block(clock, iteration, n)` (a fast path).

  Attributes:
    schedule: name -> array (n, P, ...), as `Iteration.schedule` stacked.
    idle: float64 (n, P).
    bytes_communicated: float64 (n,).
    mean_staleness: float64 (n,).
    end_time: float64 (n,): every worker's time after each iteration.
    counters: name -> float64 (n,).
  """
  schedule: dict[str, np.ndarray]
  idle: np.ndarray
  bytes_communicated: np.ndarray
  mean_staleness: np.ndarray
  end_time: np.ndarray
  counters: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
