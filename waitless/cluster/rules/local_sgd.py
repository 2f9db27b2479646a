"""Local SGD's time rule (`algorithms/local_sgd.py`): local steps without waiting, a blocking average.

Time per round: max_i sum_h X_{i,h} + allreduce(P). DiLoCo (`algorithms/diloco.py`) uses this rule.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, TYPE_CHECKING

import numpy as np

from waitless.algorithms import local_sgd
from waitless.cluster import network as network_lib
from waitless.cluster import schedules
from waitless.cluster.rules.waits_for_everyone import WaitsForEveryone

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


@dataclasses.dataclass(frozen=True)
class PeriodicAverage(WaitsForEveryone):
  """Local steps without waiting; a blocking model all-reduce after selected steps.

  Worker i runs its steps back to back; after a step t with `averages_at(t)` everybody waits for the last
  worker, then all-reduces. Time per round of H steps: max_i sum_h X_{i,h} + allreduce(P).

  Schedule: `EveryoneSchedule` (microbatches_done = m for every worker); the math derives the averaging
  steps from the step number itself.
  """
  averages_at: Callable[[int], bool]
  microbatches: int = 1

  vectorized = True

  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
    p = clock.workers
    clock.times[:] = self.everyone_computes(clock, clock.times)
    idle = np.zeros(p)
    communicated = 0.0
    if self.averages_at(iteration):
      arrival = clock.times.max()
      idle = arrival - clock.times
      clock.times[:] = arrival + clock.network.allreduce(clock.model_bytes, p)
      communicated = network_lib.ring_bytes(clock.model_bytes, p)
    return schedules.Iteration(
        schedule=self.everyone_done(p), idle=idle, bytes_communicated=communicated, staleness=np.zeros(p))

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> Optional[schedules.Steps]:
    """n calls of `iterate` with numpy, one round at a time: each worker's times through a round are a
    running sum (`np.add.accumulate`, the same additions in the same order), then the all-reduce. Failures:
    None (one `iterate` at a time)."""
    jobs = clock.job_seconds(n, self.microbatches)
    if jobs is None:
      return None
    p = clock.workers
    averages = np.fromiter((self.averages_at(iteration + k) for k in range(n)), bool, n)
    allreduce = clock.network.allreduce(clock.model_bytes, p)
    times, idle = jobs, np.zeros((n, p))  # times overwrite the job seconds, row by row
    ends = np.flatnonzero(averages).tolist()
    if not averages[-1]:
      ends.append(n - 1)
    begin, start = 0, clock.times.copy()
    for end in ends:
      times[begin] += start
      np.add.accumulate(times[begin:end + 1], axis=0, out=times[begin:end + 1])
      start = times[end]
      if averages[end]:
        arrival = start.max()
        np.subtract(arrival, start, out=idle[end])
        start[:] = arrival + allreduce
      begin = end + 1
    clock.times[:] = times[-1]
    communicated = np.where(averages, network_lib.ring_bytes(clock.model_bytes, p), 0.0)
    return self.everyone_steps(idle, communicated, times)


def time_rule(config):
  a = config.algorithm
  return PeriodicAverage(
      averages_at=lambda t: bool(local_sgd.averages_at(t, a.local_steps, a.warmup_steps)),
      microbatches=config.microbatches)
