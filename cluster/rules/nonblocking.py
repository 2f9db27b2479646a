"""Time rule of non-blocking SGD (He & Dube): a round ends at a trigger; workers give what they finished."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, TYPE_CHECKING

import numpy as np

from cluster import network as network_lib
from cluster.rules import base
from cluster.rules import synchronous

if TYPE_CHECKING:
  from cluster.clock import Clock

TRIGGERS = ('fastest', 'deadline')
TOPOLOGIES = ('allreduce', 'ring')


class NonBlockingSchedule(NamedTuple):
  """Schedule of one non-blocking round."""
  microbatches_done: np.ndarray  # int32 (P,), n_i in 0..m: finished micro-batches worker i contributes (these,
  #                                and only these, are consumed from its data stream)
  abandoned: np.ndarray          # bool (P,), n_i < m: worker i dropped an unfinished micro-batch at the trigger
  UNIFORM = ()


@dataclasses.dataclass(frozen=True)
class NonBlocking(base.TimeRule):
  """Non-blocking rounds (`nonblocking`): m micro-batches each, cut at a trigger, partial work contributed.

  All workers start round t together at S (the end of the previous round's communication) from the same W_t
  and run micro-batches back to back: micro-batch k of worker i finishes at F_{i,k}. The trigger T is
    fastest:  T = min_i F_{i,m}                       (the first worker to finish all m)
    deadline: T = min(S + deadline_s, max_i F_{i,m})  (a time budget; no point waiting once all are done),
              and at least min_i F_{i,1} (choice: a round never ends with no finished micro-batch at all).
  Worker i contributes n_i = #{k : F_{i,k} <= T} micro-batches. The micro-batch it was running at T (if
  n_i < m) is abandoned: its time is lost and its samples are NOT consumed; its data stream resumes at that
  micro-batch next round. Then the contributions are all-reduced (topology='allreduce': allreduce(P);
  'ring': D-PSGD gossip, two neighbour exchanges 2 p2p(M)), and the next round starts at T + communication.
  Time per round (fastest): min_i (time for worker i to finish m micro-batches) + communication.
  Idle: T - F_{i,m} for workers that finished all m (they wait for the trigger), else 0.
  A worker that failed contributes n_i = 0; the rule proceeds without it.
  Reference: He & Dube, non-blocking synchronous SGD.

  Schedule: `NonBlockingSchedule`.
  """
  microbatches: int = 1
  trigger: str = 'fastest'
  deadline_s: Optional[float] = None
  topology: str = 'allreduce'

  schedule_type = NonBlockingSchedule

  def __post_init__(self):
    base.check_positive_int(self.microbatches, 'microbatches')
    if self.trigger not in TRIGGERS:
      raise ValueError(f'trigger={self.trigger!r} must be one of {TRIGGERS}')
    if self.trigger == 'deadline' and not (self.deadline_s is not None and self.deadline_s > 0):
      raise ValueError(f'trigger=deadline needs deadline_s > 0, got {self.deadline_s!r}')
    if self.topology not in TOPOLOGIES:
      raise ValueError(f'topology={self.topology!r} must be one of {TOPOLOGIES}')

  def tolerated_failures(self, workers: int) -> int:
    return workers - 1

  def iterate(self, clock: "Clock", iteration: int) -> base.Iteration:
    del iteration
    p, m = clock.workers, self.microbatches
    workers = np.arange(p)
    start = clock.times.max()
    finish = clock.work_each(workers, start, m)  # (P, m)
    if self.trigger == 'fastest':
      trigger = finish[:, -1].min()
    else:
      trigger = max(min(start + self.deadline_s, finish[:, -1].max()), finish[:, 0].min())
    done = (finish <= trigger).sum(axis=1)
    # The abandoned micro-batch was started (its compute-trace position is used up) if it began before T.
    began = np.where(done > 0, finish[np.arange(p), np.maximum(done - 1, 0)], start)
    clock.consume(workers, done + ((done < m) & (began < trigger)))
    if self.topology == 'allreduce':
      comm = clock.network.allreduce(clock.model_bytes, p)
      communicated = network_lib.ring_bytes(clock.model_bytes, p)
    else:
      exchanges = synchronous.ring_neighbours(p)
      comm = exchanges * clock.network.p2p(clock.model_bytes)
      communicated = float(p * exchanges) * clock.model_bytes
    clock.times[:] = trigger + comm
    return base.Iteration(
        schedule=NonBlockingSchedule(microbatches_done=done.astype(np.int32), abandoned=done < m),
        idle=np.where(done == m, trigger - finish[:, -1], 0.0), bytes_communicated=communicated,
        staleness=np.zeros(p))
