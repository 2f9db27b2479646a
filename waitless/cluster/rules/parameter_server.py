"""What the parameter-server family's time rules share (K-sync, K-batch-sync, K-async, K-batch-async, AdaSync).

The math is `algorithms/parameter_server.py`; each variant's rule is `cluster/rules/NAME.py`. Here: the
K-family base rule, the event state of asynchronous learners, and the vectorised simulator path
(`iterate_block`) the variants share.
"""

from __future__ import annotations

import heapq
from typing import Any, TYPE_CHECKING

import numpy as np

from waitless import config_errors as errors
from waitless.algorithms.parameter_server import ServerSchedule
from waitless.cluster import compute as compute_lib
from waitless.cluster import schedules
from waitless.cluster.rules import base

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


def current_k(rule, clock: 'Clock') -> int:
  """K of this update: `clock.rule_state['k']` when set (AdaSync, `Clock.set_k`), else the rule's own."""
  k = int(clock.rule_state.get('k', rule.k))
  if not 1 <= k <= clock.workers:
    raise ValueError(f'{type(rule).__name__}: K={k} must be in 1..{clock.workers} (workers)')
  return k


class KRule(base.TimeRule):
  """Shared by the K-family rules: the schedule, an adjustable K, what they report, failures they survive.

  Reports: `k` (mean over a metrics window) and `max_staleness` (the largest staleness of a gradient applied).
  `fresh_views`: every schedule has every learner fetch the new model (`refresh_view` all true,
  `fetch_current` all false), so the transformation keeps no server copy (the synchronous rules).
  """
  schedule_type = ServerSchedule
  reports = {'k': 'mean', 'max_staleness': 'max'}
  adjustable_k = True
  fresh_views = False

  def __post_init__(self):
    errors.require_int(self.k, 'k', 1)
    errors.require_int(self.microbatches, 'microbatches', 1)

  def tolerated_failures(self, workers: int) -> int:
    return workers - self.k


def init_learners(clock: 'Clock', m: int) -> dict[str, Any]:
  """Event state of asynchronous learners: each starts a mini-batch on W_0 at the current time."""
  state = clock.rule_state
  if 'finish' not in state:
    state['finish'] = clock.work(np.arange(clock.workers), clock.times.max(), m)  # float64 (P,)
    state['view'] = np.zeros(clock.workers, np.int64)  # server version each in-flight job computes on
    state['version'] = 0                                # server updates so far
  return state


def learner_heap(state: dict[str, Any]) -> tuple[list[tuple[float, int]], list[int], int]:
  """(heap of (finish time, learner), views as a list, version) of `init_learners`' state, for an event loop."""
  heap = [(f, i) for i, f in enumerate(state['finish'].tolist())]
  heapq.heapify(heap)
  return heap, state['view'].tolist(), int(state['version'])


def store_learners(state: dict[str, Any], heap: list[tuple[float, int]], view: list[int], version: int) -> None:
  """Writes an event loop's heap, views and version back into `init_learners`' state."""
  finish = np.empty(len(heap))
  for f, i in heap:
    finish[i] = f
  state['finish'], state['view'], state['version'] = finish, np.asarray(view, np.int64), version


# ---- the vectorised simulator path (`iterate_block`) shared by the variants ----
#
# Each variant keeps its event loop in `iterate` (one update at a time; AdaSync drives it, and it is the float
# reference of `iterate_block` in tests/algorithms/test_ps_simulator.py). `iterate_block` gives the same
# schedules, times and random draws for a block of n updates: the compute times are drawn in bulk from the
# clock's generator (a generator hands out the same stream whether asked for one number at a time or many) and
# the events are replayed on plain floats (a heap) or, where the order of events within an update does not
# depend on the previous update, on whole blocks with numpy. Where the draws cannot be taken ahead (a trace,
# transient delays, failures: they depend on each worker's job count or on time), `loop_block` runs `iterate`.

