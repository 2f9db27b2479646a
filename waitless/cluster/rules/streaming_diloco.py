"""Streaming DiLoCo's time rule (`algorithms/streaming_diloco.py`): one fragment's all-reduce hidden under d steps.

A snapshot's all-reduce of M / F bytes starts when every worker has taken it, R_f = max_j (end_j) +
allreduce(M / F, P); at the merge step worker i waits until R_f: end_i = max(c_i, R_f).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, TYPE_CHECKING

import numpy as np

from waitless import config_errors as errors
from waitless.algorithms import streaming_diloco
from waitless.cluster import network as network_lib
from waitless.cluster import schedules
from waitless.cluster.rules.waits_for_everyone import WaitsForEveryone

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


# ---- the time rule ----

@dataclasses.dataclass(frozen=True)
class StreamingAverage(WaitsForEveryone):
  """Streaming DiLoCo: staggered fragment all-reduces of M / F bytes, each merged d steps after its snapshot.

  Worker i steps without waiting (start_i(t+1) = end_i(t)). After a step t at which fragment f is snapshotted
  (`snapshot_table`: at its sync point, or d steps before it with 'snapshot_early'), the all-reduce of M / F
  bytes starts when the last worker has reached it: R_f = max_j end_j(t) + allreduce(M / F, P); after step
  t + d (the merge) worker i waits until R_f: end_i(t + d) = max(c_i(t + d), R_f). d = 0: end_i(t) = R_f for
  everyone (a blocking sync). Idle: the waits. With F = 1 and d = 0 this is local SGD's `PeriodicAverage`.
  Reports `sync_bytes`: the bytes the all-reduce started in this iteration puts on the network (0 without
  one); its window maximum is the peak per sync.

  Schedule: `EveryoneSchedule`; the math derives the fragment events from the step number.
  """
  period: int         # H
  fragments: int      # F
  delay: int          # d
  microbatches: int = 1
  overlap: str = streaming_diloco.MERGE_LATE  # which steps the snapshot and the merge fall on (`snapshot_table`)

  reports = {'sync_bytes': 'max'}

  def __post_init__(self):
    super().__post_init__()
    errors.require_int(self.period, 'period', 1)
    errors.require_int(self.delay, 'delay', 0)
    if self.delay > self.period:
      raise ValueError(f'delay={self.delay} must be <= period={self.period}')
    streaming_diloco.snapshot_table(self.period, self.fragments, self.delay, self.overlap)

  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
    p, table = clock.workers, streaming_diloco.snapshot_table(self.period, self.fragments, self.delay, self.overlap)
    end = self.everyone_computes(clock, clock.times)
    idle = np.zeros(p)
    ready = np.asarray(clock.rule_state.get('ready_s', np.zeros(self.fragments)), np.float64).copy()
    if self.delay and iteration >= self.delay:
      applied = table[(iteration - self.delay) % self.period]
      if applied >= 0:
        waited = np.maximum(end, ready[applied])
        idle, end = waited - end, waited
    communicated = 0.0
    synced = table[iteration % self.period]
    if synced >= 0:
      nbytes = clock.model_bytes / self.fragments
      arrival = end.max()
      ready[synced] = arrival + clock.network.allreduce(nbytes, p)
      communicated = network_lib.ring_bytes(nbytes, p)
      if self.delay == 0:
        idle = idle + (arrival - end)
        end = np.full(p, ready[synced])
    clock.rule_state['ready_s'] = ready
    clock.times[:] = end
    return schedules.Iteration(schedule=self.everyone_done(p), idle=idle, bytes_communicated=communicated,
                          staleness=np.zeros(p), measurements={'sync_bytes': communicated})

  vectorized = True

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> Optional[schedules.Steps]:
    """n calls of `iterate`: the compute times drawn ahead, then one pass over the iterations on preallocated
    rows, where a wait for a fragment's mean and a fragment's sync are one numpy call each. Failures: None (one
    `iterate` at a time)."""
    jobs = clock.job_seconds(n, self.microbatches)
    if jobs is None:
      return None
    table = streaming_diloco.snapshot_table(self.period, self.fragments, self.delay, self.overlap).tolist()
    p = clock.workers
    ready = np.asarray(clock.rule_state.get('ready_s', np.zeros(self.fragments)), np.float64).copy()
    nbytes = clock.model_bytes / self.fragments
    mean_time, mean_bytes = clock.network.allreduce(nbytes, p), network_lib.ring_bytes(nbytes, p)
    times, idle, communicated = np.empty((n, p)), np.zeros((n, p)), np.zeros(n)
    start = clock.times
    for k, t in enumerate(range(iteration, iteration + n)):
      end = times[k]
      np.add(start, jobs[k], out=end)
      if self.delay and t >= self.delay:
        applied = table[(t - self.delay) % self.period]
        if applied >= 0:
          waited = np.maximum(end, ready[applied])
          np.subtract(waited, end, out=idle[k])
          end[:] = waited
      synced = table[t % self.period]
      if synced >= 0:
        arrival = end.max()
        ready[synced] = arrival + mean_time
        communicated[k] = mean_bytes
        if self.delay == 0:
          idle[k] += arrival - end
          end.fill(ready[synced])
      start = end
    clock.rule_state['ready_s'] = ready
    clock.times[:] = times[-1]
    steps = self.everyone_steps(idle, communicated, times)
    return dataclasses.replace(steps, measurements={'sync_bytes': communicated.copy()})


def time_rule(config):
  a = config.algorithm
  return StreamingAverage(period=a.local_steps, fragments=a.fragments, delay=a.delay,
                          microbatches=config.microbatches, overlap=a.overlap)
