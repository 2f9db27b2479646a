"""Time rules of the baselines: all-reduce SGD, local SGD, D-PSGD ring gossip.

Every rule here needs every worker (a failed worker stalls it), so `tolerated_failures` is 0.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, TYPE_CHECKING

import numpy as np

from cluster import network as network_lib
from cluster.rules import base

if TYPE_CHECKING:
  from cluster.clock import Clock


class _WaitsForEveryone:
  """Rules whose iteration needs every worker (a failed worker stalls them): m micro-batches each."""

  def __post_init__(self):
    base.check_positive_int(self.microbatches, 'microbatches')

  def tolerated_failures(self, workers: int) -> int:
    del workers
    return 0

  def _everyone_computes(self, clock: "Clock", start) -> np.ndarray:
    """Finish times of every worker's m micro-batches, started at `start` (a time or one per worker)."""
    return clock.work(np.arange(clock.workers), start, self.microbatches)

  def _everyone_done(self, workers: int) -> dict[str, np.ndarray]:
    """The schedule: every worker finished its m micro-batches."""
    return {'microbatches_done': base.full(workers, self.microbatches, np.int32)}


@dataclasses.dataclass(frozen=True)
class Barrier(_WaitsForEveryone):
  """Fully synchronous (`sync`): all start together, compute m micro-batches, all-reduce, everybody waits.

  Time per iteration: max_i sum_k X_{i,k} + allreduce(P).
  Idle: max_j finish_j - finish_i (the all-reduce itself is communication, not idle).

  Schedule:
    microbatches_done: int32 (P,), = microbatches for every worker.
  """
  microbatches: int = 1

  def iterate(self, clock: "Clock", iteration: int) -> base.Iteration:
    del iteration
    p = clock.workers
    finished = self._everyone_computes(clock, clock.times.max())
    arrival = finished.max()
    clock.times[:] = arrival + clock.network.allreduce(clock.model_bytes, p)
    return base.Iteration(
        schedule=self._everyone_done(p),
        idle=arrival - finished, bytes_communicated=network_lib.ring_bytes(clock.model_bytes, p),
        staleness=np.zeros(p))


@dataclasses.dataclass(frozen=True)
class PeriodicAverage(_WaitsForEveryone):
  """Local SGD (`local_sgd`): local steps without waiting; a blocking model all-reduce after selected steps.

  Worker i runs its steps back to back; after a step t with `averages_at(t)` everybody waits for the last
  worker, then all-reduces. Time per round of H steps: max_i sum_h X_{i,h} + allreduce(P).

  Schedule:
    microbatches_done: int32 (P,), = microbatches for every worker.
  """
  averages_at: Callable[[int], bool]
  microbatches: int = 1

  def iterate(self, clock: "Clock", iteration: int) -> base.Iteration:
    p = clock.workers
    clock.times[:] = self._everyone_computes(clock, clock.times)
    idle = np.zeros(p)
    communicated = 0.0
    if self.averages_at(iteration):
      arrival = clock.times.max()
      idle = arrival - clock.times
      clock.times[:] = arrival + clock.network.allreduce(clock.model_bytes, p)
      communicated = network_lib.ring_bytes(clock.model_bytes, p)
    return base.Iteration(
        schedule=self._everyone_done(p),
        idle=idle, bytes_communicated=communicated, staleness=np.zeros(p))


def ring_neighbours(p: int) -> int:
  """Distinct ring neighbours of a worker: 2, or fewer on a ring of 1 or 2 workers."""
  return min(p - 1, 2)


def neighbourhood_max(values: np.ndarray) -> np.ndarray:
  """max(values[i-1], values[i], values[i+1]) on a ring (works for P = 1 and 2)."""
  ring = np.concatenate((values[-1:], values, values[:1]))
  return np.maximum(np.maximum(ring[:-2], ring[1:-1]), ring[2:])


@dataclasses.dataclass(frozen=True)
class RingGossip(_WaitsForEveryone):
  """D-PSGD on a ring (`dpsgd`): a worker waits only for its two neighbours.

  Worker i finishes its compute at c_i = start_i + sum_k X_{i,k}; it exchanges models with i-1 and i+1 when
  all three are there, then starts the next iteration:
    start_i(t+1) = max(c_{i-1}, c_i, c_{i+1}) + 2 p2p(M).
  The two exchanges are counted back to back (one per neighbour). Idle: max over the neighbourhood - c_i.
  Reference: Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017.

  Schedule:
    microbatches_done: int32 (P,), = microbatches for every worker.
  """
  microbatches: int = 1

  def iterate(self, clock: "Clock", iteration: int) -> base.Iteration:
    del iteration
    p = clock.workers
    finished = self._everyone_computes(clock, clock.times)
    ready = neighbourhood_max(finished)
    exchanges = ring_neighbours(p)
    clock.times[:] = ready + exchanges * clock.network.p2p(clock.model_bytes)
    return base.Iteration(
        schedule=self._everyone_done(p),
        idle=ready - finished, bytes_communicated=float(p * exchanges) * clock.model_bytes,
        staleness=np.zeros(p))
