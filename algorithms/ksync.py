"""K-sync SGD: the server takes the first K gradients of P and cancels the rest; K = P is synchronous SGD.

Update rule (update t): all learners start from W_t; with S_t the first K learners to finish,
    W_{t+1} = W_t + U((1/K) sum_{i in S_t} g_i(W_t))
computed by the shared parameter-server math (`algorithms.parameter_server`); cancelled work consumes no
samples. Time per update with X ~ Exp(mu), ideal network: (H_P - H_{P-K}) / mu.

Reference: Dutta, Joshi, Ghosh, Dube, Nagpurkar, "Slow and Stale Gradients Can Win the Race: Error-Runtime
Trade-offs in Distributed SGD", AISTATS 2018.
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
  microbatches: int = 1

  def iterate(self, clock: 'Clock', iteration: int) -> rules.Iteration:
    del iteration
    p, m, k = clock.workers, self.microbatches, ps.current_k(self, clock)
    up = clock.network.p2p(clock.model_bytes)
    arrival = clock.work(np.arange(p), clock.times.max(), m) + up
    chosen = np.argsort(arrival, kind='stable')[:k]
    contributed = np.zeros(p, bool)
    contributed[chosen] = True
    update = arrival[chosen[-1]]
    clock.times[:] = update + up
    return rules.Iteration(
        schedule=ps.schedule(p, k, m, contributed), idle=np.where(contributed, update - arrival, 0.0),
        bytes_communicated=float(k + p) * clock.model_bytes, staleness=np.zeros(p),
        measurements={'k': k, 'max_staleness': 0.0})


SPEC = ps.make_spec('ksync', {'k': 4}, lambda config: KSync(k=config.algorithm.k, microbatches=config.microbatches),
                    ps.validate_k, ps.one_job, several_jobs=False)
