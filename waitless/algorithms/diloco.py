"""DiLoCo: local SGD whose model average is the gradient of an outer optimizer step.

Update rule (H = `local_steps`, OuterOpt = SGD with `outer_learning_rate`, `outer_momentum`, `outer_nesterov`):
    W_i <- W_i + U_i(g_i)                                 (inner step, local inner optimizer state)
    if averages_at(t):                                    (every H-th step, as local SGD)
      Delta = W_outer - (1/P) sum_j W_j                   (outer gradient: one all-reduce of the models)
      W_outer <- W_outer + OuterOpt(Delta)                (Nesterov momentum 0.9, rate 0.7 in the paper)
      W_i <- W_outer                                      (every worker restarts from the outer model)
W_outer starts as the initial model. With outer SGD of rate 1 and no momentum, W_outer <- mean_j W_j: local
SGD. The inner optimizer (the paper's is AdamW) is `config.optimizer`; its state stays local, as in local SGD.
The paper's outer settings assume inner AdamW: with inner momentum SGD (MNIST-1D, H = 8, rate 0.2) outer
Nesterov 0.9 at rate 0.7 diverges; there use `optimizer.name=adamw` or `outer_momentum=0`.

Built on local SGD, not beside it: `diloco(...)` runs `local_sgd.local_sgd(...)` unchanged (the same
averaging step, post-local warmup, `average_opt_state`, static `round_position` for whole rounds) and turns
its average into the outer step; the time rule is local SGD's `PeriodicAverage` (`cluster/rules/local_sgd.py`) (one
model all-reduce per round), its validation and `round_length` are local SGD's. Outer steps cost no communication:
every worker holds W_outer and the outer momentum, and computes the same outer step from the same mean.

Why a registry name of its own (`diloco`) rather than `local_sgd` with `outer_optimizer.*` fields: the outer
model and momentum are two more model-sized buffers per worker that local SGD does not carry (the state's
structure, and so its checkpoints, would depend on a flag); the name is what the literature and the
comparison tables call it; and local SGD's trajectory stays bit-for-bit what it was.

References: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv:2311.08105 (2023); local SGD: Lin, Stich, Patel, Jaggi, ICLR 2020.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
from jax import lax
import optax

from waitless import config_errors as errors
from waitless.algorithms import collectives
from waitless.algorithms import local_sgd
from waitless.algorithms import spec

OUTER_DEFAULTS = {'outer_learning_rate': 0.7, 'outer_momentum': 0.9, 'outer_nesterov': True}
OUTER_HYPERPARAMETERS = ('outer_learning_rate', 'outer_momentum')  # replicas of one program may differ in these


class DiLoCoState(NamedTuple):
  """State of `diloco` on one worker.

  Attributes:
    local: local SGD's state: step count and this worker's inner optimizer state.
    outer_params: W_outer, the model every worker restarted from at the last outer step.
    outer: the outer optimizer's state (momentum), the same on every worker.
  """
  local: local_sgd.LocalSGDState
  outer_params: optax.Params
  outer: optax.OptState


def outer_optimizer(learning_rate: float, momentum: float = 0.0,
                    nesterov: bool = False) -> optax.GradientTransformation:
  """OuterOpt: SGD on the outer gradient Delta (PyTorch's and optax's Nesterov: update g + mu (g + mu v))."""
  return optax.sgd(learning_rate, momentum=None if spec.is_static_zero(momentum) else momentum, nesterov=nesterov)


def outer_step(outer: optax.GradientTransformation, outer_params, outer_state, mean):
  """W_outer <- W_outer + OuterOpt(W_outer - mean); returns (new W_outer, new outer state)."""
  delta = jax.tree.map(lambda o, m: o - m, outer_params, mean)
  updates, outer_state = outer.update(delta, outer_state, outer_params)
  return optax.apply_updates(outer_params, updates), outer_state


def diloco(inner: optax.GradientTransformation, outer: optax.GradientTransformation, local_steps: int,
           warmup_steps: int = 0, axis_name: collectives.AxisName = None,
           average_opt_state: bool = False) -> optax.GradientTransformationExtraArgs:
  """Local SGD with `inner` whose every model average becomes an `outer` step (see the module docstring).

  Args:
    inner: the inner optimizer U, applied by each worker to its own gradient.
    outer: OuterOpt, applied to Delta = W_outer - mean_j W_j (`outer_optimizer`).
    local_steps, warmup_steps, axis_name, average_opt_state: as for `local_sgd.local_sgd`.

  Returns:
    A transformation with local SGD's `update(grads, state, params, *, step=None, round_position=None)`.
  """
  base = local_sgd.local_sgd(inner, local_steps, warmup_steps, axis_name=axis_name,
                             average_opt_state=average_opt_state)

  @spec.owns_its_buffers
  def init_fn(params):
    return DiLoCoState(local=base.init(params), outer_params=params, outer=outer.init(params))

  def update_fn(grads, state, params=None, *, step: Optional[jax.Array] = None,
                round_position: Optional[int] = None, **extra):
    del extra
    if params is None:
      raise ValueError('diloco needs params: it averages models, not gradients.')
    updates, local_state = base.update(grads, state.local, params, step=step, round_position=round_position)
    stepped = optax.apply_updates(params, updates)  # mean_j W_j after an averaging step, else W_i + U_i(g_i)

    def restart(operands):
      mean, outer_params, outer_state = operands
      outer_params, outer_state = outer_step(outer, outer_params, outer_state, mean)
      return outer_params, outer_params, outer_state

    operands = (stepped, state.outer_params, state.outer)
    if round_position is not None:  # static, as in local SGD: the outer step at the round's last position only
      new_params, outer_params, outer_state = restart(operands) if round_position == local_steps - 1 else operands
    else:
      t = state.local.count if step is None else step
      new_params, outer_params, outer_state = lax.cond(
          local_sgd.averages_at(t, local_steps, warmup_steps), restart, lambda o: o, operands)
    updates = jax.tree.map(lambda new, old: new - old, new_params, params)
    return updates, DiLoCoState(local=local_state, outer_params=outer_params, outer=outer_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def validate_outer(config) -> None:
  """The `outer_*` fields (shared with Streaming DiLoCo)."""
  a = config.algorithm
  errors.require_number(a.outer_learning_rate, 'algorithm.outer_learning_rate', 'must be a finite number > 0',
                        lambda v: v > 0)
  errors.require_number(a.outer_momentum, 'algorithm.outer_momentum', 'must be a number in [0, 1)',
                        lambda v: 0 <= v < 1)
  errors.require(isinstance(a.outer_nesterov, bool), 'algorithm.outer_nesterov', a.outer_nesterov, 'must be a bool')


def outer_from_config(config) -> optax.GradientTransformation:
  a = config.algorithm
  return outer_optimizer(a.outer_learning_rate, a.outer_momentum, a.outer_nesterov)


def validate(config) -> None:
  local_sgd.validate(config)
  validate_outer(config)


SPEC = spec.AlgorithmSpec(
    name='diloco',
    defaults={**local_sgd.SPEC.defaults, **OUTER_DEFAULTS},
    build=lambda config, inner, axis_name: diloco(
        inner, outer_from_config(config), local_steps=config.algorithm.local_steps,
        warmup_steps=config.algorithm.warmup_steps, axis_name=axis_name,
        average_opt_state=config.algorithm.average_opt_state),
    validate=validate, round_length=local_sgd.round_length,
    hyperparameters=OUTER_HYPERPARAMETERS)
