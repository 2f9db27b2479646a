"""Time rules: how one iteration of an algorithm family advances the per-worker clocks.

A rule never touches parameters. Given the clock (per-worker times, the compute and network models), it
advances the clocks by one iteration and returns the per-worker schedule that the math consumes. Each
algorithm module names its rule through its registry spec (`AlgorithmSpec.time_rule`).

Every schedule holds `microbatches_done`: int32 (P,), the micro-batches each worker contributes this
iteration. Rules add their own fields (for example `refresh_view`, `fresh`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from cluster.clock import Clock


@dataclasses.dataclass(frozen=True)
class Iteration:
  """What one iteration did, on the host.

  Attributes:
    schedule: per-worker arrays for the math, each with leading dimension P.
    idle: float64 (P,), seconds each worker waited (barriers, blocked collectives) in this iteration.
    bytes_communicated: bytes put on the network by all workers together in this iteration.
    staleness: float64 (P,), staleness of each worker's contribution (0 for synchronous rules).
  """
  schedule: dict[str, np.ndarray]
  idle: np.ndarray
  bytes_communicated: float
  staleness: np.ndarray


def _ring_bytes(model_bytes: float, n: int) -> float:
  """Bytes all n workers send together in a ring all-reduce of `model_bytes`."""
  return 2.0 * (n - 1) * model_bytes


@dataclasses.dataclass(frozen=True)
class Barrier:
  """Fully synchronous: all start together, compute m micro-batches, all-reduce, everybody waits.

  Time per iteration: max_i sum_k X_{i,k} + allreduce(P).
  """
  microbatches: int = 1

  def iterate(self, clock: "Clock", iteration: int) -> Iteration:
    del iteration
    p = clock.workers
    start = clock.times.max()
    work = clock.compute_units(np.arange(p), self.microbatches)
    finished = start + work
    comm = clock.network.allreduce(clock.model_bytes, p)
    end = finished.max() + comm
    idle = end - comm - finished
    clock.times[:] = end
    return Iteration(
        schedule={'microbatches_done': np.full((p,), self.microbatches, np.int32)},
        idle=idle, bytes_communicated=_ring_bytes(clock.model_bytes, p), staleness=np.zeros(p))


@dataclasses.dataclass(frozen=True)
class PeriodicAverage:
  """Local steps without waiting; a blocking all-reduce of the models after the steps `averages_at` selects.

  Time per round of H steps: max_i sum_h X_{i,h} + allreduce(P).
  """
  averages_at: Callable[[int], bool]
  microbatches: int = 1

  def iterate(self, clock: "Clock", iteration: int) -> Iteration:
    p = clock.workers
    clock.times += clock.compute_units(np.arange(p), self.microbatches)
    idle = np.zeros(p)
    communicated = 0.0
    if self.averages_at(iteration):
      comm = clock.network.allreduce(clock.model_bytes, p)
      arrival = clock.times.max()
      idle = arrival - clock.times
      clock.times[:] = arrival + comm
      communicated = _ring_bytes(clock.model_bytes, p)
    return Iteration(
        schedule={'microbatches_done': np.full((p,), self.microbatches, np.int32)},
        idle=idle, bytes_communicated=communicated, staleness=np.zeros(p))
