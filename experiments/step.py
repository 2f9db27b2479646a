"""The jitted training step: a block of iterations of one algorithm on every worker.

Per worker and iteration: the gradient of the worker's loss is accumulated over the micro-batches the
schedule says it finished (`microbatches_done`; the others are masked out), each taken where the algorithm's
`gradient_params` hook says, divided by that count, and handed to the algorithm's transformation as
`tx.update(grads, state, params, schedule=..., step=...)`; it communicates over the worker axes and returns
this worker's updates. A block of n iterations is one `lax.scan` inside one `shard_map`, jitted once with the
state donated.

The schedule's per-worker fields are vmapped with the workers that share a device; its uniform fields
(`Schedule.UNIFORM`) and the step number are not, so conditionals over them stay conditionals.

Replicas (`experiments/replicas.py`): with a `ReplicaAxis` the program trains R runs at once. Every state leaf
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
training loop asks for the round program on accelerators only (`train.rounds_pay_off`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from algorithms import collectives
from algorithms import spec as spec_lib
from cluster import rules
from experiments import workers as workers_lib


class TrainState(NamedTuple):
  params: Any        # per-worker parameters, leading dimension P
  opt_state: Any     # per-worker algorithm state (incl. the inner optimizer's), leading dimension P
  model_state: Any   # per-worker non-parameter collections (batch_stats), leading dimension P; {} if none


def tree_l2(tree) -> jax.Array:
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def make_worker_iteration(task, model, tx: optax.GradientTransformationExtraArgs, axis_name, microbatches: int,
                          seed: int, gradient_params=spec_lib.at_own_params, finished_only: bool = False,
                          gradient_sums: bool = False):
  """One iteration of one worker: (state, batch (m, b/m, ...), schedule, step) -> (state, measurements).

  Measurements: `loss` (the mean over the finished micro-batches) and `l2_grads` (the norm of their mean
  gradient). With one micro-batch per worker, done is 0 or 1 and the sum is the mean: no division.

  `finished_only`: loop over the micro-batches the worker finished (`microbatches_done`, a while loop; vmapped
  workers run as many trips as the most any of them finished) instead of scanning every slot of the buffer
  and masking the rest. The same trajectory (the masked slots add exact zeros); for buffers much larger than
  what a worker finishes (K-batch rules: K mini-batches per worker, about K / P of them used).
  `gradient_sums`: hand `tx.update` the sum over the finished micro-batches, not their mean (the spec's
  `gradient_sums`); the measured `l2_grads` is the mean's norm either way.
  """
  grad_fn = jax.value_and_grad(functools.partial(task.loss, model), has_aux=True)

  def iteration(state: TrainState, batch, schedule, step, round_position=None):
    worker = collectives.worker_index(axis_name)
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), worker)
    done = schedule.microbatches_done

    def micro(carry, xs):
      grad_sum, loss_sum, model_state = carry
      mb, k = xs
      params = gradient_params(state.params, state.opt_state, schedule, k)
      (loss, new_model_state), grads = grad_fn(params, model_state, mb, jax.random.fold_in(rng, k))
      used = k < done
      grad_sum = jax.tree.map(lambda s, g: s + jnp.where(used, g, jnp.zeros_like(g)), grad_sum, grads)
      model_state = jax.tree.map(lambda new, old: jnp.where(used, new, old), new_model_state, model_state)
      loss_sum = loss_sum + jnp.where(used, loss, 0.0).astype(loss_sum.dtype)
      return (grad_sum, loss_sum, model_state), None

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    # zeros_like keeps the per-worker (varying) type that the scan's carry must keep under shard_map's check.
    carry = (zeros, jnp.zeros_like(done, jnp.float32), state.model_state)
    if microbatches == 1:
      carry, _ = micro(carry, (jax.tree.map(lambda x: x[0], batch), jnp.zeros((), jnp.int32)))
    elif finished_only:
      def trip(loop):
        k, carry = loop
        mb = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, k, keepdims=False), batch)
        carry, _ = micro(carry, (mb, k))
        return k + 1, carry
      _, carry = lax.while_loop(lambda loop: loop[0] < done, trip, (jnp.zeros_like(done), carry))
    else:
      carry, _ = lax.scan(micro, carry, (batch, jnp.arange(microbatches)))
    grad_sum, loss_sum, model_state = carry
    if microbatches == 1:  # done is 0 or 1: the sum is the mean
      grads, loss, count = grad_sum, loss_sum, jnp.ones((), jnp.float32)
    else:
      count = jnp.maximum(done, 1).astype(jnp.float32)
      grads = grad_sum if gradient_sums else jax.tree.map(lambda g: g / count.astype(g.dtype), grad_sum)
      loss = loss_sum / count
    l2_grads = tree_l2(grad_sum) / count  # the mean's norm, without a pass over the mean
    extra = {} if round_position is None else {'round_position': round_position}
    updates, opt_state = tx.update(grads, state.opt_state, state.params, schedule=schedule, step=step, **extra)
    params = optax.apply_updates(state.params, updates)
    return TrainState(params, opt_state, model_state), {'loss': loss, 'l2_grads': l2_grads}

  return iteration


@dataclasses.dataclass(frozen=True)
class ReplicaAxis:
  """R runs in one program (`experiments/replicas.py`).

  Attributes:
    count: R.
    build: the traced values of one replica (dotted config path -> scalar, the fields that differ between the
      replicas) -> (its transformation, its seed); called inside the program, once per trace.
    vectorized: replicas as one vectorised computation (`jax.vmap`), or one after another inside the program
      (`lax.map`: the same program, dispatched once). `replica_mapping` chooses.
  """
  count: int
  build: Callable[[Mapping[str, jax.Array]], tuple[optax.GradientTransformationExtraArgs, Any]]
  vectorized: bool = True


def map_replicas(fn: Callable[..., Any], vectorized: bool) -> Callable[..., Any]:
  """`fn` over the leading replica axis of every argument: `jax.vmap`, or a `lax.map` loop (one replica at a
  time, in one program). A loop keeps each replica's convolutions ungrouped (vmap turns a convolution with
  per-replica kernels into a grouped one, 11x slower on XLA:CPU for MNIST-1D's CNN) and its conditionals real."""
  if vectorized:
    return jax.vmap(fn)
  return lambda *args: lax.map(lambda xs: fn(*xs), args)


