"""Synchronous SGD's time rule (`algorithms/sync.py`): everyone computes, then one all-reduce.

Time per iteration: max_i X_i + allreduce(P); where the profile's framework all-reduces the gradients under the
backward pass (`stacks.Framework.backward_share` > 0), only what is left of the all-reduce after the backward pass
of the last micro-batch (`step.after_compute`, with the compute model's mean micro-batch).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, TYPE_CHECKING

import numpy as np

from waitless.cluster import network as network_lib
from waitless.cluster import schedules
from waitless.cluster import stacks
from waitless.cluster import step as step_lib
from waitless.cluster.rules.waits_for_everyone import WaitsForEveryone

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


@dataclasses.dataclass(frozen=True)
class Barrier(WaitsForEveryone):
  """Fully synchronous: all start together, compute m micro-batches, all-reduce, everybody waits.

  Time per iteration: max_i sum_k X_{i,k} + allreduce(P).
  Idle: max_j finish_j - finish_i (the all-reduce itself is communication, not idle).

  Schedule: `EveryoneSchedule` (microbatches_done = m for every worker).
  """
  microbatches: int = 1

  vectorized = True

  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
    del iteration
    p = clock.workers
    start = clock.times.max()
    finished = self.everyone_computes(clock, start)
    arrival = finished.max()
    clock.times[:] = arrival + self.communication(clock, np.array([arrival - start]))[0]
    return schedules.Iteration(
        schedule=self.everyone_done(p),
        idle=arrival - finished, bytes_communicated=network_lib.ring_bytes(clock.model_bytes, p),
        staleness=np.zeros(p))

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> Optional[schedules.Steps]:
    """n calls of `iterate` with numpy: the iteration ends are one scalar chain start + max_i X_i + allreduce
    (rounding is monotone, so max_i (start + X_i) = start + max_i X_i exactly), summed in order by
    `np.add.accumulate`. Failures: None (one `iterate` at a time)."""
    del iteration
    jobs = clock.job_seconds(n, self.microbatches)
    if jobs is None:
      return None
    p = clock.workers
    chain = np.empty(2 * n + 1)  # start, arrival_0, end_0 (= start_1), arrival_1, end_1, ...
    chain[0] = clock.times.max()
    chain[1::2] = jobs.max(axis=1)
    chain[2::2] = self.communication(clock, chain[1::2])
    np.add.accumulate(chain, out=chain)
    idle = chain[1::2, None] - (chain[0:-1:2, None] + jobs)
    times = np.repeat(chain[2::2, None], p, axis=1)
    clock.times[:] = times[-1]
    return self.everyone_steps(idle, np.full(n, network_lib.ring_bytes(clock.model_bytes, p)), times)


  def communication(self, clock: 'Clock', slowest_jobs: np.ndarray) -> np.ndarray:
    """Seconds after each iteration's slowest job (of m micro-batches) until the all-reduce is done."""
    net, p = clock.network, clock.workers
    f = net.framework if isinstance(net, stacks.Stack) else None
    if f is None or f.backward_share <= 0:
      return np.full(len(slowest_jobs), net.allreduce(clock.model_bytes, p))
    # The backward pass of a mean micro-batch: a delay (a sleep, a fault) is not backward work, and a slow worker's
    # longer backward pass is not credited (the pessimistic side); a job's own mean where the model's is infinite.
    mean = clock.mean_unit_seconds()
    if math.isfinite(mean):
      return np.full(len(slowest_jobs), step_lib.after_compute(net, clock.model_bytes, p, mean))
    m = max(self.microbatches, 1)
    return np.array([step_lib.after_compute(net, clock.model_bytes, p, job / m) for job in slowest_jobs])


def time_rule(config):
  return Barrier(microbatches=config.microbatches)
