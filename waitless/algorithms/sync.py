"""Synchronous all-reduce SGD: the baseline every other algorithm is measured against.

Update rule (every worker, every iteration):
    g = (1/P) sum_i g_i          (all-reduce of the workers' gradients)
    W <- W + U(g)                (U: the inner optimizer, identical on every worker)
With P workers of local batch b this is single-device SGD with batch P*b.
Time per iteration: max_i X_i + allreduce(P) (`Barrier`, `cluster/rules/sync.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import optax

from waitless.algorithms import collectives
from waitless.algorithms import spec


class SyncState(NamedTuple):
  """State of `sync_sgd` on one worker.

  Attributes:
    inner: the inner optimizer's state, identical on every worker.
  """
  inner: optax.OptState


def sync_sgd(inner: optax.GradientTransformation,
             axis_name: collectives.AxisName = None) -> optax.GradientTransformationExtraArgs:
  """All-reduce the gradients over `axis_name`, then apply `inner`.

  Args:
    inner: the optimizer U (e.g. `optax.sgd(0.1, momentum=0.9)`).
    axis_name: the worker axes to average over; None for one worker (plain `inner`).

  Returns:
    A transformation whose `update(grads, state, params, **extra)` returns this worker's updates. Extra
    arguments (`schedule`) are accepted and ignored.

  Example:
    >>> tx = sync_sgd(optax.sgd(0.1), axis_name='workers')  # inside shard_map over 'workers'
  """
  inner = optax.with_extra_args_support(inner)

  @spec.owns_its_buffers
  def init_fn(params):
    return SyncState(inner=inner.init(params))

  def update_fn(grads, state, params=None, **extra):
    del extra
    grads = collectives.worker_mean(grads, axis_name)
    updates, inner_state = inner.update(grads, state.inner, params)
    return updates, SyncState(inner=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


SPEC = spec.AlgorithmSpec(
    name='sync', defaults={},
    build=lambda config, inner, axis_name: sync_sgd(inner, axis_name=axis_name))
