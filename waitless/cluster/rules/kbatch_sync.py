"""K-batch-sync SGD's time rule (`algorithms/kbatch_sync.py`): the first K mini-batch gradients, then cancel.

Time per update with X ~ Exp(mu), ideal network: K / (P mu) (`cancel=immediate`).

`cancel` says when the work in flight at an update stops: `immediate` (the paper: cancelled at the update, every
learner restarts on W_{t+1} at once) or `on_arrival` (what a real runtime does, the Ray runtime's server
included: a job in flight runs to its end and is discarded when it arrives, its learner then fetches the current
model; and a learner waits for the server's reply to each push before its next job). `on_arrival` is Rennala SGD
event by event (ALGORITHMS.md: Rennala is K-batch-sync with K = B), the events of `kbatch_async` with
max_delay=1; its updates are the same as `immediate`'s: K gradients, all computed at W_t.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from waitless.algorithms import kbatch_sync as kbatch_sync_math
from waitless.algorithms import parameter_server
from waitless.cluster import schedules
from waitless.cluster.rules import kbatch_async
from waitless.cluster.rules import parameter_server as ps

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


@dataclasses.dataclass(frozen=True)
class KBatchSync(ps.KRule):
  """K-batch-sync time rule.

  All learners start round t at S from W_t. A learner that finishes a mini-batch pushes it and immediately
  starts another one at the same W_t; the server takes the first K gradients to arrive (a fast learner may give
  several), then cancels all work in progress (`cancel=immediate`; `on_arrival`: `_iterate_on_arrival`):
    T = K-th smallest arrival over all (learner, mini-batch) completions,   end = T + p2p(M).
  Time per update with X ~ Exp(mu) and an ideal network: K / (P mu) on average. Nobody idles.
  Bytes: K pushes + P fetches of M.

  Schedule: `ServerSchedule` with contributions c_i in 0..K (sum K), every learner fetches the new model,
  staleness 0.
  """
  k: int
  fresh_views = True  # every learner fetches the new model
  microbatches: int = 1
  cancel: str = 'immediate'  # or 'on_arrival' (module docstring)

  def __post_init__(self):
    super().__post_init__()
    if self.cancel not in CANCEL:
      raise ValueError(f'cancel={self.cancel!r} must be one of {", ".join(CANCEL)}')

  @property
  def reports(self):
    return ps.KRule.reports if self.cancel == 'immediate' else {**ps.KRule.reports, 'discarded': 'sum'}

  def tolerated_failures(self, workers: int) -> int:
    return workers - 1  # any single learner can deliver all K mini-batches

  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
    if self.cancel == 'on_arrival':
      return self._iterate_on_arrival(clock)
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
    return schedules.Iteration(
        schedule=parameter_server.schedule(p, k, m, counts), idle=np.zeros(p),
        bytes_communicated=float(k + p) * clock.model_bytes, staleness=np.zeros(p),
        measurements={'k': k, 'max_staleness': 0.0})

  def _iterate_on_arrival(self, clock: 'Clock') -> schedules.Iteration:
    """One update when the work in flight is discarded on arrival: Rennala's events, which are K-batch-async's
    with max_delay = 1 (a job computed on an older model than W_t is discarded, its learner gets W_t; a job on
    W_t is taken). The same clock state and events; the schedule in K-batch-sync's form (every learner fetches
    W_{t+1}: `fresh_views`), no staleness. Bytes: a push and a reply of M per arrival."""
    events = kbatch_async.KBatchAsync(k=self.k, microbatches=self.microbatches, max_delay=1).iterate(clock, 0)
    p, k = clock.workers, int(events.schedule.k)
    return schedules.Iteration(
        schedule=parameter_server.schedule(p, k, self.microbatches, events.schedule.contributions), idle=events.idle,
        bytes_communicated=events.bytes_communicated, staleness=np.zeros(p),
        measurements={'k': k, 'max_staleness': 0.0, 'discarded': events.measurements['discarded']})

  vectorized = True

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> schedules.Steps:
    """n calls of `iterate`, the K events of every update replayed for the whole block at once with numpy.

    Update t draws P first jobs, then one job per event, whoever runs it: with an i.i.d. model the draws are
    taken ahead. Which learner finishes when depends on the absolute times fl(S_t + ...), so S_t must be
    exact: predict the events with S = 0, scan the exact S_t along the predicted chain of the K-th event,
    replay the block at those S_t and keep it up to the first update whose events differ (a rounding tie;
    that update was replayed at its exact S_t), then repeat from there. Trace, delays, failures: `iterate`.
    """
    if self.cancel == 'on_arrival':  # each learner's own events: one update at a time
      return ps.loop_block(self, clock, n)
    del iteration
    if not ps.Draws.supported(clock) or clock.delay is not None:  # `bulk` draws carry no delay
      return ps.loop_block(self, clock, n)
    p, m, k = clock.workers, self.microbatches, ps.current_k(self, clock)
    up2 = 2 * clock.network.p2p(clock.model_bytes)
    draws = ps.Draws(clock, m, 0)
    z = draws.bulk(n * (p + k)).reshape(n, p + k, m)
    first = ps.scaled_job_seconds(z[:, :p], draws.factors)  # (n, P)

    def replay(start, lo):
      """(events (n', K) learner ids, event job seconds (n', K), K-th finish (n',)) from update lo."""
      finish = start[:, None] + first[lo:]
      rows = np.arange(len(start))
      events, seconds, last = np.empty((len(start), k), np.int64), np.empty((len(start), k)), None
      for j in range(k):
        i = np.argmin(finish, axis=1)  # ties: lowest learner id, as np.argmin in `iterate`
        last = finish[rows, i]
        f = None if draws.factors is None else np.asarray(draws.factors)[i]
        seconds[:, j] = ps.scaled_job_seconds(z[lo:, p + j], f)
        events[:, j] = i
        finish[rows, i] = last + seconds[:, j]
      return events, seconds, last

    events, seconds, _ = replay(np.zeros(n), 0)
    last, lo, s = np.empty(n), 0, float(clock.times.max())
    while lo < n:
      # Exact S_t along the predicted events: the K-th event's learner's chain of jobs.
      kth = events[lo:, -1]
      own = events[lo:, :-1] == kth[:, None]
      base = first[np.arange(lo, n), kth].tolist()
      chains = {t: seconds[lo + t, :-1][own[t]].tolist() for t in np.flatnonzero(own.any(axis=1)).tolist()}
      start = np.empty(n - lo)
      for t in range(n - lo):
        start[t] = s
        v = s + base[t]
        for x in chains.get(t, ()):
          v = v + x
        s = v + up2
      got, got_seconds, got_last = replay(start, lo)
      bad = np.flatnonzero(np.any(got != events[lo:], axis=1))
      events[lo:], seconds[lo:], last[lo:] = got, got_seconds, got_last
      if not bad.size:
        break
      lo += int(bad[0]) + 1
      s = float(last[lo - 1]) + up2
    counts = np.zeros((n, p), np.int32)
    np.add.at(counts, (np.repeat(np.arange(n), k), events.reshape(-1)), 1)
    ps.count_jobs(clock, n + counts.sum(axis=0), m)
    end = last + up2
    clock.times[:] = end[-1]
    return schedules.Steps(
        schedule=parameter_server.schedule(p, np.full(n, k), m, counts), idle=np.zeros((n, p)),
        bytes_communicated=np.full(n, float(k + p) * clock.model_bytes), mean_staleness=np.zeros(n),
        end_time=end, measurements={'k': np.full(n, float(k)), 'max_staleness': np.zeros(n)})


CANCEL = kbatch_sync_math.CANCEL


def time_rule(config) -> KBatchSync:
  return KBatchSync(k=config.algorithm.k, microbatches=config.microbatches, cancel=config.algorithm.cancel)
