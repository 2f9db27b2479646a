"""D-PSGD: decentralized SGD with ring gossip; every worker talks only to its two ring neighbours.

Update rule for worker i (ring neighbours i-1, i+1; mix(X)_i = mean of X_j over j in {i-1, i, i+1}, the
distinct ones: X_i alone for P = 1, (X_0 + X_1)/2 for P = 2), U_i = the inner optimizer with its local state:
    order='gossip_then_step' (default, choice):  W_i <- mix(W)_i, then a local step at the mixed model:
                                                  W_i <- W_i + U_i(g_i(W_i))
    order='overlap' (Lian et al. 2017):          W_i <- mix(W)_i + U_i(g_i(W_i))   (gradient at the unmixed
                                                  W_i, so the exchange runs during the gradient computation)
In the harness a worker's gradient is taken at its params before `update`, so `gossip_then_step` keeps the
params AFTER the mix: `update` makes the local step and then mixes the stepped models,
    W_i <- mix(W + U(g))_i,
which is the same sequence (mix, step at the mixed model, mix, ...) shifted by half an iteration; it starts
from identical models, where the first mix is the identity.
Time per iteration (`RingGossip`, `cluster/rules/dpsgd.py`), with c_i = start_i + X_i:
  gossip_then_step: start_i(t+1) = max_{j in N(i)} c_j + 2 p2p(M);
  overlap:          start_i(t+1) = max(c_i, max_{j in N(i), j != i} start_j(t) + p2p(M)).
Off the simulator the exchanges are two `ppermute`s: on a multi-process run a slow process delays its
neighbours only, as the rule says (`benchmarks/real_stragglers.py` measures it); on a ring of 4 every process
neighbours 2 of the 3 others, so little is hidden.

Reference: Lian, Zhang, Zhang, Hsieh, Zhang, Liu, "Can Decentralized Algorithms Outperform Centralized
Algorithms? A Case Study for Decentralized Parallel Stochastic Gradient Descent", NeurIPS 2017.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from waitless import config_errors as errors
from waitless.algorithms import collectives
from waitless.algorithms import spec

ORDERS = ('gossip_then_step', 'overlap')


def ring_mix(tree: Any, axis_name: collectives.AxisName) -> Any:
  """mix(X)_i: the mean of X over worker i and its distinct ring neighbours (identity for one worker).

  Args:
    tree: per-worker pytree.
    axis_name: the worker axes (None: one worker).

  Returns:
    (X_{i-1} + X_i + X_{i+1}) / 3 on worker i for P >= 3; (X_0 + X_1) / 2 for P = 2; X for P = 1.
  """
  p = collectives.num_workers(axis_name)
  if p == 1:
    return tree
  left = collectives.ring_shift(tree, axis_name, 1)  # worker i - 1
  if p == 2:
    return jax.tree.map(lambda x, a: (x + a) / 2, tree, left)
  right = collectives.ring_shift(tree, axis_name, -1)  # worker i + 1
  return jax.tree.map(lambda a, x, b: (a + x + b) / 3, left, tree, right)


class DPSGDState(NamedTuple):
  """State of `dpsgd` on one worker.

  Attributes:
    inner: this worker's own inner optimizer state (never exchanged).
  """
  inner: optax.OptState


def dpsgd(inner: optax.GradientTransformation, order: str = 'gossip_then_step',
          axis_name: collectives.AxisName = None) -> optax.GradientTransformationExtraArgs:
  """A local step of `inner` and a gossip average with the ring neighbours, in the given `order`.

  Args:
    inner: the optimizer U, applied by each worker to its own gradient with its own state.
    order: 'gossip_then_step' (params hold the mixed model; a step, then a mix) or 'overlap'
      (mix(W)_i + U(g_i(W_i))). See the module docstring.
    axis_name: the worker axes; None for one worker (then the mix is the identity and this is `inner`).

  Returns:
    A transformation whose `update(grads, state, params, **extra)` moves each worker's params to its new
    params; extra arguments (`schedule`, `step`) are accepted and ignored.
  """
  if order not in ORDERS:
    raise ValueError(f'order={order!r} must be one of {ORDERS}')
  inner = optax.with_extra_args_support(inner)

  @spec.owns_its_buffers
  def init_fn(params):
    return DPSGDState(inner=inner.init(params))

  def update_fn(grads, state, params=None, **extra):
    del extra
    if params is None:
      raise ValueError('dpsgd needs params: it averages models, not gradients.')
    updates, inner_state = inner.update(grads, state.inner, params)
    if order == 'gossip_then_step':
      new_params = ring_mix(optax.apply_updates(params, updates), axis_name)
    else:
      new_params = optax.apply_updates(ring_mix(params, axis_name), updates)
    updates = jax.tree.map(lambda new, old: new - old, new_params, params)
    return updates, DPSGDState(inner=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def validate(config):
  a = config.algorithm
  errors.require(a.order in ORDERS, 'algorithm.order', a.order, f'must be one of {", ".join(ORDERS)}')


SPEC = spec.AlgorithmSpec(
    name='dpsgd',
    defaults={
        'order': 'gossip_then_step',  # 'gossip_then_step' (mix, then a step at the mixed model) | 'overlap'
    },
    build=lambda config, inner, axis_name: dpsgd(inner, order=config.algorithm.order, axis_name=axis_name),
    validate=validate)
