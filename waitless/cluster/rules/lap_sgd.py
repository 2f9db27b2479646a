"""LAP-SGD and LPP-SGD's time rule (`algorithms/lap_sgd.py`): Q threads per node, non-blocking averaging."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, TYPE_CHECKING

import numpy as np

from waitless import config_errors as errors
from waitless.algorithms import lap_sgd
from waitless.algorithms import local_sgd
from waitless.algorithms.lap_sgd import NodeThreadsSchedule
from waitless.cluster import schedules
from waitless.cluster.rules import base
from waitless.cluster.rules import delayed_averaging_time as delayed_rules

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


@dataclasses.dataclass(frozen=True)
class NodeThreads(base.TimeRule):
  """LAP-SGD / LPP-SGD (`lap_sgd`, `lpp_sgd`): Q threads per node, non-blocking averaging every H updates.

  One worker = one node; one iteration = one node-level update on every node. Q threads share the node's
  accelerator (choice): the Q updates k Q .. k Q + Q - 1 together consume Q*m micro-batches, whose times the
  clock draws once, at update k Q: X_i(b Q); each of them costs X_i(b Q) / Q (times `partial_cost` for an
  LPP partial step). Compute time thus follows the data consumed: the same data costs the same time for
  every Q, but for the per-call overhead o, paid once per call of the Q threads' concurrent micro-batches
  (`Clock.work(..., per_call=Q)`): X_i(b Q) = m o + the Q*m per-sample parts (times worker i's factor).
  Threads take turns in round-robin order: update t applies thread t mod Q's gradient, computed on the node
  model of update t - Q + 1, staleness min(t, Q - 1) updates (reported as `staleness` and in
  `thread_staleness`).
  Averaging: after update t with `averages_at(t)` the node snapshots and the all-reduce starts; the mean is
  applied d updates later (`cluster.rules.delayed_averaging_time`): d = `delay_steps`, or when None
  max(1, ceil(allreduce(P) / nominal update time)), the nominal update being m x the mean micro-batch time
  with Q micro-batches per call, m (o / Q + mean per-sample part) (`Clock.mean_unit_seconds`; fixed for
  the run, computed once). d >= 1 even on the ideal network: d = 0 would make the average a
  barrier, so a faster network would make LAP-SGD slower; `delay_steps=0` asks for it (Q = 1: local SGD's
  `PeriodicAverage`). The node waits at the apply step only for what the d updates did not hide.
  Reference: Chatterjee, Kungurtsev, Alistarh, "Local SGD Meets Asynchrony".

  Schedule: `NodeThreadsSchedule`. Reports `thread_staleness` (mean over a window).
  """
  threads: int                       # Q
  averages_at: Callable[[int], bool]
  microbatches: int = 1
  delay_steps: Optional[int] = None  # d; None: from the network model
  prepass_steps: Optional[int] = None  # LPP: partial steps from here on (see `partial_at`); None: LAP
  partial_cost: float = 1.0          # LPP: a partial step's share of a full step's compute (choice)

  schedule_type = NodeThreadsSchedule
  reports = {'thread_staleness': 'mean'}
  vectorized = True

  def __post_init__(self):
    errors.require_int(self.threads, 'threads', 1)
    errors.require_int(self.microbatches, 'microbatches', 1)
    if self.delay_steps is not None:
      errors.require_int(self.delay_steps, 'delay_steps', 0)
    if self.prepass_steps is not None:
      errors.require_int(self.prepass_steps, 'prepass_steps', 0)
    errors.require_number(self.partial_cost, 'partial_cost', 'must be in (0, 1]', lambda c: 0 < c <= 1)

  def delay(self, clock: 'Clock') -> int:
    """d: updates between a snapshot and applying its mean."""
    if self.delay_steps is not None:
      return self.delay_steps
    if 'delay_steps' not in clock.rule_state:
      allreduce = clock.network.allreduce(clock.model_bytes, clock.workers)
      update = self.microbatches * clock.mean_unit_seconds(self.threads)
      ratio = allreduce / update if 0 < update < math.inf else 0.0
      clock.rule_state['delay_steps'] = max(1, int(math.ceil(ratio - 1e-9)))
    return int(clock.rule_state['delay_steps'])

  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
    p, q = clock.workers, self.threads
    delay = self.delay(clock)
    state = clock.rule_state
    if iteration % q == 0 or 'thread_batch_s' not in state:  # the Q threads' batches: one draw of Q*m
      state['thread_batch_s'] = (clock.work(np.arange(p), clock.times, q * self.microbatches, per_call=q)
                                 - clock.times)
    partial = bool(lap_sgd.partial_at(iteration, q, self.prepass_steps))
    cost = np.asarray(state['thread_batch_s'], np.float64) / q * (self.partial_cost if partial else 1.0)
    finished = clock.times + cost
    idle, uniform, communicated = delayed_rules.delayed_average_step(
        clock, iteration, finished, bool(self.averages_at(iteration)), delay)
    stale = float(min(iteration, q - 1))
    schedule = NodeThreadsSchedule(microbatches_done=schedules.full(p, self.microbatches, np.int32),
                                   thread=np.int32(iteration % q), partial=np.bool_(partial), **uniform)
    return schedules.Iteration(schedule=schedule, idle=idle, bytes_communicated=communicated,
                               staleness=np.full(p, stale), measurements={'thread_staleness': stale})

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> Optional[schedules.Steps]:
    """n calls of `iterate`: the block's draws of Q*m micro-batches taken at once, each worker's times a
    running sum of its update costs between draws and averaging events (`delayed_average_block`). A draw's
    cost is computed as `iterate` computes it, from the times when it is drawn. Failures: None."""
    if clock.failure is not None:
      return None
    p, q = clock.workers, self.threads
    delay = self.delay(clock)
    state = clock.rule_state
    steps = iteration + np.arange(n)
    draws = np.flatnonzero(steps % q == 0).tolist()
    if 'thread_batch_s' not in state and draws[:1] != [0]:
      draws.insert(0, 0)
    seconds = clock.job_seconds(len(draws), q * self.microbatches, per_call=q) if draws else None
    partial = np.asarray(lap_sgd.partial_at(steps, q, self.prepass_steps), bool)
    scaled = partial if self.partial_cost != 1.0 else np.zeros(n, bool)  # x * 1.0 == x: skip it
    draws.append(n)
    cursor = [0, None if 0 in draws else np.asarray(state['thread_batch_s'], np.float64)]  # next draw, batch

    def chain(times, begin, end, start):
      a = begin
      while a < end:
        k = cursor[0]
        if draws[k] == a:  # the Q threads' batches: X(b Q) per worker, as `iterate` measures it from `start`
          cursor[1] = (start + seconds[k]) - start
          cursor[0] = k = k + 1
        b = min(draws[k], end)
        cost = cursor[1] / q
        rows = times[a:b]
        rows[:] = cost
        if scaled[a:b].any():
          rows[scaled[a:b]] = cost * self.partial_cost
        rows[0] += start
        if b - a > 1:
          np.add.accumulate(rows, axis=0, out=rows)
        start, a = rows[-1], b

    times = np.empty((n, p))
    snapshot = np.fromiter((self.averages_at(t) for t in steps.tolist()), bool, n)
    idle, uniform, communicated = delayed_rules.delayed_average_block(
        clock, iteration, times, snapshot, delay, chain)
    if len(draws) > 1:
      state['thread_batch_s'] = cursor[1]
    stale = np.minimum(steps, q - 1).astype(np.float64)
    schedule = NodeThreadsSchedule(
        microbatches_done=np.full((n, p), self.microbatches, np.int32), thread=(steps % q).astype(np.int32),
        partial=partial, **uniform)
    return schedules.Steps(schedule=schedule, idle=idle, bytes_communicated=communicated, mean_staleness=stale,
                           end_time=times.max(axis=1), times=times, measurements={'thread_staleness': stale})


def time_rule(config):
  a = config.algorithm
  lpp = config.algorithm.name == 'lpp_sgd'
  return NodeThreads(
      threads=a.threads, averages_at=lambda t: bool(local_sgd.averages_at(t, a.local_steps, a.pre_post_steps)),
      microbatches=config.microbatches, delay_steps=a.delay,
      prepass_steps=a.prepass_steps if lpp else None, partial_cost=float(a.partial_cost) if lpp else 1.0)
