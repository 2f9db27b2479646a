"""Shared pieces of the rules that wait for every worker (sync, local SGD, D-PSGD gossip), and the ring.

Every rule built on `WaitsForEveryone` needs every worker (a failed worker stalls it): `tolerated_failures`
is 0, and every worker computes its m micro-batches each iteration.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, TYPE_CHECKING

import numpy as np

from cluster import network as network_lib
from cluster.rules import base

if TYPE_CHECKING:
  from cluster.clock import Clock


class EveryoneSchedule(NamedTuple):
  """Schedule of a rule in which every worker contributes all of its micro-batches."""
  microbatches_done: np.ndarray  # int32 (P,), = microbatches for every worker
  UNIFORM = ()


class WaitsForEveryone(base.TimeRule):
  """Rules whose iteration needs every worker (a failed worker stalls them): m micro-batches each."""

  schedule_type = EveryoneSchedule

  def __post_init__(self):
    base.check_positive_int(self.microbatches, 'microbatches')

  def everyone_computes(self, clock: 'Clock', start) -> np.ndarray:
    """Finish times of every worker's m micro-batches, started at `start` (a time or one per worker)."""
    return clock.work(np.arange(clock.workers), start, self.microbatches)

  def everyone_done(self, workers: int) -> EveryoneSchedule:
    """The schedule: every worker finished its m micro-batches."""
    return EveryoneSchedule(microbatches_done=base.full(workers, self.microbatches, np.int32))


def ring_neighbours(p: int) -> int:
  """Distinct ring neighbours of a worker: 2, or fewer on a ring of 1 or 2 workers."""
  return min(p - 1, 2)


def neighbourhood_max(values: np.ndarray) -> np.ndarray:
  """max(values[i-1], values[i], values[i+1]) on a ring (works for P = 1 and 2)."""
  ring = np.concatenate((values[-1:], values, values[:1]))
  return np.maximum(np.maximum(ring[:-2], ring[1:-1]), ring[2:])


@dataclasses.dataclass(frozen=True)
class RingGossip(WaitsForEveryone):
  """D-PSGD on a ring (`dpsgd`): a worker waits only for its two neighbours.

  Worker i finishes its compute at c_i = start_i + sum_k X_{i,k}; it exchanges models with i-1 and i+1 when
  all three are there, then starts the next iteration:
    start_i(t+1) = max(c_{i-1}, c_i, c_{i+1}) + 2 p2p(M).
  The two exchanges are counted back to back (one per neighbour). Idle: max over the neighbourhood - c_i.
  Reference: Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017.

  Schedule: `EveryoneSchedule`.
  """
  microbatches: int = 1

  def iterate(self, clock: 'Clock', iteration: int) -> base.Iteration:
    del iteration
    p = clock.workers
    finished = self.everyone_computes(clock, clock.times)
    ready = neighbourhood_max(finished)
    exchanges = ring_neighbours(p)
    clock.times[:] = ready + exchanges * clock.network.p2p(clock.model_bytes)
    return base.Iteration(
        schedule=self.everyone_done(p),
        idle=ready - finished, bytes_communicated=float(p * exchanges) * clock.model_bytes,
        staleness=np.zeros(p))

