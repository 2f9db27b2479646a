"""Collectives over the worker axes, the only way algorithms talk to each other.

`axis_name` is what the harness (or a library user) passes to an algorithm: `None` (one worker, no
communication: the transformation is a plain optax transformation), one mesh axis name (one worker per
device), or a tuple of names (device axis of `jax.shard_map` plus the `jax.vmap` axis of the workers that share
a device). The global worker index orders workers device-major: worker = device * local + local_index.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence, Union

import jax
from jax import lax
import jax.numpy as jnp

AxisName = Union[None, Hashable, Sequence[Hashable]]


def _axes(axis_name: AxisName) -> tuple[Hashable, ...]:
  if axis_name is None:
    return ()
  if isinstance(axis_name, (tuple, list)):
    return tuple(axis_name)
  return (axis_name,)


def num_workers(axis_name: AxisName) -> int:
  """P, the number of workers along `axis_name` (1 for None)."""
  size = 1
  for axis in _axes(axis_name):
    size *= lax.axis_size(axis)
  return size


def worker_index(axis_name: AxisName) -> jax.Array:
  """This worker's global index in [0, P), device-major."""
  index = jnp.zeros((), jnp.int32)
  for axis in _axes(axis_name):
    index = index * lax.axis_size(axis) + lax.axis_index(axis)
  return index


def _varying_axes(x) -> frozenset:
  mat = getattr(jax.typeof(x), 'mat', None)
  return frozenset(getattr(mat, 'varying', ()) or ())


def _per_worker(reduced: Any, original: Any, axes: tuple[Hashable, ...]) -> Any:
  """Marks a reduced value as per-worker again, as the input was.

  Under `shard_map(check_vma=True)` a psum's result is typed invariant over the reduced axes, while the
  per-worker value it replaces is varying; every worker holds its own copy, so the copy is per-worker data
  (and `lax.cond` branches that average or not must agree on the type). Without the check this is a no-op.
  """
  def fix(out, x):
    lost = tuple(a for a in axes if a in _varying_axes(x) and a not in _varying_axes(out))
    return lax.pcast(out, lost, to='varying') if lost else out
  return jax.tree.map(fix, reduced, original)


def worker_sum(tree: Any, axis_name: AxisName) -> Any:
  """Sum over all workers of each leaf (identity for one worker)."""
  axes = _axes(axis_name)
  if not axes:
    return tree
  return _per_worker(lax.psum(tree, axes), tree, axes)


def worker_mean(tree: Any, axis_name: AxisName) -> Any:
  """Mean over all workers of each leaf: the all-reduce average."""
  axes = _axes(axis_name)
  if not axes:
    return tree
  return _per_worker(lax.pmean(tree, axes), tree, axes)
