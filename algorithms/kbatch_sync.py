"""K-batch-sync SGD: the first K mini-batch gradients from any learners, all computed at W_t, then cancel.

Update rule (update t): all learners start from W_t; a learner that finishes a mini-batch pushes it and starts
another at W_t; with B_t the first K mini-batch gradients,
    W_{t+1} = W_t + U((1/K) sum_{b in B_t} g_b(W_t)).
This is Rennala SGD (Tyurin & Richtarik 2023) with batch K. Time per update with X ~ Exp(mu), ideal network:
K / (P mu). A learner's c_i gradients are computed on consecutive mini-batches of its stream.

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
class KBatchSync(ps.KRule):
  """K-batch-sync time rule.

  All learners start round t at S from W_t. A learner that finishes a mini-batch pushes it and immediately
  starts another one at the same W_t; the server takes the first K gradients to arrive (a fast learner may give
  several), then cancels all work in progress:
    T = K-th smallest arrival over all (learner, mini-batch) completions,   end = T + p2p(M).
  Time per update with X ~ Exp(mu) and an ideal network: K / (P mu) on average. Nobody idles.
  Bytes: K pushes + P fetches of M.

  Schedule: `ServerSchedule` with contributions c_i in 0..K (sum K), every learner fetches the new model,
  staleness 0.
  """
  k: int
  microbatches: int = 1

  def tolerated_failures(self, workers: int) -> int:
    return workers - 1  # any single learner can deliver all K mini-batches

  def iterate(self, clock: 'Clock', iteration: int) -> rules.Iteration:
    del iteration
    p, m, k = clock.workers, self.microbatches, ps.current_k(self, clock)
    up = clock.network.p2p(clock.model_bytes)
    finish = clock.work(np.arange(p), clock.times.max(), m)
    counts = np.zeros(p, np.int32)
    for _ in range(k):
      i = int(np.argmin(finish))  # ties: lowest worker id first
      counts[i] += 1
      last = finish[i]
      finish[i] = clock.work(np.array([i]), last, m)[0]
    clock.times[:] = last + 2 * up
    return rules.Iteration(
        schedule=ps.schedule(p, k, m, counts), idle=np.zeros(p),
        bytes_communicated=float(k + p) * clock.model_bytes, staleness=np.zeros(p),
        measurements={'k': k, 'max_staleness': 0.0})


SPEC = ps.make_spec('kbatch_sync', {'k': 4},
                    lambda config: KBatchSync(k=config.algorithm.k, microbatches=config.microbatches),
                    ps.validate_k, ps.k_jobs, several_jobs=True)
