"""Where the harness's programs take another shape on XLA:CPU than on accelerators, and why.

On XLA:CPU every virtual device is a thread on the same few cores: a vmapped computation costs its slots one
after another, collectives are rendezvous of the device threads (nothing overlaps them), and every operation of a
loop body is dispatched on every device's thread. Each choice below is a function of the platform; the
computations are the same (the tests check each path against the other), only their shape differs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from waitless.experiments.harness import step

CONVOLUTION = 'conv_general_dilated'


def on_cpu(platform: str) -> bool:
  return platform == 'cpu'


def rounds_pay_off(platform: str) -> bool:
  """Whether whole-round blocks run the round-structured program (a collective at a static position, overlapped
  with the compute that follows): on accelerators; on CPU nothing overlaps, and the unrolled round is slower."""
  return not on_cpu(platform)


def busy_loop_pays_off(platform: str) -> bool:
  """Whether a device computes its busy gradient slots in a loop of exactly as many trips instead of one vmap
  padded to the block's busiest device: on CPU, where a vmap of k slots costs k single ones."""
  return on_cpu(platform)


def norm(platform: str):
  """The measured norms' function: on CPU one sum of squares over the leaves concatenated (two operations per
  norm, not two per leaf: each is dispatched on every device's thread); elsewhere one sum per leaf (no copy of a
  large model's gradient). The two agree to float32 rounding."""
  return flat_l2 if on_cpu(platform) else step.tree_l2


def flat_l2(tree) -> jax.Array:
  """The Euclidean norm of all leaves of `tree` concatenated, in float32."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  vector = jnp.concatenate([x.astype(jnp.float32).ravel() for x in leaves])
  return jnp.sqrt(jnp.sum(jnp.square(vector)))


def scan(body, state, xs, unit_axes: bool):
  """`lax.scan(body, state, xs)`; with `unit_axes` (a run alone with one worker per device: every state leaf
  (1, 1, ...)) the carry travels without its two unit axes, which the body adds back and drops: on CPU, carried
  with them, every parameter and optimizer leaf was copied once more per iteration."""
  if not unit_axes:
    return lax.scan(body, state, xs)

  def unit_free(carry, xs):
    state, measured = body(jax.tree.map(lambda x: x[None, None], carry), xs)
    return jax.tree.map(lambda x: x[0, 0], state), measured

  carry, measured = lax.scan(unit_free, jax.tree.map(lambda x: x[0, 0], state), xs)
  return jax.tree.map(lambda x: x[None, None], carry), measured


def _has_convolution(jaxpr) -> bool:
  """Whether `jaxpr` (or a jaxpr inside one of its equations: a jit, a cond, a scan) has a convolution."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == CONVOLUTION:
      return True
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, 'jaxpr', sub)  # a ClosedJaxpr's jaxpr, or a Jaxpr
        if hasattr(inner, 'eqns') and _has_convolution(inner):
          return True
  return False


def vectorize_replicas(platform: str, one_replica, *args) -> bool:
  """Whether an evaluation vectorises a group's replicas (`jax.vmap`) or runs them one after another in its
  program (`lax.map`), for `one_replica(*args)` with `args` batched over the replicas: vectorised, except on CPU
  for a model with convolutions (per-replica kernels make a grouped convolution, far slower there than the
  replicas in turn)."""
  if not on_cpu(platform):
    return True
  one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), args)
  return not _has_convolution(jax.make_jaxpr(one_replica)(*one).jaxpr)
