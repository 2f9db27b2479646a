"""Time rules of delayed (non-blocking) model averaging: DaSGD, and LAP-SGD / LPP-SGD node threads.

Both take a snapshot of every model at selected iterations, start an all-reduce of the snapshots, keep
stepping, and apply the mean some iterations later. The all-reduce can start only when every worker has
reached the snapshot, so the mean is ready at
    R = max_j (time worker j took the snapshot) + allreduce(P),
and worker i at the apply step waits until R, or not at all when R is earlier: communication is hidden when
allreduce(P) <= d x step time. A failed worker stalls the all-reduce, so these rules tolerate no failure.

Shared schedule fields (uniform: the same for every worker, shape () per iteration):
  snapshot: bool (), after this iteration's local step worker i stores s_i = W_i and the all-reduce of the
    snapshots starts.
  apply_average: bool (), in this iteration worker i applies the mean of the snapshots in flight
    (DaSGD: W_i <- mean(s) + (W_i - s_i), or the `mix` variant; LAP-SGD: W_i <- W_i + (mean(s) - s_i)).
  average_age: int32 (), iterations between the snapshot being applied and this one (0 if not applying).
    Order within an iteration: local step first; then, if apply_average and average_age > 0, apply the older
    snapshot's mean, then take the new snapshot if `snapshot`; if apply_average and average_age == 0 (delay
    d = 0), take the snapshot first and apply its mean at once (a blocking average: local SGD).
  At most one average is in flight: a snapshot that comes before the previous mean was applied (period
  shorter than the delay) first applies that mean (waiting for it), so average_age may be < d then.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Optional, TYPE_CHECKING

import numpy as np

from cluster import network as network_lib
from cluster.rules import base

if TYPE_CHECKING:
  from cluster.clock import Clock


class DelayedAverageSchedule(NamedTuple):
  """Schedule of DaSGD (see the module docstring for the order of events within an iteration)."""
  microbatches_done: np.ndarray  # int32 (P,), = m
  snapshot: np.ndarray           # bool (), snapshot after the local step and start the all-reduce
  apply_average: np.ndarray      # bool (), apply the mean of the snapshots in flight
  average_age: np.ndarray        # int32 (), iterations between the snapshot applied and this one
  UNIFORM = ('snapshot', 'apply_average', 'average_age')


class NodeThreadsSchedule(NamedTuple):
  """Schedule of LAP-SGD / LPP-SGD: DaSGD's fields plus the thread whose gradient this update applies."""
  microbatches_done: np.ndarray  # int32 (P,), = m: the micro-batches of the one thread batch applied
  snapshot: np.ndarray           # bool ()
  apply_average: np.ndarray      # bool ()
  average_age: np.ndarray        # int32 ()
  thread: np.ndarray             # int32 (), t mod Q
  UNIFORM = ('snapshot', 'apply_average', 'average_age', 'thread')


def _delayed_average(clock: "Clock", iteration: int, finished: np.ndarray, snapshot: bool, delay: int):
  """Advances `clock.times` past this iteration's averaging events; returns (idle, uniform fields, bytes)."""
  p = clock.workers
  state = clock.rule_state
  pending = int(state.get('pending_iteration', -1))  # iteration of the snapshot in flight, -1: none
  end, idle = finished, np.zeros(p)
  applied, age, communicated = False, 0, 0.0
  if pending >= 0 and (iteration - pending >= delay or snapshot):
    ready = float(state['pending_ready_s'])
    end = np.maximum(finished, ready)
    idle = end - finished  # blocked on a mean that is not there yet: communication not hidden
    applied, age = True, iteration - pending
    state['pending_iteration'] = -1
  if snapshot:
    arrival = end.max()
    ready = arrival + clock.network.allreduce(clock.model_bytes, p)
    communicated = network_lib.ring_bytes(clock.model_bytes, p)
    if delay == 0:  # blocking average, as local SGD: wait for the last worker, then the all-reduce
      idle = idle + (arrival - end)
      end = np.full(p, ready)
      applied, age = True, 0
    else:
      state['pending_iteration'] = iteration
      state['pending_ready_s'] = ready
  clock.times[:] = end
  uniform = {'snapshot': np.bool_(snapshot), 'apply_average': np.bool_(applied), 'average_age': np.int32(age)}
  return idle, uniform, communicated


