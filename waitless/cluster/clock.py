"""The simulated wall-clock: per-worker clocks advanced one iteration at a time by an algorithm's time rule.

The clock is the only owner of randomness about time. It is seeded from the config, and its whole state
(per-worker times, per-worker unit and job counters, the generator, the rule's own state) round-trips through
`state_dict()` / `load_state_dict()` as JSON, so a resumed run sees exactly the schedules an uninterrupted run
would have seen.

What a rule may use (see `cluster/rules/`):
  clock.workers           P
  clock.times             float64 (P,): when each worker finished the previous iteration; the rule sets it to
                          when each worker finished this one. The global time of the iteration is
                          max(previous global time, max(times)), so rules that keep in-flight work in
                          `rule_state` set `times` to the moment the iteration ends (e.g. the server update).
  clock.sim_time          global simulated time at the end of the previous iteration
  clock.network           seconds of a collective; clock.model_bytes: size M of one model copy
  clock.work(...)         finish times of one job (several micro-batches) per worker, with stragglers,
                          per-call overheads (`per_call` micro-batches share one call), transient delays
                          and failures applied; clock.work_each(...) + clock.consume(...)
                          when a rule needs every micro-batch's finish time (non-blocking SGD);
                          clock.draw_jobs(n, ...) draws a whole block's times at once (vectorised rules),
                          clock.job_seconds(n, ...) their per-job sums;
                          clock.rng, clock.snapshot() / restore(...) for rules that draw ahead and rewind,
                          clock.count_started(...) to count what they drew ahead and started
  clock.units, clock.jobs int64 (P,): micro-batches and jobs each worker started (read only: the trace
                          position and the random-delay index; `work`, `consume`, `draw_jobs` and
                          `count_started` advance them)
  clock.compute, clock.delay, clock.failure   the compute model, transient delays and failures (read only)
  clock.mean_unit_seconds nominal seconds of one micro-batch (a rule's fixed estimates)
  clock.rule_state        dict of numpy arrays / numbers / None kept between iterations (checkpointed)
  clock.lost_workers      how many workers fail and never come back

The host's serial work per iteration (`host_s`, a cluster profile's figure or `cluster.host_s`) is charged here,
in one place, not by the rules: after every iteration each worker's clock moves `host_s` on (times its host
factor, `cluster.slow_hosts`: a slower host CPU; the next iteration's work starts that much later), so a lock-step
iteration takes compute + collectives + host_s; and no iteration ends less than `host_s` after the previous one,
which is what the parameter-server family pays (its rules keep in-flight jobs in `rule_state`, which the shift
does not reach: the server's host work per update).
With host_s > 0 every rule runs one iteration at a time (`iterate`; its vectorised block is the same by contract).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Optional, TYPE_CHECKING

import numpy as np

from waitless.cluster import compute as compute_lib
from waitless.cluster import faults
from waitless.cluster import network as network_lib
from waitless.cluster import schedules

if TYPE_CHECKING:  # the rules import the clock; it reads what they return from `cluster.schedules`
  from waitless.cluster.rules.base import TimeRule


class StalledError(RuntimeError):
  """The simulated run can never make progress: a rule waits for a worker that failed for good."""


@dataclasses.dataclass(frozen=True)
class Block:
  """Several iterations' schedules, stacked for one jitted call.

  Attributes:
    schedule: the rule's schedule type with every field stacked: per-worker fields (n, P), uniform (n,).
    duration: float64 (n,): simulated seconds each iteration added to the global clock.
    sim_time: float64 (n,): global simulated time at the end of each iteration.
    idle_fraction: float64 (n,): share of worker-seconds spent waiting in each iteration: sum of `idle` over
      workers / sum over workers of how far the iteration moved their clocks (= P * duration when workers
      move in step); 0 for an iteration of zero length.
    mean_staleness: float64 (n,): mean staleness of the contributions applied in each iteration, in
      iterations (server versions for parameter-server rules), weighted by contributed gradients.
    bytes_communicated: float64 (n,): bytes all workers put on the network together in each iteration.
    idle: float64 (n, P): seconds each worker waited in each iteration (communication time excluded).
    measurements: name -> float64 (n,): what the rule declares in `reports` (e.g. K, WAGMA's `behind`).
  """
  schedule: NamedTuple
  duration: np.ndarray
  sim_time: np.ndarray
  idle_fraction: np.ndarray
  mean_staleness: np.ndarray
  bytes_communicated: np.ndarray
  idle: Optional[np.ndarray] = None
  measurements: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)

  def iterations(self, start: int, stop: int) -> 'Block':
    """Iterations start..stop-1 as a block of their own: what `next_block` returns for them, as a block of n
    iterations is n blocks of one drawn in turn (the training loop draws several blocks at once)."""
    rows = slice(start, stop)
    return Block(schedule=schedules.take(self.schedule, rows), duration=self.duration[rows],
                 sim_time=self.sim_time[rows], idle_fraction=self.idle_fraction[rows],
                 mean_staleness=self.mean_staleness[rows], bytes_communicated=self.bytes_communicated[rows],
                 idle=None if self.idle is None else self.idle[rows],
                 measurements={k: v[rows] for k, v in self.measurements.items()})


def _encode(value: Any) -> Any:
  if isinstance(value, np.ndarray):
    return {'__ndarray__': value.tolist(), 'dtype': value.dtype.str}
  if isinstance(value, np.generic):
    return value.item()
  return value


def _decode(value: Any) -> Any:
  if isinstance(value, dict) and '__ndarray__' in value:
    return np.asarray(value['__ndarray__'], dtype=np.dtype(value['dtype']))
  if isinstance(value, list):  # written by an older version of the clock
    return np.asarray(value)
  return value


class Clock:
  """Per-worker simulated clocks, advanced by a time rule.

  Attributes (read by rules):
    workers: P.
    times: float64 (P,), each worker's current simulated time; rules update it in place.
    network: the network model.
    model_bytes: bytes of one model copy (the size of every averaging message).
    rule_state: dict of numpy arrays or numbers that a stateful rule keeps between iterations.
  """

  def __init__(self, *, workers: int, rule: 'TimeRule', compute: compute_lib.ComputeModel,
               network: network_lib.Network, model_bytes: float, seed: int,
               delay: Optional[faults.RandomDelay] = None, failure: Optional[faults.Failure] = None,
               host_s: float = 0.0, host_factors: Optional[np.ndarray] = None):
    self.workers = workers
    self.host_s = float(host_s)  # seconds of host work added to every worker's clock after each iteration
    # (P,) multipliers of each worker's host work: a slower host CPU does its host work slower too
    # (`cluster.slow_hosts`); ones by default.
    self.host_factors = (np.ones(workers) if host_factors is None else
                         np.asarray(host_factors, np.float64).reshape(workers))
    self.rule = rule
    self.compute = compute
    # For calls that merge several micro-batches (`per_call` > 1): the per-sample model and each worker's
    # overhead per call (zeros without `stragglers.overhead_s`).
    self._per_sample, self._overhead = compute_lib.split_overhead(compute, workers)
    self.network = network
    self.model_bytes = float(model_bytes)
    self.delay = delay if delay is not None and delay.count > 0 and delay.delay_s > 0 else None
    self.failure = failure
    self.times = np.zeros(workers, np.float64)
    self.units = np.zeros(workers, np.int64)  # micro-batches each worker started (trace position)
    self.jobs = np.zeros(workers, np.int64)   # jobs each worker started (random-delay index)
    self.iteration = 0
    self.sim_time = 0.0
    self.rule_state: dict[str, Any] = {}
    self._rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))

  @property
  def lost_workers(self) -> int:
    """Workers that fail and never come back (0 without failures)."""
    return self.failure.permanent if self.failure is not None else 0

  # ---- work: the only way rules turn compute models into time ----

  def _seconds(self, workers: np.ndarray, units: np.ndarray, per_call: int) -> np.ndarray:
    """float64 compute seconds of the given units (workers and units of one shape, the last axis one job's
    units in order); each run of `per_call` consecutive units along the last axis is one call, paying one
    overhead (`compute.split_overhead`). The same random draws for every `per_call`."""
    if per_call == 1 or not self._overhead.any():
      return np.array(self.compute.sample(self._rng, workers, units), np.float64)
    seconds = np.array(self._per_sample.sample(self._rng, workers, units), np.float64)
    seconds[..., ::per_call] += self._overhead[workers[..., ::per_call]]
    return seconds

  def work_each(self, workers: np.ndarray, start, count: int, per_call: int = 1) -> np.ndarray:
    """Finish time of each of `count` micro-batches that each worker runs back to back from `start`.

    Draws the compute times without advancing the unit and job counters: call `consume` with what was
    actually started (a trace replays by position, so an unstarted micro-batch must be read again).

    Args:
      workers: int (L,) distinct worker ids.
      start: float or float64 (L,): when each worker starts.
      count: micro-batches per worker (>= 1).
      per_call: micro-batches merged into one accelerator call, paying the call overhead once (LAP-SGD: the
        Q threads' concurrent micro-batches); 1: every micro-batch is a call.

    Returns:
      float64 (L, count): finish of micro-batch k of worker workers[l] at [l, k] (+inf while the worker is
      down for good).
    """
    workers = np.asarray(workers, np.int64)
    units = self.units[workers][:, None] + np.arange(count)[None, :]
    seconds = self._seconds(np.broadcast_to(workers[:, None], units.shape), units, per_call)
    if self.delay is not None:
      seconds[:, 0] += self.delay.delays(workers, self.jobs[workers])
    start = np.broadcast_to(np.asarray(start, np.float64), workers.shape)
    if self.failure is None:
      return start[:, None] + np.cumsum(seconds, axis=1)
    finish = np.empty_like(seconds)
    t = start
    for k in range(count):
      t = finish[:, k] = self.failure.run(workers, t, seconds[:, k])
    return finish

  def draw_jobs(self, n: int, count: int, consume: bool = True, per_call: int = 1) -> Optional[np.ndarray]:
    """Seconds float64 (n, P, count) of micro-batch k of every worker's job in each of the next n iterations.

    For rules in which every worker starts one job of `count` micro-batches per iteration: the same numbers
    as n calls of `work_each(all workers, ., count)` (or `work`), from one draw of the generator (it hands out
    the same stream for one (n, P, count) request as for n (P, count) ones), transient delays added to each
    job's first micro-batch. `consume`: count the n jobs of `count` units per worker now; False: the rule
    counts the units itself (non-blocking SGD starts fewer) and the jobs. `per_call`: as in `work_each`.

    Returns:
      The seconds, or None where they cannot be drawn ahead: failures (they depend on when work runs), or a
      trace (it replays by unit position) when the units are not counted here.
    """
    if self.failure is not None or (not consume and compute_lib.reads_units(self.compute)):
      return None
    p = self.workers
    workers = np.broadcast_to(np.arange(p)[None, :, None], (n, p, count))
    if compute_lib.reads_units(self.compute):
      units = self.units[None, :, None] + (np.arange(n)[:, None, None] * count + np.arange(count))
    else:
      units = np.zeros((1, 1, 1), np.int64)
    seconds = self._seconds(workers, np.broadcast_to(units, workers.shape), per_call)
    if self.delay is not None:
      seconds[:, :, 0] += self.delay.delays(workers[:, :, 0], self.jobs[None, :] + np.arange(n)[:, None])
    if consume:
      self.units += n * count
      self.jobs += n
    return seconds

  def job_seconds(self, n: int, count: int, per_call: int = 1) -> Optional[np.ndarray]:
    """float64 (n, P): seconds of every worker's job of `count` micro-batches in each of the next n iterations.

    The sum over each job of `draw_jobs(n, count, per_call=per_call)` (in `np.cumsum` order, the order of
    `work`), counted as consumed; None where the jobs cannot be drawn ahead (failures).
    """
    seconds = self.draw_jobs(n, count, per_call=per_call)
    if seconds is None:
      return None
    return np.ascontiguousarray(seconds[:, :, 0] if count == 1 else np.cumsum(seconds, axis=2)[:, :, -1])

  def consume(self, workers: np.ndarray, units) -> None:
    """Counts one job for each of `workers` (distinct) that started `units` micro-batches (int or (L,))."""
    workers = np.asarray(workers, np.int64)
    self.units[workers] += units
    self.jobs[workers] += 1

  def count_started(self, units, jobs) -> None:
    """Counts `units` micro-batches and `jobs` jobs that each worker started (int64 (P,) arrays or numbers).

    For rules that draw compute times ahead without counting them (`draw_jobs(..., consume=False)`, `rng`) and
    learn only afterwards how much of the drawn work started (non-blocking SGD, the parameter-server rules).
    """
    self.units += units
    self.jobs += jobs

  def work(self, workers: np.ndarray, start, count: int, per_call: int = 1) -> np.ndarray:
    """Finish times float64 (L,) of one job of `count` micro-batches per worker, counted as consumed."""
    workers = np.asarray(workers, np.int64)
    if count == 1 and self.failure is None:  # the hot path of event-driven rules: no (L, 1) temporaries
      units = self.units[workers]
      seconds = self.compute.sample(self._rng, workers, units)
      if self.delay is not None:
        seconds = seconds + self.delay.delays(workers, self.jobs[workers])
      self.units[workers] = units + 1
      self.jobs[workers] += 1
      return start + seconds
    finish = self.work_each(workers, start, count, per_call)[:, -1]
    self.consume(workers, count)
    return finish

  def mean_unit_seconds(self, per_call: int = 1) -> float:
    """Expected seconds of one micro-batch, averaged over workers, when `per_call` of them share a call's
    overhead (the compute model's mean for per_call = 1): a rule's nominal time, e.g. LAP-SGD's delay."""
    if per_call == 1 or not self._overhead.any():
      return self.compute.mean()
    return self._per_sample.mean() + float(self._overhead.mean()) / per_call

  # ---- iterations ----

  def next_block(self, n: int) -> Block:
    """Advances n iterations and returns their schedules and timings.

    Raises:
      StalledError: the rule waits for a worker that will never finish (it failed for good).
    """
    if n < 1:
      raise ValueError(f'next_block(n={n}): n must be >= 1')
    with np.errstate(invalid='ignore'):  # inf - inf of a worker that is gone: caught below as a stall
      if self.rule.vectorized and not self.host_s:
        return self._fast_block(n)
      return self._block(n)

  def _stalled(self) -> StalledError:
    if self.failure is not None:
      down = list(self.failure.failed)
      when = f'failed for good at {self.failure.fail_at_s:g} s of simulated time'
    else:
      down, when = np.flatnonzero(~np.isfinite(self.times)).tolist(), 'never finish'
    return StalledError(
        f'worker(s) {down} {when}, and {type(self.rule).__name__} waits for every worker at iteration '
        f'{self.iteration} (simulated time {self.sim_time:.6g} s): the run cannot continue. Set '
        f'stragglers.return_at_s, or use an algorithm that goes on without a worker (ksync / kasync with K < P, '
        f'kbatch_sync, kbatch_async, async, adasync, nonblocking).')

  def _block(self, n: int) -> Block:
    iterations = []
    sim_times, durations, spans = np.zeros(n), np.zeros(n), np.zeros(n)
    for k in range(n):
      before = self.times.sum()
      it = self.rule.iterate(self, self.iteration)
      self._check_measurements(it.measurements)
      if self.host_s:
        self.times += self.host_s * self.host_factors
      latest = float(self.times.max())
      if not np.isfinite(latest):
        raise self._stalled()
      spans[k] = self.times.sum() - before  # worker-seconds of this iteration (workers need not be in step)
      now = max(self.sim_time + self.host_s, latest)
      durations[k] = now - self.sim_time
      self.sim_time = sim_times[k] = now
      self.iteration += 1
      iterations.append(it)
    schedule = schedules.stack([it.schedule for it in iterations])
    idle = np.stack([it.idle for it in iterations])
    staleness = [it.staleness.mean() if it.mean_staleness is None else it.mean_staleness for it in iterations]
    measurements = {key: np.array([it.measurements[key] for it in iterations], np.float64)
                    for key in self.rule.reports}
    return Block(
        schedule=schedule, duration=durations, sim_time=sim_times,
        idle_fraction=np.where(spans > 0, idle.sum(axis=1) / np.maximum(spans, 1e-300), 0.0),
        mean_staleness=np.asarray(staleness, np.float64),
        bytes_communicated=np.array([it.bytes_communicated for it in iterations], np.float64),
        idle=idle, measurements=measurements)

  def _check_measurements(self, measurements: Mapping[str, Any]) -> None:
    if set(measurements) != set(self.rule.reports):
      raise TypeError(f'{type(self.rule).__name__} reported {sorted(measurements)} but declares '
                      f'{sorted(self.rule.reports)}')

  def _fast_block(self, n: int) -> Block:
    """Vectorised rules (the hot event-driven ones) fill whole blocks without per-iteration objects.

    Contract: `rule.iterate_block(clock, iteration, n)` is equivalent to n calls of `iterate` (same random
    draws, same results; tested) and returns a `schedules.Steps`, or None to have this block run one
    `iterate` at a time. Without `Steps.times` every worker's time equals the iteration's end after each of
    its iterations (so worker-seconds = P x duration).
    """
    before = self.times.sum()
    steps = self.rule.iterate_block(self, self.iteration, n)
    if steps is None:  # the rule cannot take this block ahead (e.g. failures): one iteration at a time
      return self._block(n)
    self._check_measurements(steps.measurements)
    if not np.all(np.isfinite(steps.end_time)):
      raise self._stalled()
    sim_times = np.maximum.accumulate(np.maximum(steps.end_time, self.sim_time))
    durations = np.diff(sim_times, prepend=self.sim_time)
    self.sim_time = float(sim_times[-1])
    self.iteration += n
    if steps.times is None:  # every worker in step
      worker_seconds, moved = durations * self.workers, durations
    else:  # worker-seconds as `_block` sums them
      worker_seconds = moved = np.diff(steps.times.sum(axis=1), prepend=before)
    return Block(
        schedule=steps.schedule, duration=durations, sim_time=sim_times,
        idle_fraction=np.where(moved > 0, steps.idle.sum(axis=1) / np.maximum(worker_seconds, 1e-300), 0.0),
        mean_staleness=steps.mean_staleness, bytes_communicated=steps.bytes_communicated,
        idle=steps.idle, measurements=dict(steps.measurements))

  # ---- feedback from training (AdaSync) ----

  def feedback(self, **measurements: float) -> None:
    """Passes training measurements (e.g. `train_loss=`) to rules that adapt to them; others ignore them.

    The training loop calls it after each block with the latest values. A rule stores what it needs in
    `rule_state`, so the effect is checkpointed; a resumed run must replay the same calls to stay exact
    (the loop does, as it reports after the same blocks).
    """
    self.rule.feedback(self, {k: float(v) for k, v in measurements.items()})

  def set_k(self, k: int) -> None:
    """Sets K of a K-family rule (K-sync, K-batch-sync, K-async, K-batch-async) from the next iteration."""
    if not self.rule.adjustable_k:
      raise TypeError(f'{type(self.rule).__name__} has no K to set')
    if not 1 <= int(k) <= self.workers:
      raise ValueError(f'K={k} must be in 1..{self.workers}')
    self.rule_state['k'] = int(k)

  # ---- drawing ahead (vectorised rules) ----

  @property
  def rng(self) -> np.random.Generator:
    """The clock's only source of randomness, for rules that draw compute times ahead of their events
    (`cluster/rules/parameter_server.py: Draws`): what they draw and do not use they must put back (rewind and
    redraw), so the stream stays the one `iterate` would have drawn."""
    return self._rng

  def snapshot(self) -> dict[str, Any]:
    """What a block changes (times, counters, generator, rule state), for `restore` (AdaSync's rewind)."""
    return {'times': self.times.copy(), 'units': self.units.copy(), 'jobs': self.jobs.copy(),
            'rng': self._rng.bit_generator.state,
            'rule_state': {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in self.rule_state.items()}}

  def restore(self, snap: dict[str, Any]) -> None:
    """Back to a `snapshot`; `rule_state` is updated in place (rules hold the dict)."""
    self.times, self.units, self.jobs = snap['times'].copy(), snap['units'].copy(), snap['jobs'].copy()
    self._rng.bit_generator.state = snap['rng']
    self.rule_state.clear()
    self.rule_state.update({k: v.copy() if isinstance(v, np.ndarray) else v for k, v in snap['rule_state'].items()})

  # ---- checkpoints ----

  def state_dict(self) -> dict[str, Any]:
    """JSON-serialisable state; `load_state_dict` of it continues the same sequence.

    Times of a worker that failed for good are +inf, written as JSON `Infinity` (Python's json accepts it).
    """
    return {
        'times': _encode(self.times), 'units': _encode(self.units), 'jobs': _encode(self.jobs),
        'iteration': self.iteration, 'sim_time': self.sim_time, 'rng': self._rng.bit_generator.state,
        'rule_state': {k: _encode(v) for k, v in self.rule_state.items()},
    }

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.times = np.asarray(_decode(state['times']), np.float64)
    self.units = np.asarray(_decode(state['units']), np.int64)
    self.jobs = np.asarray(_decode(state.get('jobs', np.zeros(self.workers, np.int64))), np.int64)
    self.iteration = int(state['iteration'])
    self.sim_time = float(state['sim_time'])
    self._rng.bit_generator.state = state['rng']
    self.rule_state = {k: _decode(v) for k, v in state['rule_state'].items()}
