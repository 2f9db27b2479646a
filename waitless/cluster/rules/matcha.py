"""MATCHA's time rule (`algorithms/matcha.py`): only the active matchings exchange, each pair waiting for each other.

end_i = max(c_i, max_{active j} c_{partner_j(i)}) + a_i p2p(M), a_i the active matchings that pair i.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, TYPE_CHECKING

import numpy as np

from waitless.algorithms import matcha
from waitless.algorithms.matcha import MatchaSchedule
from waitless.cluster import schedules
from waitless.cluster.rules.waits_for_everyone import WaitsForEveryone

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock

ACTIVATION_STREAM = 0x4D41  # keys the activation draws apart from any other stream of the same seed


@functools.lru_cache(maxsize=64)
def _tables(workers: int, budget: float, graph: matcha.BaseGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(partner index (J, P), matched float64 (J, P), p (J,)) of `plan(workers, budget, graph=graph)` (no alpha
  needed)."""
  partners, _, probs = matcha.matchings(workers, budget, graph)
  table = np.asarray(partners, np.int64).reshape(len(partners), workers)
  return table, (table != np.arange(workers)).astype(np.float64), np.asarray(probs, np.float64)


@dataclasses.dataclass(frozen=True)
class MatchingGossip(WaitsForEveryone):
  """MATCHA (`matcha`): per iteration only the active matchings exchange, each pair waiting for each other.

  The matchings and their probabilities are `plan(P, budget, graph=graph)`'s (the ring by default). Worker i
  finishes its gradient at c_i = start_i + sum_k X_{i,k}; in the active matchings A(k) its partners are
  partner_j(i), j in A(k):
      end_i = max(c_i, max_{j in A(k)} c_{partner_j(i)}) + a_i p2p(M),   a_i = #{j in A(k): i matched in j}
      Idle: end_i - a_i p2p(M) - c_i.
  As in D-PSGD's `RingGossip` (of which budget 1 on the ring is this rule exactly), a worker's exchanges run
  back to back and it does not wait for its partners' other exchanges. Bytes: M per exchange per worker.
  Activations: B_j(k) = U_j < p_j with U ~ Uniform[0, 1)^J from numpy's generator seeded by (seed, 0x4D41, k):
  a pure function of the iteration, so checkpoints need nothing more and blocks equal single iterations.
  Reports `active_matchings`, the number of matchings active per iteration.

  Schedule: `MatchaSchedule`.
  """
  budget: float = 0.5
  seed: int = 0
  microbatches: int = 1
  graph: matcha.BaseGraph = matcha.BaseGraph()

  schedule_type = MatchaSchedule
  reports = {'active_matchings': 'mean'}
  vectorized = True

  def __post_init__(self):
    super().__post_init__()
    matcha.check_plan(self.budget, None)

  def activations(self, workers: int, iteration: int) -> np.ndarray:
    """bool (J,): the matchings of `plan(workers, budget, graph=graph)` active at `iteration`."""
    _, _, probabilities = _tables(workers, float(self.budget), self.graph)
    draws = np.random.default_rng([self.seed, ACTIVATION_STREAM, iteration]).random(len(probabilities))
    return draws < probabilities

  def _gossip(self, finished: np.ndarray, on: np.ndarray, ready: np.ndarray, count: np.ndarray) -> None:
    """ready_i = max(c_i, c of i's active partners); count_i = a_i (in place)."""
    table, matched, _ = _tables(len(finished), float(self.budget), self.graph)
    ready[:] = finished
    count[:] = 0.0
    for j in np.flatnonzero(on):
      np.maximum(ready, finished[table[j]], out=ready)
      count += matched[j]

  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
    p = clock.workers
    finished = self.everyone_computes(clock, clock.times.copy())
    on = self.activations(p, iteration)
    ready, count = np.empty(p), np.empty(p)
    self._gossip(finished, on, ready, count)
    clock.times[:] = ready + count * clock.network.p2p(clock.model_bytes)
    return schedules.Iteration(
        schedule=MatchaSchedule(microbatches_done=schedules.full(p, self.microbatches, np.int32),
                                active=np.int32(np.sum(on.astype(np.int64) << np.arange(len(on))))),
        idle=ready - finished, bytes_communicated=float(count.sum()) * clock.model_bytes, staleness=np.zeros(p),
        measurements={'active_matchings': float(on.sum())})

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> Optional[schedules.Steps]:
    """n calls of `iterate` on compute times drawn ahead (the same float operations); failures: None."""
    jobs = clock.job_seconds(n, self.microbatches)
    if jobs is None:
      return None
    p = clock.workers
    p2p = clock.network.p2p(clock.model_bytes)
    on = np.stack([self.activations(p, iteration + k) for k in range(n)])
    times, ready, count = np.empty((n, p)), np.empty((n, p)), np.empty((n, p))
    finished = np.empty((n, p))
    start = clock.times
    for k in range(n):
      np.add(start, jobs[k], out=finished[k])
      self._gossip(finished[k], on[k], ready[k], count[k])
      times[k] = ready[k] + count[k] * p2p
      start = times[k]
    clock.times[:] = times[-1]
    steps = self.everyone_steps(ready - finished, count.sum(axis=1) * clock.model_bytes, times)
    bits = (on.astype(np.int64) << np.arange(on.shape[1])).sum(axis=1).astype(np.int32)
    return dataclasses.replace(
        steps, schedule=MatchaSchedule(microbatches_done=steps.schedule.microbatches_done, active=bits),
        measurements={'active_matchings': on.sum(axis=1).astype(np.float64)})


def time_rule(config):
  return MatchingGossip(budget=float(config.algorithm.budget), seed=int(config.seed),
                        microbatches=config.microbatches, graph=matcha.base_graph(config))


