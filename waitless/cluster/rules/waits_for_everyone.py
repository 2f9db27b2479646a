"""The base of the rules whose iteration waits for every worker (sync, local SGD, D-PSGD, MATCHA, Streaming
DiLoCo): every worker computes its m micro-batches each iteration, and a failed worker stalls the rule
(`tolerated_failures` is 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from waitless import config_errors as errors
from waitless.algorithms.schedules import EveryoneSchedule
from waitless.cluster import schedules
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
    return EveryoneSchedule(microbatches_done=schedules.full(workers, self.microbatches, np.int32))

  def everyone_steps(self, idle: np.ndarray, bytes_communicated: np.ndarray, times: np.ndarray) -> schedules.Steps:
    """`Steps` of n iterations (idle and per-worker times after each iteration (n, P), bytes (n,))."""
    n, p = times.shape
    return schedules.Steps(
        schedule=EveryoneSchedule(microbatches_done=np.full((n, p), self.microbatches, np.int32)), idle=idle,
        bytes_communicated=np.asarray(bytes_communicated, np.float64), mean_staleness=np.zeros(n),
        end_time=times.max(axis=1), times=times)
