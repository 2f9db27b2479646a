"""The jitted training step: a block of iterations of one algorithm on every worker.

Per worker and iteration: the gradient of the worker's loss is accumulated over the micro-batches the
schedule says it finished (`microbatches_done`; the others are masked out), each taken where the algorithm's
`gradient_params` hook says, divided by that count, and handed to the algorithm's transformation as
`tx.update(grads, state, params, schedule=..., step=...)`; it communicates over the worker axes and returns
this worker's updates. A block of n iterations is one `lax.scan` inside one `shard_map`, jitted once with the
state donated.

The schedule's per-worker fields are vmapped with the workers that share a device; its uniform fields
(`Schedule.UNIFORM`) and the step number are not, so conditionals over them stay conditionals.

Replicas (`experiments/harness/replicas.py`): with a `ReplicaAxis` the program trains R runs at once. Every state leaf
is (R, P, ...), every per-worker input (R, n, P, ...), and one replica's block is vmapped over the leading axis
inside the same `shard_map` (the collectives name the worker axes only, so replicas never mix). What differs
between replicas arrives as inputs: their traced values (seed, learning rate, ...), from which each replica's
transformation is built inside the program, and their schedules. A uniform schedule field that every replica
shares in a block is passed once, (n,), and stays unbatched, so a conditional over it stays a conditional; one
that differs, (R, n), is batched (its conditionals then run both branches).

Rounds: an algorithm with a fixed period R declares `round_length` (its spec). A block of whole rounds then
scans over rounds, each round's R iterations unrolled with a static `round_position=r` passed to `tx.update`:
the algorithm may issue a collective at a fixed position, with no conditional around it, and consume it
positions later, so XLA can run it under the compute in between (DaSGD's delayed average). Blocks that do not
start and end on round boundaries use the per-iteration path; the two must give the same trajectory. The
training loop asks for the round program on accelerators only (`block_step.rounds_pay_off`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from waitless.algorithms import spec as spec_lib
from waitless.experiments.harness import transfer
from waitless.experiments.harness import workers as workers_lib


class TrainState(NamedTuple):
  params: Any        # per-worker parameters, leading dimension P
  opt_state: Any     # per-worker algorithm state (incl. the inner optimizer's), leading dimension P
  model_state: Any   # per-worker non-parameter collections (batch_stats), leading dimension P; {} if none


def tree_l2(tree, flat: bool = False) -> jax.Array:
  """The Euclidean norm of every leaf of `tree` together, in float32.

  `flat`: the leaves concatenated into one vector, then one sum of squares: two operations whatever the number
  of leaves, against one or two per leaf (`block_step.flat_norms_pay_off`: on XLA:CPU, where every operation of
  the block's loop costs each device's thread its own dispatch, and the threads of 8 virtual devices share the
  cores). The digits MLP's per-iteration gradient norm went from 6 operations to 2 and its loop about 1% faster
  (+0.3% to +1.7% in three in-process comparisons; no norm at all: +2.2%). It holds a copy of the leaves, and
  sums in another order: the last bits of the norm differ."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  if flat:
    vector = jnp.concatenate([x.astype(jnp.float32).ravel() for x in leaves])
    return jnp.sqrt(jnp.sum(jnp.square(vector)))
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def make_worker_gradient(task, model, microbatches: int, gradient_params=spec_lib.at_own_params,
                         finished_only: bool = False, loss_hook: Optional[Callable[[jax.Array], jax.Array]] = None):
  """One worker's gradient: (params, opt_state, model_state, batch (m, b/m, ...), schedule, rng) ->
  (sum of the gradients of the micro-batches it finished, sum of their losses, its model state after them).

  The micro-batches beyond `microbatches_done` are masked out: their loss is masked before differentiation, so
  their gradient is exactly zero (for finite gradients) without a select over the gradient tree per micro-batch,
  and with one micro-batch the gradient is the sum itself. `finished_only`: loop over
  the finished micro-batches only (a while loop; vmapped workers run as many trips as the most any of them
  finished) instead of scanning every slot of the buffer: the same sums, for buffers much larger than what a
  worker finishes (K-batch rules: K mini-batches per worker, about K / P of them used). Each micro-batch's
  gradient is taken where `gradient_params` says (default: the worker's own parameters). `loss_hook`: applied to
  every micro-batch's loss (TEST-ONLY: `experiments.harness.slowdown.loss_hook`, a slower device).
  """
  def masked_loss(params, model_state, batch, rng, used):
    loss, new_model_state = task.loss(model, params, model_state, batch, rng)
    if loss_hook is not None:
      loss = loss_hook(loss)
    return jnp.where(used, loss, jnp.zeros_like(loss)), new_model_state

  grad_fn = jax.value_and_grad(masked_loss, has_aux=True)

  def gradient(params, opt_state, model_state, batch, schedule, rng):
    done = schedule.microbatches_done

    def one(model_state, mb, k):
      at = gradient_params(params, opt_state, schedule, k)
      used = k < done
      (loss, new_model_state), grads = grad_fn(at, model_state, mb, jax.random.fold_in(rng, k), used)
      model_state = jax.tree.map(lambda new, old: jnp.where(used, new, old), new_model_state, model_state)
      return grads, loss.astype(jnp.float32), model_state

    def micro(carry, xs):
      grad_sum, loss_sum, model_state = carry
      grads, loss, model_state = one(model_state, *xs)
      return (jax.tree.map(jnp.add, grad_sum, grads), loss_sum + loss, model_state), None

    if microbatches == 1:  # the sum of one gradient is that gradient
      return one(model_state, jax.tree.map(lambda x: x[0], batch), jnp.zeros((), jnp.int32))
    zeros = jax.tree.map(jnp.zeros_like, params)
    # zeros_like keeps the per-worker (varying) type that the scan's carry must keep under shard_map's check.
    carry = (zeros, jnp.zeros_like(done, jnp.float32), model_state)
    if finished_only:
      def trip(loop):
        k, carry = loop
        mb = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, k, keepdims=False), batch)
        carry, _ = micro(carry, (mb, k))
        return k + 1, carry
      _, carry = lax.while_loop(lambda loop: loop[0] < done, trip, (jnp.zeros_like(done), carry))
    else:
      carry, _ = lax.scan(micro, carry, (batch, jnp.arange(microbatches)))
    return carry

  return gradient


