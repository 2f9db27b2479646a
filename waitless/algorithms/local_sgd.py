"""Local SGD and post-local SGD: H local steps, then average the models.

Update rule for worker i at step t (H = `local_steps`, t0 = `warmup_steps`):
    W_i <- W_i + U_i(g_i)                               (local step, local optimizer state)
    if averages_at(t): W_i <- (1/P) sum_j W_j           (blocking all-reduce of the models)
where averages_at(t) holds for every t < t0 (post-local warmup: H = 1) and then every H-th step.
Optimizer state stays local unless `average_opt_state`.
Time per round: max_i sum_h X_{i,h} + allreduce(P) (`PeriodicAverage`, `cluster/rules/local_sgd.py`).

The harness passes the replicated step number (`step=`), so the average is a real conditional also when
several workers are vmapped on one device; without it (a library user's loop) the step comes from the state's
own counter. Without post-local warmup the period is fixed: on accelerators, blocks of whole rounds of H steps
pass the static `round_position`, and the average is then no conditional at all, issued at position H - 1 of
each round (`experiments.harness.block_step.rounds_pay_off`).

Reference: Lin, Stich, Patel, Jaggi, "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import optax

from waitless import config_errors as errors
from waitless.algorithms import collectives
from waitless.algorithms import spec


class LocalSGDState(NamedTuple):
  """State of `local_sgd` on one worker.

  Attributes:
    count: int32 (): local steps taken so far (the same on every worker).
    inner: this worker's own inner optimizer state.
  """
  count: jax.Array
  inner: optax.OptState


def averages_at(step, local_steps: int, warmup_steps: int = 0):
  """Whether the update of (0-based) `step` ends with a model average; works on ints and traced ints."""
  after = step - warmup_steps + 1
  return (step < warmup_steps) | (after % local_steps == 0)


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


def local_sgd(inner: optax.GradientTransformation, local_steps: int, warmup_steps: int = 0,
              axis_name: collectives.AxisName = None,
              average_opt_state: bool = False) -> optax.GradientTransformationExtraArgs:
  """Local steps of `inner`, with a model all-reduce after every `local_steps`-th step.

  Args:
    inner: the optimizer U, applied by each worker to its own gradient.
    local_steps: H >= 1, steps between averages (H = 1 with plain SGD is synchronous SGD).
    warmup_steps: post-local SGD: average after every step while step < warmup_steps.
    axis_name: the worker axes; None for one worker (then averaging is the identity).
    average_opt_state: also average the floating-point leaves of the inner state (e.g. momentum).

  Returns:
    A transformation whose `update(grads, state, params, *, step=None, round_position=None)` moves each
    worker's params to its new (possibly averaged) params. `step`: the replicated 0-based iteration number
    (the harness passes it); None uses the state's counter, which is per-worker data when workers are vmapped.
    `round_position`: a static int, step mod H, for a caller that runs whole rounds (needs warmup_steps = 0).
  """
  inner = optax.with_extra_args_support(inner)

  @spec.owns_its_buffers
  def init_fn(params):
    return LocalSGDState(count=jnp.zeros((), jnp.int32), inner=inner.init(params))

  def update_fn(grads, state, params=None, *, step: Optional[jax.Array] = None,
                round_position: Optional[int] = None, **extra):
    del extra
    stepped, inner_state = spec.local_step('local_sgd', inner, grads, state.inner, params)

    def average(tree_and_state):
      tree, opt_state = tree_and_state
      tree = collectives.worker_mean(tree, axis_name)
      if average_opt_state:
        opt_state = jax.tree.map(
            lambda x: collectives.worker_mean(x, axis_name) if _is_float(x) else x, opt_state)
      return tree, opt_state

    if round_position is not None:  # static: average unconditionally at the round's last step, else not at all
      if warmup_steps:
        raise ValueError('round_position needs a fixed period: warmup_steps must be 0')
      averaged = round_position == local_steps - 1
      new_params, inner_state = average((stepped, inner_state)) if averaged else (stepped, inner_state)
    else:
      t = state.count if step is None else step
      new_params, inner_state = lax.cond(
          averages_at(t, local_steps, warmup_steps), average, lambda x: x, (stepped, inner_state))
    updates = jax.tree.map(lambda new, old: new - old, new_params, params)
    return updates, LocalSGDState(count=optax.safe_increment(state.count), inner=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def validate(config):
  errors.require_int(config.algorithm.local_steps, 'algorithm.local_steps', 1)
  errors.require_int(config.algorithm.warmup_steps, 'algorithm.warmup_steps', 0)


def round_length(config):
  """H: the averaging period, fixed unless the post-local warmup averages every step first."""
  a = config.algorithm
  return a.local_steps if a.warmup_steps == 0 and a.local_steps > 1 else None


SPEC = spec.AlgorithmSpec(
    name='local_sgd',
    defaults={'local_steps': 4, 'warmup_steps': 0, 'average_opt_state': False},
    build=lambda config, inner, axis_name: local_sgd(
        inner, local_steps=config.algorithm.local_steps, warmup_steps=config.algorithm.warmup_steps,
        axis_name=axis_name, average_opt_state=config.algorithm.average_opt_state),
    validate=validate, round_length=round_length)
