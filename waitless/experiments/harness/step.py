"""The training step of one worker, in two halves: its gradient, then its update.

Per worker and iteration, with m micro-batches per batch and n = the schedule's `microbatches_done` of them
finished (the time rule says how many; the others are masked out):

    G = sum_{k < n} grad loss(W at micro-batch k, micro-batch k)       (the algorithm's `gradient_params` hook
                                                                        says where: default the worker's own W)
    updates, opt_state = tx.update(G / max(n, 1), opt_state, W, schedule=schedule, step=step)
    W <- W + updates

`tx` is the algorithm's optax transformation; it communicates over the worker axes inside `update` (it averages,
delays or groups by itself: nothing here averages). An algorithm that weights workers by the micro-batches
they finished (its spec's `gradient_sums`) receives G itself. The two halves are separate so that a block
program can compute the gradients of busy workers only (`block_program.py`): a worker that finished nothing
computes none, as on the real cluster. The Ray runtime's learners and server call the same two functions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from waitless.algorithms import spec as spec_lib


class TrainState(NamedTuple):
  params: Any        # per-worker parameters, leading dimension P
  opt_state: Any     # per-worker algorithm state (incl. the inner optimizer's), leading dimension P
  model_state: Any   # per-worker non-parameter collections (batch_stats), leading dimension P; {} if none


def tree_l2(tree) -> jax.Array:
  """The Euclidean norm of all leaves of `tree` together, in float32 (0 for an empty tree)."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def make_worker_gradient(task, model, microbatches: int, gradient_params=spec_lib.at_own_params,
                         finished_only: bool = False):
  """One worker's gradient half: (params, opt_state, model_state, batch (m, b/m, ...), schedule, rng) ->
  (G, the sum of the finished micro-batches' losses, the model state after them).

  A micro-batch beyond `microbatches_done` has its loss masked before differentiation, so its gradient is exactly
  zero (for finite gradients) and its model state is not kept. `finished_only`: loop over the finished
  micro-batches only (a while loop; vmapped workers run as many trips as the most any of them finished) instead
  of scanning all m: the same sums, for batches that hold far more slots than a worker finishes (K-batch rules:
  K mini-batches per worker, about K / P of them used).
  """
  def masked_loss(params, model_state, batch, rng, used):
    loss, new_model_state = task.loss(model, params, model_state, batch, rng)
    return jnp.where(used, loss, jnp.zeros_like(loss)), new_model_state

  grad_fn = jax.value_and_grad(masked_loss, has_aux=True)

  def gradient(params, opt_state, model_state, batch, schedule, rng):
    done = schedule.microbatches_done

    def one(model_state, microbatch, k):
      used = k < done
      at = gradient_params(params, opt_state, schedule, k)
      (loss, new_model_state), grads = grad_fn(at, model_state, microbatch, jax.random.fold_in(rng, k), used)
      model_state = jax.tree.map(lambda new, old: jnp.where(used, new, old), new_model_state, model_state)
      return grads, loss.astype(jnp.float32), model_state

    if microbatches == 1:  # the sum of one gradient is that gradient
      return one(model_state, jax.tree.map(lambda x: x[0], batch), jnp.zeros((), jnp.int32))

    def accumulate(carry, xs):
      grad_sum, loss_sum, model_state = carry
      grads, loss, model_state = one(model_state, *xs)
      return (jax.tree.map(jnp.add, grad_sum, grads), loss_sum + loss, model_state), None

    # zeros_like keeps the per-worker (varying) type that the carry must keep under shard_map's check.
    carry = (jax.tree.map(jnp.zeros_like, params), jnp.zeros_like(done, jnp.float32), model_state)
    if not finished_only:
      carry, _ = lax.scan(accumulate, carry, (batch, jnp.arange(microbatches)))
      return carry

    def trip(loop):
      k, carry = loop
      microbatch = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, k, keepdims=False), batch)
      carry, _ = accumulate(carry, (microbatch, k))
      return k + 1, carry

    _, carry = lax.while_loop(lambda loop: loop[0] < done, trip, (jnp.zeros_like(done), carry))
    return carry

  return gradient


def make_worker_update(tx: optax.GradientTransformationExtraArgs, microbatches: int, gradient_sums: bool = False,
                       norm=tree_l2):
  """One worker's update half: (state, G, loss sum, model_state, schedule, step[, round_position]) ->
  (state, {'loss': the mean finished micro-batch loss, 'l2_grads': the norm of the mean gradient}).

  `gradient_sums`: `tx.update` receives G, not G / n (the spec's `gradient_sums`). `round_position`: the static
  position r of this iteration in the algorithm's round, passed on to `tx.update` (`block_program.py`). `norm`:
  how `l2_grads` is measured (`xla_cpu.norm`).
  """

  def update(state: TrainState, grad_sum, loss_sum, model_state, schedule, step, round_position=None):
    if microbatches == 1:  # n is 0 or 1: the sum is the mean
      grads, loss, count = grad_sum, loss_sum, jnp.ones((), jnp.float32)
    else:
      count = jnp.maximum(schedule.microbatches_done, 1).astype(jnp.float32)
      grads = grad_sum if gradient_sums else jax.tree.map(lambda g: g / count.astype(g.dtype), grad_sum)
      loss = loss_sum / count
    position = {} if round_position is None else {'round_position': round_position}
    updates, opt_state = tx.update(grads, state.opt_state, state.params, schedule=schedule, step=step, **position)
    params = optax.apply_updates(state.params, updates)
    return TrainState(params, opt_state, model_state), {'loss': loss, 'l2_grads': norm(grad_sum) / count}

  return update