def make_worker_update(tx: optax.GradientTransformationExtraArgs, microbatches: int, gradient_sums: bool = False,
                       flat_norms: bool = False):
  """One worker's update from its gradient sum: (state, grad_sum, loss_sum, model_state, schedule, step) ->
  (state, measurements); `tx.update` communicates over the worker axes.

  Measurements: `loss` (the mean over the finished micro-batches) and `l2_grads` (the norm of their mean
  gradient). With one micro-batch per worker, done is 0 or 1 and the sum is the mean: no division.
  `gradient_sums`: hand `tx.update` the sum over the finished micro-batches, not their mean (the spec's
  `gradient_sums`); the measured `l2_grads` is the mean's norm either way (`flat_norms`: see `tree_l2`'s `flat`).
  """

  def update(state: TrainState, grad_sum, loss_sum, model_state, schedule, step, round_position=None):
    if microbatches == 1:  # done is 0 or 1: the sum is the mean
      grads, loss, count = grad_sum, loss_sum, jnp.ones((), jnp.float32)
    else:
      count = jnp.maximum(schedule.microbatches_done, 1).astype(jnp.float32)
      grads = grad_sum if gradient_sums else jax.tree.map(lambda g: g / count.astype(g.dtype), grad_sum)
      loss = loss_sum / count
    l2_grads = tree_l2(grad_sum, flat_norms) / count  # the mean's norm, without a pass over the mean
    extra = {} if round_position is None else {'round_position': round_position}
    updates, opt_state = tx.update(grads, state.opt_state, state.params, schedule=schedule, step=step, **extra)
    params = optax.apply_updates(state.params, updates)
    return TrainState(params, opt_state, model_state), {'loss': loss, 'l2_grads': l2_grads}

  return update


