"""K-batch-async SGD's time rule, async SGD's (K = 1) and Ringmaster ASGD's (`algorithms/kbatch_async.py`).

The next K gradients to arrive from any learners; a learner fetches the current model after every push.
Ringmaster (`max_delay` R): a gradient whose delay reaches R is discarded on arrival.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Optional, TYPE_CHECKING

import numpy as np

from waitless import config_errors as errors
from waitless.algorithms import parameter_server
from waitless.cluster import schedules
from waitless.cluster.rules import parameter_server as ps

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


@dataclasses.dataclass(frozen=True)
class KBatchAsync(ps.KRule):
  """K-batch-async time rule; with K = 1 asynchronous SGD; with `max_delay` R, Ringmaster ASGD.

  The server updates after every K gradients from any learners; a learner, after each push, fetches the
  server's current W and starts again at once: no cancellation, no idle time. Events are processed in order
  of arrival (ties: lowest worker id). A push reaches the server at job end + p2p(M); the reply carries the
  model the server holds at that moment: W_t for the first K-1 pushes of update t, W_{t+1} for the K-th (the
  server updates first). The learner starts its next job when the reply arrives, another p2p(M) later.
  The iteration ends at the K-th arrival. Bytes: K pushes + K fetches of M.

  Ringmaster (`max_delay` R >= 1): a gradient whose delay (server versions since its learner fetched its view:
  the staleness) is >= R is discarded on arrival; the learner gets W_t and starts again at once, as after a
  push. The discarded job is not one of the K, consumes no samples (its micro-batches are recomputed), and
  costs a push and a fetch. A learner is discarded at most once per update, before any push of its own in it
  (after a fetch its delay is 0). R = None: no threshold (K-batch-async, async).

  Schedule: `ServerSchedule`: contributions c_i (sum K), the first gradient's staleness, fetch_current for
  learners whose last push was not the K-th or that were discarded and pushed nothing after (view <- W_t),
  refresh_view for the K-th pusher (view <- W_{t+1}), `discarded`. Reports also `discarded` (gradients
  discarded per update) when R is set.
  """
  k: int
  microbatches: int = 1
  max_delay: Optional[int] = None

  vectorized = True

  def __post_init__(self):
    super().__post_init__()
    if self.max_delay is not None:
      errors.require_int(self.max_delay, 'max_delay', 1)

  @property
  def reports(self):
    return ps.KRule.reports if self.max_delay is None else {**ps.KRule.reports, 'discarded': 'sum'}

  def tolerated_failures(self, workers: int) -> int:
    return workers - 1

  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
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
    discarded = np.zeros(p, bool)
    total_staleness = 0
    one = np.zeros(1, np.int64)
    e = 0
    while e < k:
      i = int(np.argmin(finish))
      arrival = finish[i] + up
      stale = version - int(view[i])
      if self.max_delay is not None and stale >= self.max_delay:
        discarded[i] = True  # Ringmaster: dropped; the learner restarts on W_t
        view[i] = version
        fetch_current[i] = True
      else:
        total_staleness += stale
        if counts[i] == 0:
          first_staleness[i] = stale
        counts[i] += 1
        e += 1
        last = e == k
        view[i] = version + 1 if last else version
        fetch_current[i], refresh[i] = not last, last
      one[0] = i
      finish[i] = clock.work(one, arrival + up, m)[0]
    state['version'] = version + 1
    clock.times[:] = arrival
    measurements = {'k': k, 'max_staleness': float(first_staleness.max())}
    if self.max_delay is not None:
      measurements['discarded'] = float(discarded.sum())
    return schedules.Iteration(
        schedule=parameter_server.schedule(p, k, m, counts, staleness=first_staleness, refresh_view=refresh,
                             fetch_current=fetch_current, discarded=discarded),
        idle=np.zeros(p), bytes_communicated=2.0 * (k + int(discarded.sum())) * clock.model_bytes,
        staleness=first_staleness.astype(np.float64), mean_staleness=total_staleness / k,
        measurements=measurements)

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> schedules.Steps:
    """n calls of `iterate`: the same events on plain floats with a heap (ties: lowest worker id, as
    np.argmin) and the compute times drawn ahead (`ps.Draws`); trace, delays, failures: `iterate`."""
    del iteration
    if not ps.Draws.supported(clock):
      return ps.loop_block(self, clock, n)
    p, m, k = clock.workers, self.microbatches, ps.current_k(self, clock)
    state = ps.init_learners(clock, m)
    up = clock.network.p2p(clock.model_bytes)
    r = self.max_delay if self.max_delay is not None else float('inf')
    draws = ps.Draws(clock, m, chunk=n * k + (0 if self.max_delay is None else n * k // 2 + 64))
    rows, scaled, u = draws.rows, draws.factors is not None, 0
    heap, view, version = ps.learner_heap(state)
    # One code per event: learner | kind << 20 | delay << 22, kind 0 push, 1 the K-th push, 2 discarded.
    events, end = [], []
    record, replace = events.append, heapq.heapreplace
    for _ in range(n):
      e = 0
      while e < k:
        f, i = heap[0]
        delay = version - view[i]
        if delay >= r:
          view[i] = version
          record(i | 2 << 20 | delay << 22)
        else:
          e += 1
          if e == k:
            view[i] = version + 1
            record(i | 1 << 20 | delay << 22)
          else:
            view[i] = version
            record(i | delay << 22)
        arrival = f + up
        if u == len(rows):
          draws.more()
        seconds = draws.seconds(rows[u], i) if scaled else rows[u]
        u += 1
        replace(heap, ((arrival + up) + seconds, i))
      version += 1
      end.append(arrival)
    draws.used = u
    draws.close()
    ps.store_learners(state, heap, view, version)
    events, end = np.asarray(events, np.int64), np.asarray(end)
    who, kind, stale = events & 0xFFFFF, (events >> 20) & 3, events >> 22
    ts = np.concatenate(([0], np.cumsum(kind == 1)[:-1]))  # an update ends at its K-th push
    ps.count_jobs(clock, np.bincount(who, minlength=p), m)
    clock.times[:] = end[-1]
    key = ts * p + who
    pushed = kind < 2
    counts = np.bincount(key[pushed], minlength=n * p).reshape(n, p).astype(np.int32)
    staleness = np.zeros(n * p, np.int32)
    keys, first = np.unique(key[pushed], return_index=True)  # each learner's first push of the update
    staleness[keys] = stale[pushed][first]
    staleness = staleness.reshape(n, p)
    keys, last = np.unique(key[::-1], return_index=True)  # ... and its last event (push or discard)
    final = np.full(n * p, -1, np.int8)
    final[keys] = kind[::-1][last]
    final = final.reshape(n, p)
    discarded = np.zeros(n * p, bool)
    discarded[key[~pushed]] = True
    discarded = discarded.reshape(n, p)
    n_discarded = discarded.sum(axis=1)
    measurements = {'k': np.full(n, float(k)), 'max_staleness': staleness.max(axis=1).astype(np.float64)}
    if self.max_delay is not None:
      measurements['discarded'] = n_discarded.astype(np.float64)
    total = np.bincount(ts[pushed], weights=stale[pushed], minlength=n)
    return schedules.Steps(
        schedule=parameter_server.schedule(p, np.full(n, k), m, counts, staleness=staleness, refresh_view=final == 1,
                             fetch_current=(final == 0) | (final == 2), discarded=discarded),
        idle=np.zeros((n, p)), bytes_communicated=2.0 * (k + n_discarded) * clock.model_bytes,
        mean_staleness=total / k, end_time=end, measurements=measurements)


def _max_delay(config) -> Optional[int]:
  """R of the config: `algorithm.max_delay`, 0 = no threshold (async) or, for `ringmaster`, R = P."""
  r = config.algorithm.max_delay
  if r == 0 and config.algorithm.name == 'ringmaster':
    return config.workers
  return r or None


def time_rule(config) -> KBatchAsync:
  """K-batch-async (`kbatch_async`)."""
  return KBatchAsync(k=config.algorithm.k, microbatches=config.microbatches, max_delay=_max_delay(config))


def async_time_rule(config) -> KBatchAsync:
  """Async SGD and Ringmaster ASGD (`async`, `ringmaster`): K = 1."""
  return KBatchAsync(k=1, microbatches=config.microbatches, max_delay=_max_delay(config))
