"""DaSGD's time rule (`algorithms/dasgd.py`): rounds of tau local steps, the average applied d steps later.

Worker i steps without waiting; at the apply step it waits until R = max_j(time j took the snapshot) +
allreduce(P), or not at all when that is earlier (`delayed_averaging_time`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, TYPE_CHECKING

import numpy as np

from waitless import config_errors as errors
from waitless.algorithms.delayed_averaging import DelayedAverageSchedule
from waitless.cluster import schedules
from waitless.cluster.rules import base
from waitless.cluster.rules.delayed_averaging_time import delayed_average_block
from waitless.cluster.rules.delayed_averaging_time import delayed_average_step

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


# ---- the time rule ----

@dataclasses.dataclass(frozen=True)
class DelayedAverage(base.TimeRule):
  """Rounds of tau local steps; the round's average is applied d steps into the next round.

  Worker i steps without waiting (start_i(t+1) = end_i(t)). After step t with (t+1) mod tau == 0 it snapshots;
  the mean is applied after step t + d (0 <= d <= tau), where worker i waits until R (see
  `cluster.rules.delayed_averaging_time`):  end_i(t + d) = max(c_i(t + d), R).
  d = 0 is local SGD with H = tau (`local_sgd.PeriodicAverage`). Idle: the wait at the apply step (for d = 0:
  waiting for the last worker, as in local SGD).

  Schedule: `DelayedAverageSchedule`.
  """
  period: int        # tau
  delay: int         # d
  microbatches: int = 1

  schedule_type = DelayedAverageSchedule
  vectorized = True

  def __post_init__(self):
    errors.require_int(self.period, 'period', 1)
    errors.require_int(self.delay, 'delay', 0)
    errors.require_int(self.microbatches, 'microbatches', 1)
    if self.delay > self.period:
      raise ValueError(f'delay={self.delay} must be <= period={self.period}')

  def iterate(self, clock: "Clock", iteration: int) -> schedules.Iteration:
    p = clock.workers
    finished = clock.work(np.arange(p), clock.times, self.microbatches)
    idle, uniform, communicated = delayed_average_step(
        clock, iteration, finished, (iteration + 1) % self.period == 0, self.delay)
    schedule = DelayedAverageSchedule(microbatches_done=schedules.full(p, self.microbatches, np.int32), **uniform)
    return schedules.Iteration(schedule=schedule, idle=idle, bytes_communicated=communicated, staleness=np.zeros(p))

  def iterate_block(self, clock: "Clock", iteration: int, n: int) -> Optional[schedules.Steps]:
    """n calls of `iterate`: the block's compute times drawn at once, each worker's times a running sum
    between the averaging events (`delayed_average_block`). Failures: None (one `iterate` at a time)."""
    times = clock.job_seconds(n, self.microbatches)
    if times is None:
      return None
    snapshot = np.arange(iteration + 1, iteration + n + 1) % self.period == 0
    idle, uniform, communicated = delayed_average_block(clock, iteration, times, snapshot, self.delay)
    schedule = DelayedAverageSchedule(
        microbatches_done=np.full(times.shape, self.microbatches, np.int32), **uniform)
    return schedules.Steps(schedule=schedule, idle=idle, bytes_communicated=communicated,
                           mean_staleness=np.zeros(n), end_time=times.max(axis=1), times=times)


def time_rule(config):
  a = config.algorithm
  return DelayedAverage(period=a.local_steps, delay=a.delay, microbatches=config.microbatches)
