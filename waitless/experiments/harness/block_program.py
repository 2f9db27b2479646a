"""The block program: n iterations of the worker step (`step.py`) on every worker, as one jitted call.

    for each iteration t of the block (lax.scan):
      every device: the gradient half of its workers that finished work (`microbatches_done` > 0)
      every worker: the update half (tx.update communicates over the worker axes)

One `shard_map` over the devices; the P / D workers of a device are vmapped (`WorkerLayout.per_worker`). The
schedule's per-worker fields are vmapped with the workers, its uniform fields (`Schedule.UNIFORM`) and the step
are not, so conditionals over them stay conditionals. A worker that finished nothing gets a zero gradient sum
without computing one: the device gathers its busy (replica, worker) slots, at most `slots` of them, computes
their gradients and scatters the sums back (on CPU, a loop over exactly the busy slots: `xla_cpu`), and a device
with none skips the computation. That is the arithmetic of the real cluster: one gradient per job, taken when
it is pushed, on the view and micro-batches it started with.

Replicas (`replicas.py`): with a `ReplicaAxis` the program trains R runs at once. Every state leaf is
(R, P, ...), every per-worker input (R, n, P, ...), and one replica's iteration is vmapped over the leading axis
inside the same `shard_map` (the collectives name the worker axes only, so replicas never mix). What differs
between replicas arrives as inputs: their traced values (seed, learning rate, ...), from which each replica's
transformation is built inside the program, and their schedules. A uniform field that every replica shares in a
block is passed once, (n,), and stays unbatched; one that differs, (R, n), is batched.

Rounds: an algorithm with a fixed period R declares `round_length` (its spec). A block of whole rounds may then
scan over rounds, each round's R iterations unrolled with a static `round_position=r` passed to `tx.update`: the
algorithm may issue a collective at a fixed position and consume it positions later, so XLA can run it under the
compute in between (DaSGD's delayed average). The two programs give the same trajectory.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from waitless.experiments.harness import step as step_lib
from waitless.experiments.harness import transfer
from waitless.experiments.harness import workers as workers_lib
from waitless.experiments.harness import xla_cpu

MEASUREMENTS = ('loss', 'l2_grads')  # per iteration and worker; a measured run adds TIMED
TIMED = ('compute_s', 'started_s')


@dataclasses.dataclass(frozen=True)
class ReplicaAxis:
  """R runs in one program (`replicas.py`).

  Attributes:
    count: R.
    build: the traced values of one replica (dotted config path -> scalar, the fields that differ between the
      replicas) -> (its transformation, its seed); called inside the program, once per trace.
    vectorized: replicas as one vectorised computation (`jax.vmap`), or one after another inside the program
      (`lax.map`: the same program, dispatched once).
  """
  count: int
  build: Callable[[Mapping[str, jax.Array]], tuple[optax.GradientTransformationExtraArgs, Any]]
  vectorized: bool = True


def map_replicas(fn: Callable[..., Any], vectorized: bool) -> Callable[..., Any]:
  """`fn` over the leading replica axis of every argument: `jax.vmap`, or a `lax.map` loop (one replica at a
  time, in one program: its conditionals stay real, see `xla_cpu.vectorize_replicas`)."""
  if vectorized:
    return jax.vmap(fn)
  return lambda *args: lax.map(lambda xs: fn(*xs), args)


def gradient_slots(done: np.ndarray, devices: int) -> Optional[int]:
  """The static number of gradients each device computes per iteration of a block, from the host's
  `microbatches_done` of the block, (n, P) or (R, n, P) (device-major workers): None when every worker of every
  replica finished work in every iteration (no slot to skip), else the most slots with work that one device
  has in one iteration, rounded up to a power of two (so that few programs compile), at least 1."""
  done = np.asarray(done)
  if done.ndim == 2:
    done = done[None]
  if np.all(done > 0):
    return None
  replicas, n, workers = done.shape
  busy = (done > 0).reshape(replicas, n, devices, workers // devices).sum(axis=(0, 3)).max()
  return min(replicas * workers // devices, 1 << max(int(busy) - 1, 0).bit_length())


def gradients_computed(done: np.ndarray, devices: int, microbatches: int, finished_only: bool,
                       busy_loop: bool = False) -> int:
  """Micro-batch gradients the block program computes for a block of `microbatches_done`, (n, P) or (R, n, P),
  counted on the host as the program does (compare `done.sum()`, the micro-batch gradients the cluster pushes):
  per iteration and device, every slot when none is skipped (`gradient_slots` None), else `gradient_slots` of
  them on a device with work and none on a device without (with `busy_loop`: its busy slots only); each slot
  scans all `microbatches` (masked beyond its own), or with `finished_only` as many as the most that a slot of
  the device finished (with `busy_loop`: its own count)."""
  done = np.asarray(done)
  if done.ndim == 2:
    done = done[None]
  replicas, n, workers = done.shape
  slots = gradient_slots(done, devices)
  if slots is not None and busy_loop:
    return int(np.sum(np.where(done > 0, done if finished_only else microbatches, 0)))
  per_device = np.moveaxis(done.reshape(replicas, n, devices, workers // devices), 0, 2)  # (n, devices, R, L)
  per_device = per_device.reshape(n, devices, -1)
  everyone = np.full(per_device.shape[:2], per_device.shape[2])
  computing = everyone if slots is None else np.where(per_device.max(-1) > 0, slots, 0)
  trips = per_device.max(-1) if finished_only else microbatches
  return int(np.sum(computing * trips))


def _slot_gradients(gradient, slots_per_device: int, busy_loop: bool):
  """(inputs of every slot, each leaf (S, ...), slots) -> their gradient halves' outputs, each leaf (S, ...):
  computed for every slot (`slots` None), or for the busy ones only (see the module docstring)."""

  def one(params, opt_state, model_state, batch, fields, rng, schedule_type):
    return gradient(params, opt_state, model_state, batch, schedule_type(**fields), rng)

  def idle(params, fields, model_state):
    """A slot without work: zero gradients and loss, its model state unchanged."""
    return (jax.tree.map(jnp.zeros_like, params), jnp.zeros_like(fields['microbatches_done'], jnp.float32),
            model_state)

  def every_slot(inputs, schedule_type):
    one_slot = functools.partial(one, schedule_type=schedule_type)
    if slots_per_device == 1:
      return jax.tree.map(lambda x: x[None], one_slot(*jax.tree.map(lambda x: x[0], inputs)))
    return jax.vmap(one_slot)(*inputs)

  def busy_slots(inputs, schedule_type, slots):
    params, _, model_state, _, fields, _ = inputs
    busy = fields['microbatches_done'] > 0
    index = jnp.nonzero(busy, size=slots, fill_value=slots_per_device)[0]  # padding: past the end, dropped
    take = lambda x: jnp.take(x, jnp.minimum(index, slots_per_device - 1), axis=0)
    computed = jax.vmap(functools.partial(one, schedule_type=schedule_type))(*jax.tree.map(take, inputs))
    return jax.tree.map(lambda base, new: base.at[index].set(new.astype(base.dtype), mode='drop'),
                        idle(params, fields, model_state), computed)

  def busy_loop_slots(inputs, schedule_type):
    """The busy slots one per trip of a while loop, as many trips as busy slots."""
    params, _, model_state, _, fields, _ = inputs
    busy = fields['microbatches_done'] > 0
    index = jnp.nonzero(busy, size=slots_per_device, fill_value=slots_per_device)[0]
    trips = jnp.sum(busy)

    def trip(loop):
      j, out = loop
      computed = one(*jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, index[j], keepdims=False), inputs),
                     schedule_type=schedule_type)
      return j + 1, jax.tree.map(
          lambda base, new: lax.dynamic_update_index_in_dim(base, new.astype(base.dtype), index[j], 0), out, computed)

    _, out = lax.while_loop(lambda loop: loop[0] < trips, trip,
                            (jnp.zeros((), jnp.int32), idle(params, fields, model_state)))
    return out

  def compute(inputs, schedule_type, slots):
    if slots is None:
      return every_slot(inputs, schedule_type)
    if busy_loop:
      return busy_loop_slots(inputs, schedule_type)
    params, _, model_state, _, fields, _ = inputs
    busy = lambda x: (every_slot(x, schedule_type) if slots == slots_per_device
                      else busy_slots(x, schedule_type, slots))
    return lax.cond(jnp.any(fields['microbatches_done'] > 0), busy, lambda _: idle(params, fields, model_state),
                    inputs)

  return compute


def make_block_step(run, replicas: Optional[ReplicaAxis] = None, round_length: Optional[int] = None,
                    stopwatch=None, busy_loop: bool = False):
  """The jitted `(state, packed, data, values, packing, slots) -> (state, measurements)` for a block of n
  iterations of `run` (a `setup.Run`: its task, model, transformation, layout, rule and spec).

  Args (of the returned function):
    state: TrainState, every leaf (P, ...) sharded over the workers (donated); with `replicas`, (R, P, ...).
    packed: the block's inputs (`transfer.pack`): the examples or their indices (n, P, m, b/m, ...), the
      schedule (per-worker fields (n, P), uniform fields (n,)) and the global step of each iteration (n,); with
      `replicas`, every per-worker array has a leading R, and a uniform field that differs between replicas is
      (R, n) ("own"), else (n,) (shared).
    data: the training arrays (N, ...) replicated on every device when the examples come as indices, else None.
    values: with `replicas`, the per-replica inputs of `ReplicaAxis.build`, path -> (R,) replicated; else None.
    packing: static, the `transfer.Packing` of `packed`.
    slots: static, `gradient_slots` of the block's `microbatches_done`: None, every slot computes.
  With `round_length` R, n must be a multiple of R and steps[0] a multiple of R (whole rounds). `stopwatch`:
  time each device's gradient phase (`measured_time.Stopwatch`). `busy_loop`: compute busy slots in a loop
  (`xla_cpu.busy_loop_pays_off`).

  Returns:
    The new state and the measurements packed in one float32 (k n + 1, P) array ((R, k n + 1, P) with replicas;
    `unpack_measurements` on the host): the k = 2 rows of MEASUREMENTS per iteration (k = 4 with a stopwatch:
    also TIMED, each iteration's gradient-phase seconds on the worker's device and when it started), then
    `l2_params`, the norm of each worker's parameters after the block.
  """
  layout, schedule_type = run.layout, run.rule.schedule_type
  local = layout.local
  count = 1 if replicas is None else replicas.count
  slots_per_device = count * local
  norm = xla_cpu.norm(layout.platform)
  gradient = step_lib.make_worker_gradient(run.task, run.model, run.microbatches, run.spec.gradient_params,
                                           run.finished_only)
  slot_gradients = _slot_gradients(gradient, slots_per_device, busy_loop)
  names = MEASUREMENTS + (TIMED if stopwatch is not None else ())
  unit_axes = slots_per_device == 1 and xla_cpu.on_cpu(layout.platform)

  def device_gradients(state, batch, fields, seeds, step, slots):
    """The gradient halves of this device's (replica, worker) slots, every leaf (R, L, ...)."""
    flat = lambda x: x.reshape((slots_per_device,) + x.shape[2:])
    grid = lambda x: jnp.broadcast_to(x, (count, local))
    workers = lax.axis_index(workers_lib.DEVICE_AXIS) * local + jnp.arange(local)
    keys = jax.vmap(lambda s, w: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), step), w))(
        flat(grid(seeds[:, None])), flat(grid(workers[None, :])))
    inputs = (*jax.tree.map(flat, (state.params, state.opt_state, state.model_state, batch)),
              {k: flat(grid(v)) for k, v in fields.items()}, keys)
    out = slot_gradients(inputs, schedule_type, slots)
    return jax.tree.map(lambda x: x.reshape((count, local) + x.shape[1:]), out)

  def worker_updates(state, sums, per_worker, own, shared, step, values, round_position):
    """Every worker's update half, per replica (each replica's transformation built from its values)."""
    def one_replica(state, sums, per_worker, own, values):
      tx = run.tx if replicas is None else replicas.build(values)[0]
      update = step_lib.make_worker_update(tx, run.microbatches, run.spec.gradient_sums, norm)
      lifted = layout.per_worker(lambda s, g, loss, m, fields: update(
          s, g, loss, m, schedule_type(**fields, **own, **shared), step, round_position))
      return lifted(state, *sums, per_worker)

    if replicas is None:
      out = one_replica(*jax.tree.map(lambda x: x[0], (state, sums, per_worker, own)), values)
      return jax.tree.map(lambda x: x[None], out)
    return map_replicas(one_replica, replicas.vectorized)(state, sums, per_worker, own, values)

  def iteration(state, xs, seeds, values, slots, round_position=None):
    """One iteration on this device: (state, its measurements stacked (k, R, L))."""
    batch, per_worker, own, shared, step = xs
    fields = {**per_worker, **{k: v[:, None] for k, v in own.items()}, **shared}
    if stopwatch is None:
      sums = device_gradients(state, batch, fields, seeds, step, slots)
      state, measured = worker_updates(state, sums, per_worker, own, shared, step, values, round_position)
    else:
      state, started = stopwatch.stamp(state)
      sums, finished = stopwatch.stamp(device_gradients(state, batch, fields, seeds, step, slots))
      state, measured = worker_updates(state, sums, per_worker, own, shared, step, values, round_position)
      per_slot = lambda x: jnp.broadcast_to(x, (count, local))
      measured = {**measured, 'compute_s': per_slot(finished - started), 'started_s': per_slot(started)}
    return state, jnp.stack([measured[name] for name in names])

  def device_block(state, packed, data, values, packing, slots):
    examples, per_worker, shared, own, steps = transfer.unpack(packed, packing)
    # The data set lives on the devices: gather this device's workers' micro-batches by index.
    batches = examples if data is None else {k: jnp.take(v, examples, axis=0) for k, v in data.items()}
    if replicas is None:  # one run: a replica axis of 1
      state, batches, per_worker = jax.tree.map(lambda x: x[None], (state, batches, per_worker))
      seeds = jnp.full((1,), run.config.seed, jnp.int32)
    else:
      seeds = values['seed'] if 'seed' in values else jnp.full((count,), run.config.seed, jnp.int32)
    to_front = lambda x: jnp.moveaxis(x, 1, 0)  # (R, n, ...) -> (n, R, ...)
    xs = (jax.tree.map(to_front, batches), jax.tree.map(to_front, per_worker), jax.tree.map(to_front, own),
          shared, steps)
    body = functools.partial(iteration, seeds=seeds, values=values, slots=slots)
    if round_length is None:
      state, measured = xla_cpu.scan(body, state, xs, unit_axes=unit_axes)
    else:
      def one_round(state, xs):
        rows = []
        for r in range(round_length):  # unrolled: positions are static
          state, m = body(state, jax.tree.map(lambda x: x[r], xs), round_position=r)
          rows.append(m)
        return state, jnp.stack(rows)
      rounds = jax.tree.map(lambda x: x.reshape((x.shape[0] // round_length, round_length) + x.shape[1:]), xs)
      state, measured = xla_cpu.scan(one_round, state, rounds, unit_axes=unit_axes)
      measured = measured.reshape((-1,) + measured.shape[2:])
    l2_params = jax.vmap(layout.per_worker(norm))(state.params)  # (R, L)
    n = measured.shape[0]
    rows = jnp.transpose(measured, (2, 1, 0, 3)).reshape((count, len(names) * n, local))  # (n, k, R, L) -> (R, kn, L)
    packed = jnp.concatenate([rows, l2_params[:, None]], axis=1)
    if replicas is None:
      return jax.tree.map(lambda x: x[0], state), packed[0]
    return state, packed

  lead = () if replicas is None else (None,)
  worker = PartitionSpec(*lead, workers_lib.DEVICE_AXIS)
  per_iteration = PartitionSpec(*lead, None, workers_lib.DEVICE_AXIS)
  packed_specs = transfer.Packed(per_worker=per_iteration, batches=per_iteration)

  def block_step(state, packed, data=None, values=None, *, packing, slots=None):
    mapped = layout.shard_map(functools.partial(device_block, packing=packing, slots=slots),
                              in_specs=(worker, packed_specs, PartitionSpec(), PartitionSpec()),
                              out_specs=(worker, per_iteration))
    return mapped(state, packed, data, values)

  return jax.jit(block_step, donate_argnums=(0,), static_argnames=('packing', 'slots'))


def unpack_measurements(packed: np.ndarray, timed: bool = False) -> dict[str, np.ndarray]:
  """The block's measurements on the host, from its packed (k n + 1, P) array (`make_block_step`'s): each of
  MEASUREMENTS (and TIMED when `timed`) (n, P), and `l2_params` (P,); with replicas, each with a leading R."""
  names = MEASUREMENTS + (TIMED if timed else ())
  n = (packed.shape[-2] - 1) // len(names)
  out = {name: packed[..., k * n:(k + 1) * n, :] for k, name in enumerate(names)}
  out['l2_params'] = packed[..., len(names) * n, :]
  return out
