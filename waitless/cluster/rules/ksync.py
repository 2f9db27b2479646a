"""K-sync SGD's time rule (`algorithms/ksync.py`): the first K of P gradients, the rest cancelled.

Time per update with X ~ Exp(mu), ideal network: (H_P - H_{P-K}) / mu.

`cancel` says when the slower learners stop: `immediate` (the paper: cancelled at the update, every learner
starts the next round on W_{t+1} at once) or `on_arrival` (what a real runtime does, the Ray runtime's server
included: a job in flight runs to its end, is discarded when it arrives, and its learner fetches the current
model then; a delayed learner can miss several rounds and the rounds after a delay have fewer learners).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from waitless.algorithms import ksync as ksync_math
from waitless.algorithms import parameter_server
from waitless.cluster import schedules
from waitless.cluster.rules import parameter_server as ps

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


@dataclasses.dataclass(frozen=True)
class KSync(ps.KRule):
  """K-sync time rule.

  All learners start round t at S from W_t (fetched). The server takes the first K gradients to arrive and
  cancels the other learners' work (lost: not idle, and their samples are not consumed). The round ends when
  the new model is back at the learners:
    T = K-th smallest (S + X_i + p2p(M)),   end = T + p2p(M);   time per update X_(K) + 2 p2p(M).
  Ties are broken by worker id. Idle: T - arrival_i for the K contributors, 0 for the others.
  Bytes: K pushes + P fetches of M.

  Schedule: `ServerSchedule` with contributions 1 for the first K learners (exactly K), 0 for the others;
  every learner fetches the new model; staleness 0.
  """
  k: int
  fresh_views = True  # every learner fetches the new model
  microbatches: int = 1
  cancel: str = 'immediate'  # or 'on_arrival' (module docstring)

  def __post_init__(self):
    super().__post_init__()
    if self.cancel not in CANCEL:
      raise ValueError(f'cancel={self.cancel!r} must be one of {", ".join(CANCEL)}')

  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
    if self.cancel == 'on_arrival':
      return self._iterate_on_arrival(clock)
    del iteration
    p, m, k = clock.workers, self.microbatches, ps.current_k(self, clock)
    up = clock.network.p2p(clock.model_bytes)
    arrival = clock.work(np.arange(p), clock.times.max(), m) + up
    chosen = np.argsort(arrival, kind='stable')[:k]
    contributed = np.zeros(p, bool)
    contributed[chosen] = True
    update = arrival[chosen[-1]]
    clock.times[:] = update + up
    return schedules.Iteration(
        schedule=parameter_server.schedule(p, k, m, contributed), idle=np.where(contributed, update - arrival, 0.0),
        bytes_communicated=float(k + p) * clock.model_bytes, staleness=np.zeros(p),
        measurements={'k': k, 'max_staleness': 0.0})

  def _iterate_on_arrival(self, clock: 'Clock') -> schedules.Iteration:
    """One update when late jobs are discarded on arrival: learners keep their own finish times and views.

    Arrivals in order (ties: lowest worker id): a job computed on an older model is discarded and its learner
    restarts on W_t when it arrives (+ p2p(M) for the fetch); the first K current ones are taken, their learners
    wait for the update and start on W_{t+1} at T + p2p(M). Idle: T - arrival for the K taken.
    """
    p, m, k = clock.workers, self.microbatches, ps.current_k(self, clock)
    state = ps.init_learners(clock, m)
    finish, view, version = state['finish'], state['view'], int(state['version'])
    up = clock.network.p2p(clock.model_bytes)
    contributed, arrivals, discarded = np.zeros(p, bool), np.zeros(p), 0
    one = np.zeros(1, np.int64)
    while contributed.sum() < k:
      i = int(np.argmin(finish))
      arrival = finish[i] + up
      one[0] = i
      if view[i] < version:  # computed on an older model: discarded, it fetches W_t and starts again
        discarded += 1
        view[i] = version
        finish[i] = clock.work(one, arrival + up, m)[0]
        continue
      contributed[i], arrivals[i], finish[i] = True, arrival, np.inf  # waits for the update
    update = float(arrivals.max())
    chosen = np.flatnonzero(contributed)
    finish[chosen] = clock.work(chosen, update + up, m)
    view[chosen] = version + 1
    state['version'] = version + 1
    clock.times[:] = update + up
    return schedules.Iteration(
        schedule=parameter_server.schedule(p, k, m, contributed), idle=np.where(contributed, update - arrivals, 0.0),
        bytes_communicated=float(2 * k + discarded) * clock.model_bytes, staleness=np.zeros(p),
        measurements={'k': k, 'max_staleness': 0.0})

  vectorized = True

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> schedules.Steps:
    """n calls of `iterate` with numpy over the block (any compute model, delays; failures: `iterate`).

    Every learner starts update t at S_t, so the draws are known ahead. Rounding is monotone, so the K-th
    smallest arrival fl(fl(S_t + J_i) + up) is that of the K-th smallest job time J_(K): the start times
    S_{t+1} = fl(fl(fl(S_t + J_(K)) + up) + up) are a cheap scan, and the rest is whole-block numpy.
    """
    if self.cancel == 'on_arrival':  # each learner's own events: one update at a time
      return ps.loop_block(self, clock, n)
    del iteration
    p, m, k = clock.workers, self.microbatches, ps.current_k(self, clock)
    job = clock.job_seconds(n, m)  # the same draws as `iterate`, counted as consumed
    if job is None:  # failures
      return ps.loop_block(self, clock, n)
    up = clock.network.p2p(clock.model_bytes)
    kth = np.partition(job, k - 1, axis=1)[:, k - 1].tolist()
    start, update, s = [], [], float(clock.times.max())
    for x in kth:
      start.append(s)
      u = (s + x) + up
      update.append(u)
      s = u + up
    update = np.asarray(update)
    arrival = (np.asarray(start)[:, None] + job) + up
    # The first K by (arrival, worker id), as the stable argsort: all below the K-th arrival, then the lowest ids
    # among those equal to it.
    below, tied = arrival < update[:, None], arrival == update[:, None]
    contributed = below | (tied & (np.cumsum(tied, axis=1) <= k - below.sum(axis=1, keepdims=True)))
    clock.times[:] = update[-1] + up
    return schedules.Steps(
        schedule=parameter_server.schedule(p, np.full(n, k), m, contributed),
        idle=np.where(contributed, update[:, None] - arrival, 0.0),
        bytes_communicated=np.full(n, float(k + p) * clock.model_bytes), mean_staleness=np.zeros(n),
        end_time=update + up, measurements={'k': np.full(n, float(k)), 'max_staleness': np.zeros(n)})


CANCEL = ksync_math.CANCEL


def time_rule(config) -> KSync:
  return KSync(k=config.algorithm.k, microbatches=config.microbatches, cancel=config.algorithm.cancel)
