"""Non-blocking SGD's time rule (`algorithms/nonblocking.py`): rounds cut at a trigger, partial work counts."""

from __future__ import annotations

import dataclasses
from typing import Optional, TYPE_CHECKING

import numpy as np

from waitless import config_errors as errors
from waitless.algorithms import nonblocking
from waitless.algorithms import spec
from waitless.algorithms.nonblocking import NonBlockingSchedule
from waitless.cluster import network as network_lib
from waitless.cluster import schedules
from waitless.cluster.rules import activation as activation_lib
from waitless.cluster.rules import base
from waitless.cluster.rules import ring

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock

@dataclasses.dataclass(frozen=True)
class NonBlocking(base.TimeRule):
  """Non-blocking rounds (`nonblocking`): m micro-batches each, cut at a trigger, partial work contributed.

  All workers start round t together at S (the end of the previous round's communication) from the same W_t
  and run micro-batches back to back: micro-batch k of worker i finishes at F_{i,k}. Worker i stops at its
  activation A_i, learning of the trigger over the hypercube as WAGMA's activation does
  (`cluster/rules/activation.py`, a = `activation_latency_s` per hop, not 0 on the ideal network):
    fastest:  A_i = min_k (F_{k,m} + popcount(k XOR i) a): the first worker(s) to finish all m send "I am
              done"; the farthest worker learns of it max_i popcount(k XOR i) hops after the first finisher k
              (log2 P for a power of two, at most ceil(log2 P)), a nearer one earlier, and a worker that
              finishes all m before the news reaches it stops at its own F_{i,m}.
    deadline: (choice) the budget B = S + deadline_s is on every worker's clock, and a worker that has
              finished all m just joins the all-reduce, which starts when its last member joins (as sync's
              barrier): A_i = min(F_{i,m}, B), no message, also when everyone finishes before B. The one event
              that needs a message: nobody finished even one micro-batch by B (choice: a round never ends
              empty): the first to finish one announces it, A_i = min_k (F_{k,1} + popcount(k XOR i) a).
  Worker i contributes n_i = #{k : F_{i,k} <= A_i}. The micro-batch it was running at A_i (if n_i < m) is
  abandoned: its time is lost and its samples are NOT consumed; its data stream resumes at that micro-batch
  next round. (choice) The communication starts when the last worker has joined, at max_i A_i (live workers):
  topology='allreduce': allreduce(P); 'ring': D-PSGD gossip, two neighbour exchanges 2 p2p(M), also started
  together (the next round starts together); the next round starts at max_i A_i + communication.
  Time per round (fastest): min_i F_{i,m} - S + the farthest worker's news (at most ceil(log2 P) a; less
  where the far workers finish all m by themselves first) + communication. Idle: max_j A_j - A_i (worker i
  waits, blocked, for the last to join).
  A worker that failed contributes n_i = 0 and is not waited for (it still relays the activation).
  Still idealised: a worker forwards the activation to all its hypercube neighbours at once (popcount hops,
  not a binomial tree's sequential sends), a worker sees the message the moment it arrives, mid-micro-batch
  (polling and progress-thread cost only through a), the all-reduce has no start skew beyond max_i A_i, a
  failed worker still relays, and the deadline clocks are perfectly synchronised.
  Reports per round: `microbatches_mean` and `microbatches_min` (n_i over workers), `abandoned_share`
  (compute seconds lost to abandoned micro-batches / compute seconds spent, all workers).
  Reference: He & Dube, non-blocking mini-batches.

  Schedule: `NonBlockingSchedule`.
  """
  microbatches: int = 1
  trigger: str = 'fastest'
  deadline_s: Optional[float] = None
  topology: str = 'allreduce'
  activation_latency_s: float = spec.DEFAULT_ACTIVATION_LATENCY_S  # a: one hop of the trigger's news

  schedule_type = NonBlockingSchedule
  reports = {'microbatches_mean': 'mean', 'microbatches_min': 'mean', 'abandoned_share': 'mean'}
  vectorized = True

  def __post_init__(self):
    errors.require_int(self.microbatches, 'microbatches', 1)
    if self.trigger not in nonblocking.TRIGGERS:
      raise ValueError(f'trigger={self.trigger!r} must be one of {nonblocking.TRIGGERS}')
    if self.trigger == 'deadline' and not (self.deadline_s is not None and self.deadline_s > 0):
      raise ValueError(f'trigger=deadline needs deadline_s > 0, got {self.deadline_s!r}')
    if self.topology not in nonblocking.TOPOLOGIES:
      raise ValueError(f'topology={self.topology!r} must be one of {nonblocking.TOPOLOGIES}')
    activation_lib.check_latency(self.activation_latency_s)

  def tolerated_failures(self, workers: int) -> int:
    return workers - 1

  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
    del iteration
    p, m = clock.workers, self.microbatches
    workers = np.arange(p)
    start = clock.times.max()
    finish = clock.work_each(workers, start, m)  # (P, m)
    a = float(self.activation_latency_s)
    if self.trigger == 'fastest':
      activation = activation_lib.activation_times(finish[:, -1], a)
    else:
      budget = start + self.deadline_s
      if finish[:, 0].min() <= budget:
        activation = np.minimum(finish[:, -1], budget)
      else:
        activation = activation_lib.activation_times(finish[:, 0], a)
    live = finish[:, -1] < np.inf  # a worker down for good is not waited for
    joined = activation[live].max()
    done = (finish <= activation[:, None]).sum(axis=1)
    # When the worker began the micro-batch it was running at A_i (S if it finished none).
    began = np.where(done > 0, finish[workers, np.maximum(done - 1, 0)], start)
    running = (done < m) & (began < activation)
    # The abandoned micro-batch was started (its compute-trace position is used up) if it began before A_i.
    clock.consume(workers, done + running)
    comm, communicated = self._communication(clock)
    clock.times[:] = joined + comm
    spent = np.minimum(finish[:, -1], activation) - start
    lost = np.where(running, activation - began, 0.0)
    total = spent.sum()
    return schedules.Iteration(
        schedule=nonblocking.round_schedule(done, m),
        idle=np.where(live, joined - activation, 0.0), bytes_communicated=communicated,
        staleness=np.zeros(p),
        measurements={'microbatches_mean': float(done.mean()), 'microbatches_min': float(done.min()),
                      'abandoned_share': float(lost.sum() / total) if total > 0 else 0.0})

  def _communication(self, clock: 'Clock') -> tuple[float, float]:
    """(seconds, bytes) of the round's communication."""
    p = clock.workers
    if self.topology == 'allreduce':
      return clock.network.allreduce(clock.model_bytes, p), network_lib.ring_bytes(clock.model_bytes, p)
    exchanges = ring.ring_neighbours(p)
    return exchanges * clock.network.p2p(clock.model_bytes), float(p * exchanges) * clock.model_bytes

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> Optional[schedules.Steps]:
    """n calls of `iterate` with numpy: every worker starts each round at the same S, so only the round's
    last activation max_i A_i feeds the next round. It is a scalar chain (rounding is monotone:
    min_i (S + x_i) = S + min_i x_i exactly), run on floats: with f(x) = x + a rounded,
    A_i = min_k f^popcount(k XOR i)(c_k) (`activation_lib.activation_times`); when the second earliest c is
    >= f^e(min c), e the first arrival k*'s eccentricity max_i popcount(k* XOR i), nobody else lowers any
    A_i, so max_i A_i = f^e(min c); otherwise that round's relaxation runs on its P values. The whole
    (n, P) activations follow after the loop (the same operations, elementwise), and the rest of every round
    on whole arrays. A trace (it replays by the unit position, which depends on what the previous rounds
    consumed) or failures: None (one `iterate` at a time)."""
    del iteration
    p, m = clock.workers, self.microbatches
    seconds = clock.draw_jobs(n, m, consume=False)
    if seconds is None:
      return None
    # (m, n, P): micro-batch k of worker i ends at S + elapsed[k, ., i] (micro-batch-major: whole planes below)
    elapsed = np.ascontiguousarray(seconds.transpose(2, 0, 1))
    for k in range(1, m):  # np.cumsum's additions, plane by plane
      np.add(elapsed[k - 1], elapsed[k], out=elapsed[k])
    a = float(self.activation_latency_s)
    eccentricity = activation_lib.eccentricity(p).tolist()
    comm, communicated = self._communication(clock)
    # The events that spread as messages: all m done (fastest), one done after the deadline (deadline).
    news = elapsed[-1] if self.trigger == 'fastest' else elapsed[0]
    if p > 1:
      first_two = np.argpartition(news, 1, axis=1)[:, :2]
      first, (earliest, second) = first_two[:, 0].tolist(), np.take_along_axis(news, first_two, axis=1).T.tolist()
    else:
      first, earliest, second = [0] * n, news[:, 0].tolist(), [np.inf] * n
    if self.trigger == 'deadline':
      slowest = elapsed[-1].max(axis=1).tolist()
    start = clock.times.max()
    starts, joins = [], []
    for k in range(n):
      starts.append(start)
      if self.trigger == 'deadline' and start + earliest[k] <= start + self.deadline_s:
        joined = min(start + slowest[k], start + self.deadline_s)
      else:
        joined = start + earliest[k]
        for _ in range(eccentricity[first[k]]):
          joined = joined + a
        if start + second[k] < joined:  # another early arrival may lower some A_i: the relaxation
          joined = activation_lib.activation_times(start + news[k], a).max()
      joins.append(joined)
      start = joined + comm
    start, joined = np.asarray(starts)[:, None], np.asarray(joins)
    finish = np.add(start, elapsed, out=elapsed)
    if self.trigger == 'fastest':
      activation = activation_lib.activation_times(finish[-1], a)
    else:
      budget = start + self.deadline_s
      activation = np.where(finish[0].min(axis=1, keepdims=True) <= budget, np.minimum(finish[-1], budget),
                            activation_lib.activation_times(finish[0], a))
    done = (finish <= activation).sum(axis=0)
    began = np.where(done > 0, np.take_along_axis(finish, np.maximum(done - 1, 0)[None], axis=0)[0], start)
    running = (done < m) & (began < activation)
    clock.count_started((done + running).sum(axis=0), n)
    end = joined + comm
    clock.times[:] = end[-1]
    spent = (np.minimum(finish[-1], activation) - start).sum(axis=1)
    lost = np.where(running, activation - began, 0.0).sum(axis=1)
    share = np.zeros(n)
    np.divide(lost, spent, out=share, where=spent > 0)
    return schedules.Steps(
        schedule=nonblocking.round_schedule(done, m),
        idle=joined[:, None] - activation, bytes_communicated=np.full(n, communicated),
        mean_staleness=np.zeros(n), end_time=end, times=np.repeat(end[:, None], p, axis=1),
        measurements={'microbatches_mean': done.mean(axis=1), 'microbatches_min': done.min(axis=1).astype(np.float64),
                      'abandoned_share': share})


def time_rule(config):
  a = config.algorithm
  return NonBlocking(microbatches=config.microbatches, trigger=a.trigger,
                     deadline_s=a.deadline_s if a.trigger == 'deadline' else None, topology=a.topology,
                     activation_latency_s=float(a.activation_latency_s))