@dataclasses.dataclass(frozen=True)
class DelayedAverage(base.TimeRule):
  """DaSGD (`dasgd`): rounds of tau local steps; the round's average is applied d steps into the next round.

  Worker i steps without waiting (start_i(t+1) = end_i(t)). After step t with (t+1) mod tau == 0 it snapshots;
  the mean is applied after step t + d (0 <= d <= tau), where worker i waits until R (see module docstring):
    end_i(t + d) = max(c_i(t + d), R).
  d = 0 is local SGD with H = tau (`PeriodicAverage`). Idle: the wait at the apply step (for d = 0: waiting
  for the last worker, as in local SGD). Reference: Zhou et al., "DaSGD: Squeezing SGD Parallelization
  Performance in Distributed Training Using Delayed Averaging".

  Schedule: `DelayedAverageSchedule`.
  """
  period: int        # tau
  delay: int         # d
  microbatches: int = 1

  schedule_type = DelayedAverageSchedule

  def __post_init__(self):
    base.check_positive_int(self.period, 'period')
    base.check_positive_int(self.delay, 'delay', minimum=0)
    base.check_positive_int(self.microbatches, 'microbatches')
    if self.delay > self.period:
      raise ValueError(f'delay={self.delay} must be <= period={self.period}')

  def iterate(self, clock: "Clock", iteration: int) -> base.Iteration:
    p = clock.workers
    finished = clock.work(np.arange(p), clock.times, self.microbatches)
    idle, uniform, communicated = _delayed_average(
        clock, iteration, finished, (iteration + 1) % self.period == 0, self.delay)
    schedule = DelayedAverageSchedule(microbatches_done=base.full(p, self.microbatches, np.int32), **uniform)
    return base.Iteration(schedule=schedule, idle=idle, bytes_communicated=communicated, staleness=np.zeros(p))


@dataclasses.dataclass(frozen=True)
class NodeThreads(base.TimeRule):
  """LAP-SGD / LPP-SGD (`lap_sgd`, `lpp_sgd`): Q threads per node, non-blocking averaging every H updates.

  One worker = one node; one iteration = one node-level update on every node. Q threads share the node's
  accelerator (choice): one node update costs X(b Q) / Q, the time of a batch Q times larger spread over Q
  updates; with the per-micro-batch compute model that is (sum of Q*m micro-batch times) / Q, so its mean is
  m x (mean micro-batch time) and its spread shrinks with Q. Threads take turns in round-robin order (equal
  speeds): the update of iteration t comes from thread t mod Q, whose gradient was computed on the node model
  as of update t - Q + 1.
  Averaging: after update t with `averages_at(t)` the node snapshots and the all-reduce starts; the mean is
  applied d updates later, d = `delay_steps`, or when None ceil(allreduce(P) / nominal update time), the
  nominal update time being m x the compute model's mean (fixed for the run, computed once).
  Averaging costs nothing on the critical path unless it takes longer than d updates (then the node waits
  at the apply step, see module docstring). With Q = 1 and d = 0 this is local SGD (`PeriodicAverage`).
  Reference: Chatterjee, Kungurtsev, Alistarh, "Local SGD Meets Asynchrony".

  Schedule: `NodeThreadsSchedule`.
  """
  threads: int                       # Q
  averages_at: Callable[[int], bool]
  microbatches: int = 1
  delay_steps: Optional[int] = None  # d; None: from the network model

  schedule_type = NodeThreadsSchedule

  def __post_init__(self):
    base.check_positive_int(self.threads, 'threads')
    base.check_positive_int(self.microbatches, 'microbatches')
    if self.delay_steps is not None:
      base.check_positive_int(self.delay_steps, 'delay_steps', minimum=0)

  def delay(self, clock: "Clock") -> int:
    """d: updates between a snapshot and applying its mean."""
    if self.delay_steps is not None:
      return self.delay_steps
    if 'delay_steps' not in clock.rule_state:
      allreduce = clock.network.allreduce(clock.model_bytes, clock.workers)
      update = self.microbatches * clock.compute.mean()
      clock.rule_state['delay_steps'] = int(math.ceil(allreduce / update)) if 0 < update < math.inf else 0
    return int(clock.rule_state['delay_steps'])

  def iterate(self, clock: "Clock", iteration: int) -> base.Iteration:
    p, q = clock.workers, self.threads
    delay = self.delay(clock)
    finished = clock.work(np.arange(p), clock.times, q * self.microbatches, time_scale=1.0 / q)
    idle, uniform, communicated = _delayed_average(
        clock, iteration, finished, bool(self.averages_at(iteration)), delay)
    schedule = NodeThreadsSchedule(microbatches_done=base.full(p, self.microbatches, np.int32),
                                   thread=np.int32(iteration % q), **uniform)
    return base.Iteration(schedule=schedule, idle=idle, bytes_communicated=communicated, staleness=np.zeros(p))
