"""K-batch-async SGD, and asynchronous SGD (`async`, K = 1): update after every K gradients, no idle time.

Update rule (update t): with B_t the next K gradients to arrive from any learners, each computed at the view
its learner held when it started,
    W_{t+1} = W_t + U((1/K) sum_{b in B_t} lambda_b g_b(W_{tau_b})),
and a learner fetches the server's current model after every push. Time per update with X ~ Exp(mu), ideal
network: K / (P mu) in the long run; async 1 / (P mu).

Reference: Dutta et al., "Slow and Stale Gradients Can Win the Race", AISTATS 2018.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from algorithms import parameter_server as ps
from cluster import rules

if TYPE_CHECKING:
  from cluster.clock import Clock


@dataclasses.dataclass(frozen=True)
class KBatchAsync(ps.KRule):
  """K-batch-async time rule; with K = 1 asynchronous SGD.

  The server updates after every K gradients from any learners; a learner, after each push, fetches the
  server's current W and starts again at once: no cancellation, no idle time. Events are processed in order
  of arrival (ties: lowest worker id). A push reaches the server at job end + p2p(M); the reply carries the
  model the server holds at that moment: W_t for the first K-1 pushes of update t, W_{t+1} for the K-th (the
  server updates first). The learner starts its next job when the reply arrives, another p2p(M) later.
  The iteration ends at the K-th arrival. Bytes: K pushes + K fetches of M.

  Schedule: `ServerSchedule`: contributions c_i (sum K), the first gradient's staleness, fetch_current for
  learners whose last push was not the K-th (view <- W_t), refresh_view for the K-th pusher (view <- W_{t+1}).
  """
  k: int
  microbatches: int = 1

  def tolerated_failures(self, workers: int) -> int:
    return workers - 1

  def iterate(self, clock: 'Clock', iteration: int) -> rules.Iteration:
    del iteration
    p, m, k = clock.workers, self.microbatches, ps.current_k(self, clock)
    state = ps.init_learners(clock, m)
    finish, view = state['finish'], state['view']
    version = state['version']
    up = clock.network.p2p(clock.model_bytes)
    counts = np.zeros(p, np.int32)
    first_staleness = np.zeros(p, np.int32)
    fetch_current = np.zeros(p, bool)
    refresh = np.zeros(p, bool)
    total_staleness = 0
    one = np.zeros(1, np.int64)
    for e in range(k):
      i = int(np.argmin(finish))
      arrival = finish[i] + up
      stale = version - int(view[i])
      total_staleness += stale
      if counts[i] == 0:
        first_staleness[i] = stale
      counts[i] += 1
      last = e == k - 1
      view[i] = version + 1 if last else version
      fetch_current[i], refresh[i] = not last, last
      one[0] = i
      finish[i] = clock.work(one, arrival + up, m)[0]
    state['version'] = version + 1
    clock.times[:] = arrival
    return rules.Iteration(
        schedule=ps.schedule(p, k, m, counts, staleness=first_staleness, refresh_view=refresh,
                             fetch_current=fetch_current),
        idle=np.zeros(p), bytes_communicated=2.0 * k * clock.model_bytes,
        staleness=first_staleness.astype(np.float64), mean_staleness=total_staleness / k,
        measurements={'k': k, 'max_staleness': float(first_staleness.max())})


def validate(config) -> None:
  ps.validate_k(config)
  ps.validate_adaptive_lr(config.algorithm)


def validate_async(config) -> None:
  ps.validate_adaptive_lr(config.algorithm)


SPEC = ps.make_spec('kbatch_async', {'k': 4, **ps.ADAPTIVE_LR_DEFAULTS},
                    lambda config: KBatchAsync(k=config.algorithm.k, microbatches=config.microbatches),
                    validate, ps.k_jobs, several_jobs=True)
ASYNC = ps.make_spec('async', dict(ps.ADAPTIVE_LR_DEFAULTS),
                     lambda config: KBatchAsync(k=1, microbatches=config.microbatches),
                     validate_async, ps.one_job, several_jobs=False)
