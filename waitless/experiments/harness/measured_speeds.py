"""Non-blocking SGD on real hardware: per-device micro-batch counts from host-measured speeds (He & Dube).

One `shard_map` program is lock-step: every collective waits for all its participants, so without the
simulator's schedule `nonblocking` is synchronous SGD. What a lock-step program can still do is give a slow
device less work. This is He & Dube's idea (every worker contributes the micro-batches it finished when the
round ends) with a deadline computed on the host in place of the first finisher's "I am done" message. A call
of device d on n micro-batches is modelled as t = c_d + n s_d (a fixed per-call cost c_d: dispatch, launch,
host sync; s_d seconds per micro-batch), fitted from its measured calls:
    c_d, s_d  = least-squares line through device d's last `window` (n, seconds) calls
    deadline  = min_d (c_d + m s_d)         (the time the fastest device needs for all m micro-batches)
    n_d       = clip(floor((deadline + slack - c_d) / s_d), 1, m),   slack = max(tolerance deadline, min_slack_s)
The slack (defaults: tolerance 0.1, min_slack_s 1 ms) is how far past the deadline the round may run to let a
device finish its micro-batches: without it, two equally fast devices split by noise in the fitted speeds give
the slower-looking one m - 1. The absolute floor is the resolution of a host-timed call on a loaded machine,
where a short call's noise exceeds any fraction of its deadline.
Device d then runs exactly n_d micro-batches, a real `lax.while_loop` whose trip count is a per-device input
(not a masked scan over all m), and the all-reduce weights each device by what it ran: the update is
`nonblocking.nonblocking_sgd` with `microbatches_done` = n_d, g = (sum_d G_d) / (sum_d n_d), W <- W + U(g).

How a process measures its speed inside a lock-step program: each iteration is two jitted calls.
  1. `gradients`: the local gradient sums only (no collective, so nothing waits for another process), timed on
     the host from dispatch to `block_until_ready` of this process's shards: the seconds of one call on n
     micro-batches, n the largest count of this process's devices (they share one measurement).
  2. `apply`: the all-reduce and update of `nonblocking_sgd`, plus an all-gather of every process's measurement,
     so that every process holds the same table of calls and computes the same counts for the next iteration.
The slow device's smaller n_d shortens its call 1, so it reaches the all-reduce about when the fast ones do:
the barrier remains, the waiting at it is what shrinks. Savings that survive on real hardware: the fast
devices' idle time, minus one extra dispatch per iteration. What does not: a device that slows down within
an iteration (the counts follow the fit, one iteration late), and abandoned work (none: a device never starts
a micro-batch it will not finish, unlike the simulated rule, which cuts one mid-way).

The per-call cost: measured as seconds / n, c would count as c / n per micro-batch, so a device cut to few
micro-batches would look slower than it is, and one cut to 1 could stay at 1. The line is
`cluster/calibration.py`'s `fit_overhead`, the one the simulator's compute model is calibrated with (a negative
intercept clamped to 0). Two sizes to fit from: `MeasuredStep` starts with a short warm-up, the compiling call
(not measured), then one call at n = m and one at n = 1 on every device (`probe`). A window that holds one
size only (a device kept at the same count for `window` calls), or times that do not grow with n (noise),
keeps the previous c_d and folds (t - c_d) / n into a moving average of s_d (c_d reset to 0 when t <= c_d);
with c_d = 0 that is the plain seconds / n estimate. Not modelled: a c_d that drifts while a device stays at
one size (the split between c and s is then the last fit's), and a noisy call in a two-point window, which
tilts the line until it leaves the window (nothing probes again once the counts settle).

Reference: He & Dube, "Accelerating Parallel Stochastic Gradient Descent via Non-blocking Mini-batches".
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from waitless import config_errors as errors
from waitless.algorithms import nonblocking
from waitless.cluster import calibration


def _require_seconds(value, field: str, devices: Optional[int] = None) -> np.ndarray:
  """`value` as a float64 (devices,) array of finite seconds > 0, else a one-line ConfigError naming `field`."""
  table = np.asarray(value, np.float64) if np.size(value) else np.zeros(0)
  errors.require(table.ndim == 1 and table.size >= 1, field, value, 'must be a non-empty list of seconds')
  if devices is not None:
    errors.require(table.size == devices, field, value, f'has {table.size} entries; needs one per device ({devices})')
  errors.require(bool(np.all(np.isfinite(table)) and np.all(table > 0)), field, value,
                 'every entry must be a finite number of seconds > 0')
  return table


def microbatch_counts(seconds_per_microbatch: Sequence[float], microbatches: int,
                      deadline_s: Optional[float] = None, overhead_s: Optional[Sequence[float]] = None,
                      tolerance: float = 0.0, min_slack_s: float = 0.0) -> np.ndarray:
  """n_d = clip(floor((deadline + slack - c_d) / s_d), 1, m), slack = max(tolerance deadline, min_slack_s): the
  micro-batches device d finishes by the deadline, the slack allowed over.

  Args:
    seconds_per_microbatch: s_d, one per device, finite and > 0.
    microbatches: m, the micro-batches of a full local batch.
    deadline_s: the round's budget in seconds; None (default) is min_d (c_d + m s_d), the time the fastest
      device needs for all m (He & Dube's trigger, the first finisher, known in advance from the speeds).
    overhead_s: c_d, each device's fixed seconds per call, finite and >= 0; None (default) is 0 for all.
    tolerance: >= 0, the fraction of the deadline the round may run over (0: He & Dube's rule exactly).
    min_slack_s: >= 0, seconds the round may run over whatever the deadline (the timing's resolution).

  Returns:
    int32 (devices,) counts in 1..m; the fastest device gets m when `deadline_s` is None.
  """
  errors.require_int(microbatches, 'microbatches', 1)
  seconds = _require_seconds(seconds_per_microbatch, 'seconds_per_microbatch')
  overhead = np.zeros_like(seconds) if overhead_s is None else _require_overhead(overhead_s, seconds.size)
  _require_tolerance(tolerance, min_slack_s)
  if deadline_s is None:
    deadline_s = (overhead + microbatches * seconds).min()  # the fastest device's time for all m
  else:
    errors.require_number(deadline_s, 'deadline_s', 'must be a finite number of seconds > 0', lambda v: v > 0)
  # 1e-9 of a micro-batch: a device that ties with the deadline (the fastest one itself, or one as fast) gets
  # the count, not one less when rounding leaves (deadline - c_d) / s_d a few ulps below it.
  slack = max(tolerance * deadline_s, min_slack_s)
  finished = np.floor((deadline_s + slack - overhead) / seconds + 1e-9)
  return np.clip(finished, 1, microbatches).astype(np.int32)


def _require_tolerance(tolerance, min_slack_s) -> None:
  errors.require_number(tolerance, 'tolerance', 'must be a finite number >= 0 (a fraction of the deadline)',
                        lambda v: v >= 0)
  errors.require_number(min_slack_s, 'min_slack_s', 'must be a finite number of seconds >= 0', lambda v: v >= 0)


def _require_overhead(value, devices: int) -> np.ndarray:
  """`value` as a float64 (devices,) array of finite seconds >= 0, else a one-line ConfigError."""
  table = np.asarray(value, np.float64)
  errors.require(table.shape == (devices,), 'overhead_s', value, f'must be a list of one number per device ({devices})')
  errors.require(bool(np.all(np.isfinite(table)) and np.all(table >= 0)), 'overhead_s', value,
                 'every entry must be a finite number of seconds >= 0')
  return table


class MeasuredSpeeds:
  """The host's estimate of each device's call, t = c_d + n s_d, and the counts it implies.

  Two ways to feed it:
    `observe_calls(counts, call_seconds)`: device d ran counts[d] micro-batches in call_seconds[d]. Its last
      `window` calls are fitted with `calibration.fit_overhead` when they hold two or more sizes (c_d, s_d:
      the fit); otherwise (or when the fit fails: times that do not grow with n) c_d stays the previous
      estimate and s_d <- smoothing s_d + (1 - smoothing) (t - c_d) / n (c_d reset to 0 if t <= c_d).
    `observe(seconds_per_microbatch)`: a measurement that has no per-call part: the same moving average of s_d.
  The first observation sets s_d. Before any (and without `initial_seconds`) every device runs all m
  micro-batches: a synchronous iteration, which is also what measures the speeds. `tolerance`, `min_slack_s`:
  see `microbatch_counts` (the module docstring says why 0.1 and 1 ms). `probe` (n_1, n_2, ...): the
  counts of every device before the 1st, 2nd, ... observation, so that the fit has two sizes from the start
  (`MeasuredStep` uses (m, 1)).
  """

  def __init__(self, devices: int, microbatches: int, smoothing: float = 0.5,
               initial_seconds: Optional[Sequence[float]] = None, deadline_s: Optional[float] = None,
               window: int = 8, probe: Sequence[int] = (), tolerance: float = 0.1, min_slack_s: float = 0.001):
    errors.require_int(devices, 'devices', 1)
    errors.require_int(microbatches, 'microbatches', 1)
    errors.require_number(smoothing, 'smoothing', 'must be a number in [0, 1) (the weight of the old average)',
                          lambda v: 0 <= v < 1)
    if deadline_s is not None:
      errors.require_number(deadline_s, 'deadline_s', 'must be a finite number of seconds > 0', lambda v: v > 0)
    errors.require_int(window, 'window', 2)
    _require_tolerance(tolerance, min_slack_s)
    errors.require(all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= microbatches for n in probe),
                   'probe', probe, f'must be a list of micro-batch counts in 1..{microbatches}')
    self.devices, self.microbatches, self.smoothing, self.deadline_s = devices, microbatches, smoothing, deadline_s
    self.window, self.probe, self.tolerance, self.min_slack_s = window, tuple(probe), tolerance, min_slack_s
    self.seconds = None if initial_seconds is None else _require_seconds(initial_seconds, 'initial_seconds', devices)
    self.overhead = np.zeros(devices)  # c_d
    self.fits: list[Optional[calibration.Fit]] = [None] * devices  # each device's last fit; None before one
    self.calls = [collections.deque(maxlen=window) for _ in range(devices)]  # (n, seconds) per device
    self.observations = 0

  def _average(self, observed: np.ndarray, devices: np.ndarray) -> None:
    """s_d <- smoothing s_d + (1 - smoothing) observed_d where `devices` (a mask); the first sets s_d."""
    previous = observed if self.seconds is None else self.seconds
    # a new array: never writes into the caller's `initial_seconds`
    self.seconds = np.where(devices, self.smoothing * previous + (1 - self.smoothing) * observed, previous)

  def observe(self, seconds_per_microbatch: Sequence[float]) -> None:
    """Folds one iteration's measured seconds per micro-batch (one per device, no per-call part) into s_d."""
    observed = _require_seconds(seconds_per_microbatch, 'seconds_per_microbatch', self.devices)
    self._average(observed, np.ones(self.devices, bool))
    self.observations += 1

  def observe_calls(self, counts: Sequence[int], call_seconds: Sequence[float]) -> None:
    """Folds one call per device, counts[d] micro-batches in call_seconds[d], into c_d and s_d."""
    n = np.asarray(counts)
    errors.require(n.shape == (self.devices,) and np.issubdtype(n.dtype, np.integer)
                   and bool(np.all((n >= 1) & (n <= self.microbatches))), 'counts', counts,
                   f'must be one micro-batch count in 1..{self.microbatches} per device ({self.devices})')
    t = _require_seconds(call_seconds, 'call_seconds', self.devices)
    fitted = np.zeros(self.devices, bool)
    per_microbatch = np.zeros(self.devices)
    for d in range(self.devices):
      self.calls[d].append((int(n[d]), float(t[d])))
      sizes, seconds = zip(*self.calls[d])
      fit = None
      if len(set(sizes)) > 1:  # one size in the window has no line to fit
        try:
          fit = calibration.fit_overhead(sizes, seconds)
        except ValueError:  # times that do not grow with the size: noise
          pass
      if fit is not None:
        self.fits[d], fitted[d] = fit, True
      else:  # keep c_d, follow s_d
        if t[d] <= self.overhead[d]:
          self.overhead[d] = 0.0
        per_microbatch[d] = (t[d] - self.overhead[d]) / n[d]
    self._average(per_microbatch, ~fitted)
    for d in np.flatnonzero(fitted):
      self.overhead[d], self.seconds[d] = self.fits[d].overhead_s, self.fits[d].per_sample_s
    self.observations += 1

  def counts(self) -> np.ndarray:
    """int32 (devices,) micro-batches each device runs next iteration (`microbatch_counts`); the next `probe`
    count while one is left, m before any measurement."""
    if self.observations < len(self.probe):
      return np.full(self.devices, self.probe[self.observations], np.int32)
    if self.seconds is None:
      return np.full(self.devices, self.microbatches, np.int32)
    return microbatch_counts(self.seconds, self.microbatches, self.deadline_s, self.overhead, self.tolerance,
                             self.min_slack_s)


def local_gradient_sums(value_and_grad: Callable[[Any, Any], tuple[jax.Array, Any]], params, microbatches,
                        count: jax.Array):
  """The gradient and loss sums over the first `count` micro-batches, in a `lax.while_loop` of `count` trips.

  Args:
    value_and_grad: (params, one micro-batch) -> (loss, gradient).
    params: the parameters the gradients are taken at.
    microbatches: a pytree whose leaves have a leading micro-batch axis m.
    count: int32 scalar in 1..m, a traced value: the loop runs exactly `count` trips (the micro-batches beyond
      it are never computed).

  Returns:
    (gradient sum G, loss sum, trips): `trips` is the loop's own counter, the number of bodies that ran.
  """
  def body(carry):
    k, grads, loss = carry
    mb = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, k, keepdims=False), microbatches)
    mb_loss, mb_grads = value_and_grad(params, mb)
    return k + 1, jax.tree.map(jnp.add, grads, mb_grads), loss + mb_loss.astype(loss.dtype)

  # zeros_like(count): the carry keeps the per-device (varying) type under shard_map's check.
  carry = (jnp.zeros_like(count), jax.tree.map(jnp.zeros_like, params), jnp.zeros_like(count, jnp.float32))
  trips, grads, loss = lax.while_loop(lambda carry: carry[0] < count, body, carry)
  return grads, loss, trips


class MeasuredStep:
  """One non-blocking iteration per call on a one-worker-per-device mesh, the counts from measured speeds.

  `step(params, opt_state, microbatches)`: params and opt_state (D, ...) sharded over `axis_name` (every device
  its copy, kept identical by the all-reduce), microbatches (D, m, ...) likewise. Returns the new params,
  opt_state and the mean loss over all finished micro-batches. `last_counts` holds the counts it used,
  `last_trips` (D,) the while loops' own trip counters, `speeds` the fitted c_d + n s_d (`MeasuredSpeeds`) and
  `timed_seconds` this process's last measured gradient call. The first three calls are the warm-up (compile,
  then n = m and n = 1 on every device: the fit's two sizes).

  Example (one process, D devices; with `jax.distributed` every process runs the same lines):
    step = MeasuredStep(lambda w, mb: loss(w, mb), optax.sgd(0.1), mesh, microbatches=4)
    for batch in batches:
      params, opt_state, loss = step(params, opt_state, batch)
  """

  def __init__(self, loss_fn: Callable[[Any, Any], jax.Array], inner: optax.GradientTransformation, mesh: Mesh,
               microbatches: int, axis_name: str = 'workers', smoothing: float = 0.5,
               deadline_s: Optional[float] = None, window: int = 8, tolerance: float = 0.1,
               min_slack_s: float = 0.001):
    errors.require(mesh.axis_names == (axis_name,), 'mesh', mesh.axis_names,
                   f'must have the one axis {axis_name!r} (one worker per device: a speed is a device\'s)')
    self.mesh, self.axis_name, self.microbatches = mesh, axis_name, microbatches
    # The warm-up: the compiling call at m (not measured), then one measured call at m and one at 1.
    self.speeds = MeasuredSpeeds(mesh.size, microbatches, smoothing, deadline_s=deadline_s, window=window,
                                 probe=(microbatches, 1) if microbatches > 1 else (), tolerance=tolerance,
                                 min_slack_s=min_slack_s)
    self.tx = nonblocking.nonblocking_sgd(inner, axis_name=axis_name, gradient_sums=True)
    self.per_device = NamedSharding(mesh, PartitionSpec(axis_name))
    self.replicated = NamedSharding(mesh, PartitionSpec())
    self.last_counts, self.last_trips, self.timed_seconds, self._calls = None, None, None, 0
    process = np.array([d.process_index for d in mesh.devices.flat])
    self._mine = np.flatnonzero(process == jax.process_index())  # this process's devices, in mesh order
    self._same_process = process[:, None] == process[None, :]    # (D, D): device j shares device i's process
    value_and_grad = jax.value_and_grad(loss_fn)
    spec = PartitionSpec(axis_name)
    first = lambda tree: jax.tree.map(lambda x: x[0], tree)
    lead = lambda tree: jax.tree.map(lambda x: x[None], tree)

    def device_gradients(params, microbatches, counts):
      return lead(local_gradient_sums(value_and_grad, first(params), first(microbatches), counts[0]))

    def device_apply(params, opt_state, grads, losses, counts, total, seconds):
      params, opt_state, grads = first((params, opt_state, grads))
      schedule = nonblocking.NonBlockingSchedule(
          microbatches_done=counts[0], abandoned=counts[0] < microbatches, microbatches_total=total,
          contributors=jnp.asarray(mesh.size, jnp.int32))
      updates, opt_state = self.tx.update(grads, opt_state, params, schedule=schedule)
      loss = lax.psum(losses[0], axis_name) / total.astype(jnp.float32)
      # Every device's measurement in its slot, summed: the one table every process reads (an all-gather's
      # result is not known to be replicated under shard_map's check; a psum's is).
      table = lax.psum(jnp.zeros(mesh.size, seconds.dtype).at[lax.axis_index(axis_name)].set(seconds[0]), axis_name)
      return lead((optax.apply_updates(params, updates), opt_state)) + (loss, table)

    self.gradients = jax.jit(jax.shard_map(device_gradients, mesh=mesh, in_specs=(spec, spec, spec),
                                           out_specs=(spec, spec, spec)))
    self.apply = jax.jit(jax.shard_map(
        device_apply, mesh=mesh, in_specs=(spec,) * 5 + (PartitionSpec(), spec),
        out_specs=(spec, spec, PartitionSpec(), PartitionSpec())), donate_argnums=(0, 1))

  def _global(self, local: np.ndarray) -> jax.Array:
    """A (D,) per-device array from this process's entries (its devices, in mesh order)."""
    return jax.make_array_from_process_local_data(self.per_device, local, (self.mesh.size,))

  def __call__(self, params, opt_state, microbatches):
    counts = self.speeds.counts()  # the same on every process: the table is all-gathered
    self.last_counts = counts
    local_counts = self._global(counts[self._mine])
    begin = time.perf_counter()
    grads, losses, trips = self.gradients(params, microbatches, local_counts)
    jax.block_until_ready((grads, losses, trips))
    self.timed_seconds = time.perf_counter() - begin
    self.last_trips = trips
    total = jax.device_put(np.int32(counts.sum()), self.replicated)
    params, opt_state, loss, table = self.apply(params, opt_state, grads, losses, local_counts, total,
                                                self._global(np.full(len(self._mine), self.timed_seconds, np.float32)))
    self._calls += 1
    if self._calls > 1:  # the first call's time is mostly compilation
      # The devices of a process ran in parallel and share its one time: the largest count among them set it.
      ran = np.where(self._same_process, counts[None, :], 0).max(axis=1)
      self.speeds.observe_calls(ran, np.asarray(table, np.float64))
    return params, opt_state, loss

