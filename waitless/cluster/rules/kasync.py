"""K-async SGD's time rule (`algorithms/kasync.py`): the first K learners to push, on their (stale) views.

Time per update with X ~ Exp(mu), ideal network: (H_P - H_{P-K}) / mu (memorylessness).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, TYPE_CHECKING

import numpy as np

from waitless.algorithms import parameter_server
from waitless.cluster import schedules
from waitless.cluster.rules import parameter_server as ps

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


@dataclasses.dataclass(frozen=True)
class KAsync(ps.KRule):
  """K-async time rule.

  Learners compute continuously, each on its own view of W. The server waits for the first K learners to push
  (arrival = end of their job + p2p(M)), updates at T = the K-th arrival with their gradients (each computed
  at that learner's view, possibly stale), and only those K learners fetch the new W and start again at
  T + p2p(M); the others keep computing on their views (no cancellation).
  Ties are broken by worker id. Idle: T - arrival_i for the K contributors (they wait for the update), 0 for
  the others. Staleness of a pushed gradient: server version at the update minus the version of the learner's
  view. Bytes: K pushes + K fetches of M. The iteration ends at T (`clock.times` is set to T for every worker;
  the in-flight jobs are in `rule_state`).

  Schedule: `ServerSchedule` with contributions 1 for the K pushers, their staleness, refresh_view = the
  pushers (they fetch W_{t+1}); the others keep their views.
  """
  k: int
  microbatches: int = 1

  vectorized = True

  def _update(self, clock: 'Clock', state: dict[str, Any], k: int, up: float):
    """One server update: (who pushed, their staleness, their arrival times, update time)."""
    finish, view = state['finish'], state['view']
    chosen = np.argsort(finish, kind='stable')[:k]  # ties: lowest worker id first
    arrival = finish[chosen] + up
    update = arrival.max()
    version = state['version']
    stale = version - view[chosen]
    state['version'] = version + 1
    view[chosen] = version + 1
    finish[chosen] = clock.work(chosen, update + up, self.microbatches)
    clock.times[:] = update
    return chosen, stale, arrival, update

  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
    del iteration
    p, m, k = clock.workers, self.microbatches, ps.current_k(self, clock)
    state = ps.init_learners(clock, m)
    chosen, stale, arrival, update = self._update(clock, state, k, clock.network.p2p(clock.model_bytes))
    contributed = np.zeros(p, bool)
    contributed[chosen] = True
    staleness = np.zeros(p, np.int32)
    staleness[chosen] = stale
    idle = np.zeros(p)
    idle[chosen] = update - arrival
    return schedules.Iteration(
        schedule=parameter_server.schedule(p, k, m, contributed, staleness=staleness, refresh_view=contributed),
        idle=idle, bytes_communicated=2.0 * k * clock.model_bytes, staleness=staleness.astype(np.float64),
        mean_staleness=float(stale.mean()), measurements={'k': k, 'max_staleness': float(stale.max())})

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> schedules.Steps:
    """n calls of `iterate`: the same events on plain floats with a heap (ties: lowest worker id, as the
    stable argsort) and the compute times drawn ahead (`ps.Draws`); trace, delays, failures: `iterate`."""
    del iteration
    if not ps.Draws.supported(clock):
      return ps.loop_block(self, clock, n)
    p, m, k = clock.workers, self.microbatches, ps.current_k(self, clock)
    state = ps.init_learners(clock, m)
    up = clock.network.p2p(clock.model_bytes)
    draws = ps.Draws(clock, m, chunk=n * k)  # exactly the n K jobs started
    draws.more()
    rows, scaled, u = draws.rows, draws.factors is not None, 0
    heap, view, version = ps.learner_heap(state)
    who, stale, arrival, end = [], [], [], []
    pop, push = heapq.heappop, heapq.heappush
    for _ in range(n):
      chosen = [pop(heap) for _ in range(k)]
      update = chosen[-1][0] + up  # the largest arrival: finish times come out sorted
      begin = update + up
      for f, i in chosen:
        who.append(i)
        stale.append(version - view[i])
        arrival.append(f + up)
        view[i] = version + 1
        push(heap, (begin + (draws.seconds(rows[u], i) if scaled else rows[u]), i))
        u += 1
      version += 1
      end.append(update)
    draws.used = u
    draws.close()
    ps.store_learners(state, heap, view, version)
    who = np.asarray(who, np.int64).reshape(n, k)
    stale = np.asarray(stale, np.int64).reshape(n, k)
    end = np.asarray(end)
    ps.count_jobs(clock, np.bincount(who.reshape(-1), minlength=p), m)
    clock.times[:] = end[-1]
    contributed = np.zeros((n, p), bool)
    np.put_along_axis(contributed, who, True, axis=1)
    staleness = np.zeros((n, p), np.int32)
    np.put_along_axis(staleness, who, stale.astype(np.int32), axis=1)
    idle = np.zeros((n, p))
    np.put_along_axis(idle, who, end[:, None] - np.asarray(arrival).reshape(n, k), axis=1)
    return schedules.Steps(
        schedule=parameter_server.schedule(p, np.full(n, k), m, contributed, staleness=staleness,
                                           refresh_view=contributed),
        idle=idle, bytes_communicated=np.full(n, 2.0 * k * clock.model_bytes), mean_staleness=stale.sum(axis=1) / k,
        end_time=end, measurements={'k': np.full(n, float(k)), 'max_staleness': stale.max(axis=1).astype(np.float64)})


def time_rule(config) -> KAsync:
  return KAsync(k=config.algorithm.k, microbatches=config.microbatches)