def make_block_step(task, model, tx, layout: workers_lib.WorkerLayout, microbatches: int, seed: int,
                    schedule_type: type, gradient_params=spec_lib.at_own_params, round_length: int | None = None,
                    finished_only: bool = False, gradient_sums: bool = False,
                    replicas: Optional[ReplicaAxis] = None):
  """The jitted `(state, batches, schedules, steps, values) -> (state, measurements)` for a block of n iterations.

  Args (of the returned function):
    state: TrainState, every leaf (P, ...) sharded over the workers (donated); with `replicas`, (R, P, ...).
    batches: dict of (n, P, m, b/m, ...) arrays, worker dimension sharded; with `replicas`, (R, n, P, ...).
    schedules: a `schedule_type` (the time rule's NamedTuple): per-worker fields (n, P) sharded over the
      workers, uniform fields (n,) replicated; with `replicas`, per-worker fields (R, n, P) and each uniform
      field (n,) when every replica shares it, else (R, n).
    steps: int32 (n,), the global step of each iteration (replicated; the same for every replica).
    values: with `replicas`, the per-replica inputs of `ReplicaAxis.build`, path -> (R,) replicated; else None.
  With `round_length` R, n must be a multiple of R and steps[0] a multiple of R (whole rounds).
  `tx`, `seed`: the run's; with `replicas`, each replica's come from `replicas.build(values)` instead.
  `finished_only`, `gradient_sums`: see `make_worker_iteration`.

  Returns:
    The new state and the measurements packed in one float32 (2n + 1, P) array, (R, 2n + 1, P) with replicas
    (`unpack_measurements` on the host): `loss` and `l2_grads` (n, P), per iteration; `l2_params` (P,), the
    norm of each worker's parameters after the block (once per block: a pass over the model per iteration
    cost 2% of the digits step).
  """
  uniform = rules.base.uniform_fields(schedule_type)

  def run_block(tx, seed, state, batches, schedules, steps):
    """One run's block on this device's workers."""
    iteration = make_worker_iteration(task, model, tx, layout.axis_name, microbatches, seed, gradient_params,
                                      finished_only, gradient_sums)

    def one_iteration(state, xs, round_position=None):
      batch, schedule, step = xs
      per_worker, same = rules.base.split(schedule)
      lifted = layout.per_worker(
          lambda s, b, fields: iteration(s, b, schedule_type(**fields, **same), step, round_position))
      return lifted(state, batch, per_worker)

    def one_round(state, xs):
      measured = []
      for r in range(round_length):  # unrolled: positions are static
        state, m = one_iteration(state, jax.tree.map(lambda x: x[r], xs), round_position=r)
        measured.append(m)
      return state, jax.tree.map(lambda *ms: jnp.stack(ms), *measured)

    xs = (batches, schedules, steps)
    if round_length is None:
      state, measured = lax.scan(one_iteration, state, xs)
    else:
      rounds = jax.tree.map(lambda x: x.reshape((x.shape[0] // round_length, round_length) + x.shape[1:]), xs)
      state, measured = lax.scan(one_round, state, rounds)
      measured = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), measured)
    l2_params = layout.per_worker(tree_l2)(state.params)  # once, after the block
    return state, jnp.concatenate([measured['loss'], measured['l2_grads'], l2_params[None]], axis=0)

  def device_block(state, batches, schedules, steps, values):
    if replicas is None:
      return run_block(tx, seed, state, batches, schedules, steps)
    per_worker, same = rules.base.split(schedules)
    shared = {k: v for k, v in same.items() if v.ndim == 1}  # the same for every replica: not batched
    own = {k: v for k, v in same.items() if v.ndim == 2}

    def one_replica(state, batches, per_worker, own, values):
      replica_tx, replica_seed = replicas.build(values)
      return run_block(replica_tx, replica_seed, state, batches, schedule_type(**per_worker, **own, **shared),
                       steps)

    return map_replicas(one_replica, replicas.vectorized)(state, batches, per_worker, own, values)

  lead = () if replicas is None else (None,)
  worker = PartitionSpec(*lead, workers_lib.DEVICE_AXIS)
  per_iteration = PartitionSpec(*lead, None, workers_lib.DEVICE_AXIS)
  schedule_specs = schedule_type(**{f: PartitionSpec() if f in uniform else per_iteration
                                    for f in schedule_type._fields})
  mapped = layout.shard_map(device_block,
                            in_specs=(worker, per_iteration, schedule_specs, PartitionSpec(), PartitionSpec()),
                            out_specs=(worker, per_iteration))

  def block_step(state, batches, schedules, steps, values=None):
    return mapped(state, batches, schedules, steps, values)

  return jax.jit(block_step, donate_argnums=(0,))


def unpack_measurements(packed: np.ndarray) -> dict[str, np.ndarray]:
  """The block step's measurements on the host, from its one packed (2n + 1, P) array: `loss` and `l2_grads`
  (n, P), `l2_params` (P,); with replicas, from (R, 2n + 1, P), each with a leading R. One array to fetch per
  block, not three (each fetch is one copy per device)."""
  n = (packed.shape[-2] - 1) // 2
  return {'loss': packed[..., :n, :], 'l2_grads': packed[..., n:2 * n, :], 'l2_params': packed[..., 2 * n, :]}
