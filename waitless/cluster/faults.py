"""Transient delays and worker failures: perturbations that depend on when, or at which job, work runs.

A *job* is one call of `Clock.work`: the micro-batches one worker computes in one go for one contribution (a
mini-batch of m micro-batches, a non-blocking round, one node update of LAP-SGD). Each worker counts its jobs.

- `RandomDelay`: at job index j, the same `count` workers out of P (chosen by a seeded hash of j, so the choice
  needs no state and survives a resume) are delayed by `delay_s` seconds, added to the first micro-batch of
  the job. This is how the WAGMA-SGD paper injects stragglers (every step, 2 random workers of 64 sleep 320 ms,
  the same two on every rank for a given step number); for synchronous rules job j is iteration j. With
  `independent` draws, `count` workers are drawn each uniformly, so that two draws may coincide (fewer workers
  delayed), as the authors' `np.random.randint(size)` twice per step does.
- `Failure`: the listed workers are down during [fail_at_s, return_at_s) of simulated time (forever when
  return_at_s is None; the config writes that as `stragglers.return_at_s = -1`). A micro-batch in progress at
  fail_at_s is lost and restarts from scratch at return_at_s; a micro-batch that would start while the worker
  is down starts at return_at_s. A worker that never returns finishes nothing more: its finish time is +inf.
  Rules that wait for every worker would hang; the clock raises `clock.StalledError` at the first iteration
  that needs the lost worker instead.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
  """The splitmix64 finaliser, vectorised over uint64 arrays (wrap-around arithmetic is intended)."""
  x = x + _GOLDEN
  x = (x ^ (x >> np.uint64(30))) * _M1
  x = (x ^ (x >> np.uint64(27))) * _M2
  return x ^ (x >> np.uint64(31))


@functools.lru_cache(maxsize=1 << 16)
def _delayed_workers(seed: int, count: int, workers: int, job: int, independent: bool = False) -> np.ndarray:
  """bool (workers,): the workers that job index `job` delays. Distinct: the `count` workers of the smallest keys
  splitmix64(splitmix64(seed) ^ splitmix64(job)) + w (distinct: splitmix64 is a bijection); `independent`: the
  workers key(d) mod P of the draws d = 0 .. count-1 (they may coincide). Read-only."""
  root = _splitmix64(np.asarray([seed % 2**64], np.uint64))
  job_key = _splitmix64(root ^ _splitmix64(np.asarray([job], np.uint64)))
  delayed = np.zeros(workers, bool)
  if independent:
    delayed[_splitmix64(job_key + np.arange(count, dtype=np.uint64)) % np.uint64(workers)] = True
    delayed.setflags(write=False)
    return delayed
  keys = _splitmix64(job_key + np.arange(workers, dtype=np.uint64))
  delayed[np.argsort(keys)[:count]] = True
  delayed.setflags(write=False)
  return delayed


@dataclasses.dataclass(frozen=True)
class RandomDelay:
  """Each job index j delays `count` of the `workers` workers by `delay_s` seconds (stateless, seeded);
  `independent`: `count` independent uniform draws, which may coincide."""
  count: int
  delay_s: float
  workers: int
  seed: int
  independent: bool = False

  def delay_of(self, worker: int, job: int) -> float:
    """`delays` of one worker's job, as a float (the event loops' scalar path)."""
    if self.count <= 0 or self.delay_s == 0:
      return 0.0
    if ((self.count >= self.workers and not self.independent) or
        _delayed_workers(self.seed, self.count, self.workers, job, self.independent)[worker]):
      return float(self.delay_s)
    return 0.0

  def delays(self, workers: np.ndarray, jobs: np.ndarray) -> np.ndarray:
    """Extra seconds for the job `jobs[k]` of worker `workers[k]`: float64, same shape as `workers`."""
    workers = np.asarray(workers, np.int64)
    if self.count <= 0 or self.delay_s == 0 or workers.size == 0:
      return np.zeros(workers.shape, np.float64)
    if self.count >= self.workers and not self.independent:
      return np.full(workers.shape, self.delay_s, np.float64)
    jobs = np.broadcast_to(np.asarray(jobs, np.int64), workers.shape).reshape(-1)
    # Every job index once (a block of iterations asks for many workers of few jobs), each from a cache: a rule
    # that runs event by event asks for one worker's job at a time, and the P workers' j-th jobs share a row.
    unique, row = np.unique(jobs, return_inverse=True)
    delayed = np.stack([_delayed_workers(self.seed, self.count, self.workers, int(j), self.independent)
                        for j in unique])
    return np.where(delayed[row.reshape(-1), workers.reshape(-1)], self.delay_s, 0.0).reshape(workers.shape)


@dataclasses.dataclass(frozen=True)
class Failure:
  """Workers `failed` are down during [fail_at_s, return_at_s); `return_at_s=None`: they never come back."""
  failed: tuple[int, ...]
  fail_at_s: float
  return_at_s: Optional[float] = None

  @property
  def back_at(self) -> float:
    return float('inf') if self.return_at_s is None else float(self.return_at_s)

  @property
  def permanent(self) -> int:
    """How many workers are lost for good."""
    return len(self.failed) if self.return_at_s is None else 0

  def affects(self, workers: np.ndarray) -> np.ndarray:
    return np.isin(workers, np.asarray(self.failed, np.int64))

  def run(self, workers: np.ndarray, start: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Finish times of one micro-batch of `seconds` that `workers` would start at `start`, given the outage."""
    finish = start + seconds
    hit = self.affects(workers)
    if not hit.any():
      return finish
    back = self.back_at
    starts_down = (start >= self.fail_at_s) & (start < back)
    interrupted = (start < self.fail_at_s) & (finish > self.fail_at_s)
    with np.errstate(invalid='ignore'):
      restarted = back + seconds  # inf when the worker never comes back
    return np.where(hit & (starts_down | interrupted), restarted, finish)