@dataclasses.dataclass(frozen=True)
class ReplicaAxis:
  """R runs in one program (`experiments/harness/replicas.py`).

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
  time, in one program). A loop keeps each replica's convolutions ungrouped (vmap turns a convolution with
  per-replica kernels into a grouped one, 11x slower on XLA:CPU for a CNN of `nn.Conv`s: the evaluation's choice,
  `evaluation.vectorize_evaluation`) and its conditionals real."""
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
  """Micro-batch gradients the block step computes for a block of `microbatches_done`, (n, P) or (R, n, P),
  counted on the host as the program does: per iteration and device, every slot when none is skipped
  (`gradient_slots` None), else `gradient_slots` of them on a device with work and none on a device without
  (with `busy_loop`: its busy slots, one per trip, each as many micro-batches as it finished with
  `finished_only`);
  each slot scans all `microbatches` (masked beyond its own), or with `finished_only` as many as the most that
  a slot of the device finished. Against `done.sum()`, the micro-batch gradients the cluster pushes."""
  done = np.asarray(done)
  if done.ndim == 2:
    done = done[None]
  replicas, n, workers = done.shape
  slots = gradient_slots(done, devices)
  if slots is not None and busy_loop:  # each busy slot alone: its own finished micro-batches, or all of them
    return int(np.sum(np.where(done > 0, done if finished_only else microbatches, 0)))
  per_device = np.moveaxis(done.reshape(replicas, n, devices, workers // devices), 0, 2)  # (n, devices, R, L)
  per_device = per_device.reshape(n, devices, -1)
  everyone = np.full(per_device.shape[:2], per_device.shape[2])
  computing = everyone if slots is None else np.where(per_device.max(-1) > 0, slots, 0)
  trips = per_device.max(-1) if finished_only else microbatches
  return int(np.sum(computing * trips))


class Stopwatch:
  """The host's clock read inside the block program, around each iteration's gradient phase (measured time).

  One lock-step program cannot time a device from outside: its collectives make every process's call last as
  long as the slowest device's. So the program reads the host clock on each device (a `pure_callback`) right
  before the iteration's gradients and right after them, before the update's collectives: the difference is
  that device's own compute time, its wait at the collectives excluded. Each read is tied into the dataflow
  both ways, by data dependencies the compiler cannot drop: its argument is a scalar that depends on every
  leaf it guards (the first element of each: nothing large is copied to the host), and every leaf that comes
  out is `where(seconds < 0, 0, leaf)` (never true, but the compiler cannot know): the gradients take the
  parameters that come out of the first read, so they cannot start before it, and the update's collectives
  take the gradient sums that come out of the second, so the read cannot slip past them. (An
  `optimization_barrier` did not do it: inside the block's scan the second read landed after the all-reduce,
  and every device measured the slowest one's time.) The selects cost one elementwise pass over the state and
  the gradients per iteration. Reads are seconds since `start()`, which the caller calls right before each
  dispatch (so float32 keeps microseconds); a second dispatch before the first finished would mix origins (the
  measured training loop never looks ahead). A read needs the host's Python lock: while the host thread
  compiles or runs Python, a read waits for it (the loop waits for the block's results with the lock
  released).

  Chosen over two calls per iteration (a gradient call timed on the host, then the update call, as
  `cluster.measured_speeds.MeasuredStep` does): the block program stays one dispatch for n iterations, the
  same program the simulated run compiles plus two host reads per iteration and device, and every device
  is timed on its own (a process with several devices shares one time in the two-call scheme).
  """

  def __init__(self):
    self.origin = time.perf_counter()

  def start(self) -> None:
    self.origin = time.perf_counter()

  def _read(self, _) -> np.ndarray:
    return np.float32(time.perf_counter() - self.origin)

  def stamp(self, tree):
    """(tree, seconds since `start`): the read taken once every leaf of `tree` is computed, and every numeric
    leaf of the returned tree computed only after it."""
    numeric = lambda x: x.size and jnp.issubdtype(x.dtype, jnp.number)
    token = sum((x.ravel()[0].astype(jnp.float32) for x in jax.tree.leaves(tree) if numeric(x)),
                jnp.zeros((), jnp.float32))
    seconds = jax.pure_callback(self._read, jax.ShapeDtypeStruct((), jnp.float32), token)
    after = lambda x: jnp.where(seconds < 0, jnp.zeros_like(x), x) if numeric(x) else x
    return jax.tree.map(after, tree), seconds


def make_block_step(task, model, tx, layout: workers_lib.WorkerLayout, microbatches: int, seed: int,
                    schedule_type: type, gradient_params=spec_lib.at_own_params, round_length: int | None = None,
                    finished_only: bool = False, gradient_sums: bool = False,
                    replicas: Optional[ReplicaAxis] = None, loss_hook: Optional[Callable] = None,
                    stopwatch: Optional[Stopwatch] = None, busy_loop: bool = False, flat_norms: bool = False):
  """The jitted `(state, packed, data, values, spec, slots) -> (state, measurements)` for a block of n
  iterations.

  Per iteration, every device first takes the gradients of its workers that finished work (of every replica),
  then every worker updates (`tx.update`, which communicates). A worker that finished nothing in an iteration
  (a learner still computing, a cancelled one) gets a zero gradient sum without computing one: with `slots`
  the device gathers its busy (replica, worker) slots, at most `slots` of them, computes their gradients and
  scatters the sums back, and a device with none skips the computation (a real conditional). That is the
  arithmetic of the real cluster: one gradient per job, taken when it is pushed, on the view and micro-batches
  it started with (they do not change in between).

  Args (of the returned function):
    state: TrainState, every leaf (P, ...) sharded over the workers (donated); with `replicas`, (R, P, ...).
    packed: the block's inputs (`experiments.harness.transfer.pack`): the examples or their indices (n, P, m, b/m, ...),
      the schedule (the time rule's NamedTuple: per-worker fields (n, P), uniform fields (n,)) and the global
      step of each iteration (n,) (the same for every replica); with `replicas`, every per-worker array has a
      leading R, and a uniform field that differs between replicas is (R, n) ("own"), else (n,) (shared).
    data: the training arrays (N, ...) replicated on every device when the examples come as indices, else None.
    values: with `replicas`, the per-replica inputs of `ReplicaAxis.build`, path -> (R,) replicated; else None.
    spec: static, the `transfer.PackSpec` of `packed`.
    slots: static, `gradient_slots` of the block's `microbatches_done`: None, every slot computes (no skip).
  With `round_length` R, n must be a multiple of R and steps[0] a multiple of R (whole rounds).
  `tx`, `seed`: the run's; with `replicas`, each replica's come from `replicas.build(values)` instead.
  `gradient_params`, `finished_only`, `loss_hook`: see `make_worker_gradient`; `gradient_sums`: see
  `make_worker_update`. `stopwatch`: time each device's gradient phase (`Stopwatch`, measured time).
  `busy_loop`: with `slots`, a device computes its busy slots one after another in a loop of exactly as many
  trips as it has busy slots in the iteration (any `slots` then runs the same program), instead of vmapping the
  block's padded `slots` at once (`block_step.busy_loop_pays_off`: on XLA:CPU, where a vmapped gradient costs
  its slots one after another anyway, so the padding was pure waste: 14 replicas of K-async computed 16 slots
  per device and iteration where 7 were busy).
  `flat_norms`: the measured norms (`l2_grads`, `l2_params`) each one sum over the leaves concatenated
  (`tree_l2`'s `flat`; `block_step.flat_norms_pay_off`: on XLA:CPU).

  Returns:
    The new state and the measurements packed in one float32 (2n + 1, P) array, (R, 2n + 1, P) with replicas
    (`unpack_measurements` on the host): `loss` and `l2_grads` (n, P), per iteration; `l2_params` (P,), the
    norm of each worker's parameters after the block (once per block: a pass over the model per iteration
    cost 2% of the digits step). With `stopwatch`, (4n + 1, P): also `compute_s` and `started_s` (n, P), the
    seconds of each iteration's gradient phase on the worker's device and when it started (seconds since
    `stopwatch.start()`, read on that device's host).
  """
  gradient = make_worker_gradient(task, model, microbatches, gradient_params, finished_only, loss_hook)
  local = layout.local
  count = 1 if replicas is None else replicas.count
  slots_per_device = count * local

  def device_gradients(state, batch, fields, seeds, step, slots):
    """The gradient sums, loss sums and model states of this device's (replica, worker) slots, every leaf
    (R, L, ...): computed for the slots with finished work only (`slots`: see `make_block_step`)."""
    flat = lambda x: x.reshape((slots_per_device,) + x.shape[2:])
    workers = lax.axis_index(workers_lib.DEVICE_AXIS) * local + jnp.arange(local)
    grid = lambda x: jnp.broadcast_to(x, (count, local))
    keys = jax.vmap(lambda s, w: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), step), w))(
        flat(grid(seeds[:, None])), flat(grid(workers[None, :])))
    inputs = (jax.tree.map(flat, (state.params, state.opt_state, state.model_state, batch)),
              {k: flat(grid(v)) for k, v in fields.items()}, keys)

    def one(params, opt_state, model_state, batch, fields, rng):
      return gradient(params, opt_state, model_state, batch, schedule_type(**fields), rng)

    def zeros(params, fields, model_state):
      """The sums of a slot without work: zero gradients and loss, its model state unchanged."""
      return (jax.tree.map(jnp.zeros_like, params), jnp.zeros_like(fields['microbatches_done'], jnp.float32),
              model_state)

    def loop_over_busy(inputs):
      """The busy slots' sums, one slot per trip (see `busy_loop`); the others' stay `zeros`."""
      (params, opt_state, model_state, batch), fields, rng = inputs
      busy = fields['microbatches_done'] > 0
      index = jnp.nonzero(busy, size=slots_per_device, fill_value=slots_per_device)[0]
      trips = jnp.sum(busy)

      def trip(loop):
        j, out = loop
        i = index[j]
        computed = one(*jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False),
                                     (params, opt_state, model_state, batch, fields, rng)))
        return j + 1, jax.tree.map(
            lambda base, new: lax.dynamic_update_index_in_dim(base, new.astype(base.dtype), i, 0), out, computed)

      _, out = lax.while_loop(lambda loop: loop[0] < trips, trip,
                              (jnp.zeros((), jnp.int32), zeros(params, fields, model_state)))
      return out

    def compute(inputs):
      (params, opt_state, model_state, batch), fields, rng = inputs
      if slots is None or slots == slots_per_device:
        if slots_per_device == 1:
          out = one(*jax.tree.map(lambda x: x[0], (params, opt_state, model_state, batch, fields, rng)))
          return jax.tree.map(lambda x: x[None], out)
        return jax.vmap(one)(params, opt_state, model_state, batch, fields, rng)
      busy = fields['microbatches_done'] > 0
      index = jnp.nonzero(busy, size=slots, fill_value=slots_per_device)[0]  # padding: past the end, dropped
      take = lambda x: jnp.take(x, jnp.minimum(index, slots_per_device - 1), axis=0)
      computed = jax.vmap(one)(*jax.tree.map(take, (params, opt_state, model_state, batch, fields, rng)))
      return jax.tree.map(lambda base, new: base.at[index].set(new.astype(base.dtype), mode='drop'),
                          zeros(params, fields, model_state), computed)

    if slots is None:
      out = compute(inputs)
    elif busy_loop:
      out = loop_over_busy(inputs)
    else:
      (params, _, model_state, _), fields, _ = inputs
      out = lax.cond(jnp.any(fields['microbatches_done'] > 0), compute, lambda _: zeros(params, fields, model_state),
                     inputs)
    return jax.tree.map(lambda x: x.reshape((count, local) + x.shape[1:]), out)

  def replica_updates(state, sums, per_worker, own, shared, step, values, round_position):
    """Every worker's update, per replica (each replica's transformation built from its values)."""
    def one_replica(state, sums, per_worker, own, values):
      replica_tx = tx if replicas is None else replicas.build(values)[0]
      update = make_worker_update(replica_tx, microbatches, gradient_sums, flat_norms)
      lifted = layout.per_worker(lambda s, g, l, m, fields: update(  # noqa: E741
          s, g, l, m, schedule_type(**fields, **own, **shared), step, round_position))
      return lifted(state, *sums, per_worker)

    if replicas is None:
      out = one_replica(*jax.tree.map(lambda x: x[0], (state, sums, per_worker, own)), values)
      return jax.tree.map(lambda x: x[None], out)
    return map_replicas(one_replica, replicas.vectorized)(state, sums, per_worker, own, values)

  def scan_state(body, state, xs):
    """`lax.scan(body, state, xs)` over the (R, L, ...) state; a run alone with one worker per device carries it
    without its two unit axes, which the body adds back and drops (bitcasts). Carried with them, XLA:CPU copied
    every parameter and optimizer leaf once more per iteration and fused the update twice (9 copies against 2 in
    the digits MLP's loop: 3% of its iteration)."""
    if count * local != 1:
      return lax.scan(body, state, xs)

    def unit_free(carry, xs):
      state, measured = body(jax.tree.map(lambda x: x[None, None], carry), xs)
      return jax.tree.map(lambda x: x[0, 0], state), measured

    carry, measured = lax.scan(unit_free, jax.tree.map(lambda x: x[0, 0], state), xs)
    return jax.tree.map(lambda x: x[None, None], carry), measured

  def device_block(state, packed, data, values, spec, slots):
    examples, per_worker, shared, own, steps = transfer.unpack(packed, spec)
    # The data set lives on the devices: gather this device's workers' micro-batches by index.
    batches = examples if data is None else {k: jnp.take(v, examples, axis=0) for k, v in data.items()}
    if replicas is None:  # one run: a replica axis of 1, squeezed away by the compiler
      state, batches, per_worker = jax.tree.map(lambda x: x[None], (state, batches, per_worker))
      seeds = jnp.full((1,), seed, jnp.int32)
    else:
      seeds = values['seed'] if 'seed' in values else jnp.full((count,), seed, jnp.int32)
    # shared: uniform fields every replica shares (not batched); own: (R, n), one value per replica.
    to_front = lambda x: jnp.moveaxis(x, 1, 0)  # (R, n, ...) -> (n, R, ...)
    xs = (jax.tree.map(to_front, batches), jax.tree.map(to_front, per_worker), jax.tree.map(to_front, own),
          shared, steps)

    def one_iteration(state, xs, round_position=None):
      batch, per_worker, own, shared, step = xs
      fields = {**per_worker, **{k: v[:, None] for k, v in own.items()}, **shared}
      if stopwatch is None:
        sums = device_gradients(state, batch, fields, seeds, step, slots)
        return replica_updates(state, sums, per_worker, own, shared, step, values, round_position)
      state, started = stopwatch.stamp(state)
      sums, finished = stopwatch.stamp(device_gradients(state, batch, fields, seeds, step, slots))
      state, measured = replica_updates(state, sums, per_worker, own, shared, step, values, round_position)
      per_slot = lambda x: jnp.broadcast_to(x, (count, local))
      return state, {**measured, 'compute_s': per_slot(finished - started), 'started_s': per_slot(started)}

    names = ('loss', 'l2_grads') + (() if stopwatch is None else ('compute_s', 'started_s'))

    def iteration_rows(state, xs, round_position=None):
      """One iteration, its measurements stacked (k, R, L): one output of the loop, written once per iteration
      (one write per measurement was an operation each, of every device's thread: `tree_l2`)."""
      state, measured = one_iteration(state, xs, round_position)
      return state, jnp.stack([measured[name] for name in names])

    def one_round(state, xs):
      measured = []
      for r in range(round_length):  # unrolled: positions are static
        state, m = iteration_rows(state, jax.tree.map(lambda x: x[r], xs), round_position=r)
        measured.append(m)
      return state, jnp.stack(measured)

    if round_length is None:
      state, measured = scan_state(iteration_rows, state, xs)
    else:
      rounds = jax.tree.map(lambda x: x.reshape((x.shape[0] // round_length, round_length) + x.shape[1:]), xs)
      state, measured = scan_state(one_round, state, rounds)
      measured = measured.reshape((-1,) + measured.shape[2:])
    l2_params = jax.vmap(layout.per_worker(functools.partial(tree_l2, flat=flat_norms)))(state.params)  # (R, L)
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

  def block_step(state, packed, data=None, values=None, *, spec, slots=None):
    mapped = layout.shard_map(functools.partial(device_block, spec=spec, slots=slots),
                              in_specs=(worker, packed_specs, PartitionSpec(), PartitionSpec()),
                              out_specs=(worker, per_iteration))
    return mapped(state, packed, data, values)

  return jax.jit(block_step, donate_argnums=(0,), static_argnames=('spec', 'slots'))


def unpack_measurements(packed: np.ndarray, timed: bool = False) -> dict[str, np.ndarray]:
  """The block step's measurements on the host, from its one packed (2n + 1, P) array: `loss` and `l2_grads`
  (n, P), `l2_params` (P,); with replicas, from (R, 2n + 1, P), each with a leading R. One array to fetch per
  block, not three (each fetch is one copy per device). `timed` (a step with a `Stopwatch`): (4n + 1, P), also
  `compute_s` and `started_s` (n, P)."""
  rows = 4 if timed else 2
  n = (packed.shape[-2] - 1) // rows
  names = ('loss', 'l2_grads', 'compute_s', 'started_s')[:rows]
  out = {name: packed[..., k * n:(k + 1) * n, :] for k, name in enumerate(names)}
  out['l2_params'] = packed[..., rows * n, :]
  return out
