"""Shared pieces of the rules that wait for every worker (sync, local SGD, D-PSGD gossip), and the ring.

The ring helpers (`ring_neighbours`, `neighbourhood_max`) serve D-PSGD's `RingGossip` (cluster/rules/dpsgd.py)
and non-blocking SGD's ring topology (cluster/rules/nonblocking.py).

Every rule built on `WaitsForEveryone` needs every worker (a failed worker stalls it): `tolerated_failures`
is 0, and every worker computes its m micro-batches each iteration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from waitless import config_errors as errors
from waitless.algorithms.schedules import EveryoneSchedule
from waitless.cluster.rules import base

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


class WaitsForEveryone(base.TimeRule):
  """Rules whose iteration needs every worker (a failed worker stalls them): m micro-batches each."""

  schedule_type = EveryoneSchedule

  def __post_init__(self):
    errors.require_int(self.microbatches, 'microbatches', 1)

  def everyone_computes(self, clock: 'Clock', start) -> np.ndarray:
    """Finish times of every worker's m micro-batches, started at `start` (a time or one per worker)."""
    return clock.work(np.arange(clock.workers), start, self.microbatches)

  def everyone_done(self, workers: int) -> EveryoneSchedule:
    """The schedule: every worker finished its m micro-batches."""
    return EveryoneSchedule(microbatches_done=base.full(workers, self.microbatches, np.int32))

  def everyone_steps(self, idle: np.ndarray, bytes_communicated: np.ndarray, times: np.ndarray) -> base.Steps:
    """`Steps` of n iterations (idle and per-worker times after each iteration (n, P), bytes (n,))."""
    n, p = times.shape
    return base.Steps(
        schedule=EveryoneSchedule(microbatches_done=np.full((n, p), self.microbatches, np.int32)), idle=idle,
        bytes_communicated=np.asarray(bytes_communicated, np.float64), mean_staleness=np.zeros(n),
        end_time=times.max(axis=1), times=times)


def job_seconds(clock: 'Clock', n: int, m: int, per_call: int = 1):
  """float64 (n, P): every worker's job of m micro-batches in each of n iterations (`Clock.work`'s sum, in
  `np.cumsum` order; `per_call` micro-batches per call), drawn ahead and counted as consumed; None where it
  cannot be drawn ahead (failures)."""
  seconds = clock.draw_jobs(n, m, per_call=per_call)
  if seconds is None:
    return None
  return np.ascontiguousarray(seconds[:, :, 0] if m == 1 else np.cumsum(seconds, axis=2)[:, :, -1])


def ring_neighbours(p: int) -> int:
  """Distinct ring neighbours of a worker: 2, or fewer on a ring of 1 or 2 workers."""
  return min(p - 1, 2)


def neighbourhood_max(values: np.ndarray) -> np.ndarray:
  """max(values[i-1], values[i], values[i+1]) on a ring (works for P = 1 and 2)."""
  ring = np.concatenate((values[-1:], values, values[:1]))
  return np.maximum(np.maximum(ring[:-2], ring[1:-1]), ring[2:])