class Draws:
  """Micro-batch compute times drawn ahead from the clock's generator, handed out one job at a time.

  Only for models whose draws do not depend on the worker or its position (an i.i.d. distribution, optionally
  times a fixed per-worker factor) and without failures: `Draws.supported(clock)`. A job of worker w takes the
  sum (`np.cumsum` order) of its m micro-batch times z * factor[w], its transient delay (`faults.RandomDelay`,
  by the worker's job index) added to the first, as `Clock.work`. Event loops read `rows` in order (`more()`
  when they run out; `seconds(row, w)` when `factors` is set, as it is with a delay, else a row is already a
  job's seconds) and set `used`; `close()` puts back what was drawn and not used, so the generator ends
  exactly where the event loop's would. Rules that read `bulk` alone handle no delay (`clock.delay is None`).
  """

  def __init__(self, clock: 'Clock', m: int, chunk: int = 0):
    compute = clock.compute
    self.factors = None
    if isinstance(compute, compute_lib.SlowWorkers):
      compute, self.factors = compute.base, np.asarray(compute.factors, np.float64).tolist()
    self._delay = clock.delay
    if self._delay is not None:
      self.factors = self.factors or [1.0] * clock.workers  # x * 1.0 == x: the rows stay micro-batch times
      self._jobs = clock.jobs.tolist()  # each worker's next job index, counted here (the rule counts the clock's)
    self._model, self._m, self._chunk = compute, m, max(int(chunk), 16)
    self._rng = clock.rng  # the clock's only source of randomness
    self._saved = self._rng.bit_generator.state
    self.rows: list = []
    self.used = 0

  @staticmethod
  def supported(clock: 'Clock') -> bool:
    return not compute_lib.reads_units(clock.compute) and clock.failure is None

  def bulk(self, jobs: int) -> np.ndarray:
    """float64 (jobs, m) of base times z, drawn now (for rules that use every draw: no `close`)."""
    shape = (jobs, self._m)
    zeros = np.zeros(shape, np.int64)
    return np.asarray(self._model.sample(self._rng, zeros, zeros), np.float64).reshape(shape)

  def more(self) -> None:
    z = self.bulk(self._chunk)
    if self.factors is None:  # no per-worker factor: whole jobs now
      self.rows.extend(scaled_job_seconds(z, None).tolist())
    else:
      self.rows.extend(z[:, 0].tolist() if self._m == 1 else z.tolist())

  def seconds(self, row, worker: int) -> float:
    """Seconds of the next job of `worker` from its row (with `factors`), its transient delay included."""
    f = self.factors[worker]
    first = row * f if self._m == 1 else row[0] * f
    if self._delay is not None:
      job = self._jobs[worker]
      self._jobs[worker] = job + 1
      first = first + self._delay.delay_of(worker, job)
    if self._m == 1:
      return first
    total = first
    for x in row[1:]:
      total = total + x * f
    return total

  def close(self) -> None:
    """Rewinds the generator and redraws exactly the jobs used (the same stream, nothing more)."""
    if self.used < len(self.rows):
      self._rng.bit_generator.state = self._saved
      if self.used:
        self.bulk(self.used)


def scaled_job_seconds(z: np.ndarray, factors) -> np.ndarray:
  """Seconds of jobs from base draws z (..., m) and the factors of their workers (broadcast to z[..., 0])."""
  if factors is not None:
    z = z * np.asarray(factors, np.float64)[..., None]
  return np.cumsum(z, axis=-1)[..., -1]


def count_jobs(clock: 'Clock', jobs: np.ndarray, m: int) -> None:
  """Advances the clock's unit and job counters by `jobs` (P,) jobs of m micro-batches per worker."""
  jobs = np.asarray(jobs, np.int64)
  clock.count_started(jobs * m, jobs)


def concat_steps(parts: list[schedules.Steps]) -> schedules.Steps:
  if len(parts) == 1:
    return parts[0]
  cat = lambda values: np.concatenate(values, axis=0)
  return schedules.Steps(
      schedule=type(parts[0].schedule)(*(cat(v) for v in zip(*(p.schedule for p in parts)))),
      idle=cat([p.idle for p in parts]), bytes_communicated=cat([p.bytes_communicated for p in parts]),
      mean_staleness=cat([p.mean_staleness for p in parts]), end_time=cat([p.end_time for p in parts]),
      measurements={key: cat([p.measurements[key] for p in parts]) for key in parts[0].measurements})


def loop_block(rule, clock: 'Clock', n: int) -> schedules.Steps:
  """n calls of `rule.iterate` as a `Steps` (the fallback of `iterate_block`); stops at a stalled update."""
  its, ends = [], []
  for _ in range(n):
    it = rule.iterate(clock, clock.iteration + len(its))
    its.append(it)
    ends.append(float(clock.times.max()))
    if not np.isfinite(ends[-1]):
      break
  return schedules.Steps(
      schedule=schedules.stack([it.schedule for it in its]), idle=np.stack([it.idle for it in its]),
      bytes_communicated=np.array([it.bytes_communicated for it in its], np.float64),
      mean_staleness=np.array([it.staleness.mean() if it.mean_staleness is None else it.mean_staleness
                               for it in its], np.float64),
      end_time=np.array(ends), measurements={key: np.array([it.measurements[key] for it in its], np.float64)
                                             for key in rule.reports})
