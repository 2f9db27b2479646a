"""Collectives over the worker axes, the only way algorithms talk to each other.

`axis_name` is what the harness (or a library user) passes to an algorithm: `None` (one worker, no
communication: the transformation is a plain optax transformation), one mesh axis name (one worker per
device), or a tuple of names (device axis of `jax.shard_map` plus the `jax.vmap` axis of the workers that share
a device). The global worker index orders workers device-major: worker = device * local + local_index.

Several workers per device need `jax.shard_map(..., check_vma=False)`: JAX's varying-axes check does not know
`vmap` axes, so under the default `check_vma=True` a psum or ppermute over the vmapped axis fails inside JAX
(a psum axis error, a bare AssertionError). The collectives below raise a ValueError saying so instead. With one
worker per device the check can stay on.
"""

from __future__ import annotations

import operator
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


def _check_layout(tree: Any, axes: tuple[Hashable, ...]) -> None:
  """A ValueError naming the fix when a collective names a vmapped axis inside `shard_map(check_vma=True)`."""
  manual = frozenset(jax.sharding.get_abstract_mesh().manual_axes)
  vmapped = [a for a in axes if a not in manual]
  if manual and vmapped and any(_varying_axes(x) for x in jax.tree.leaves(tree)):
    raise ValueError(f'the worker axes {axes} include {vmapped}, a vmap axis inside jax.shard_map with its '
                     'varying-axes check on, which JAX does not support for collectives: several workers per '
                     'device need jax.shard_map(..., check_vma=False)')


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
  _check_layout(tree, axes)
  return _per_worker(lax.psum(tree, axes), tree, axes)


def worker_sum_and_count(tree: Any, count: Any, axis_name: AxisName, host_total: Any = None) -> tuple[Any, Any]:
  """(sum over workers of `tree`, sum over workers of `count`), for a weighted mean.

  `host_total`: the count's sum when the caller's schedule already carries it (the time rule decided who
  finished what, so it summed it on the host); then only `tree` is all-reduced, with no scalar added to the
  gradients' collective. Without it the count is all-reduced with the tree, in one collective.
  """
  if host_total is None:
    return worker_sum((tree, count), axis_name)
  return worker_sum(tree, axis_name), jnp.asarray(host_total)


def worker_mean(tree: Any, axis_name: AxisName) -> Any:
  """Mean over all workers of each leaf: the all-reduce average."""
  axes = _axes(axis_name)
  if not axes:
    return tree
  _check_layout(tree, axes)
  return _per_worker(lax.pmean(tree, axes), tree, axes)


def _shift(tree: Any, axis: Hashable, size: int, shift: int) -> Any:
  """Moves each leaf `shift` steps along one axis: index j receives from (j - shift) mod size."""
  shift %= size
  if shift == 0:  # also size 1: nothing moves, so no collective is emitted at all
    return tree
  return lax.ppermute(tree, axis, perm=[(j, (j + shift) % size) for j in range(size)])


def ring_shift(tree: Any, axis_name: AxisName, offset: int) -> Any:
  """Worker i receives the value of worker (i - offset) mod P: `jnp.roll` by `offset` over the workers.

  Multi-axis ppermutes fail when workers are vmapped, so the shift is done one axis at a time, from the
  fastest-varying (last) axis to the slowest: it is a subtraction in mixed radix. Along axis t the source
  digit is the receiver's digit minus the offset's digit minus a borrow, and the borrow is 1 exactly on the
  receivers whose lower digits (the axes after t) read less than the offset's lower digits. Each axis is
  therefore at most two single-axis ppermutes of the same value, selected per receiver; the last axis has no
  borrow (one ppermute), an axis with no possible borrow has one, and identity shifts are skipped. With
  (devices, local workers) that is a local shift by offset mod L and a device shift by q or q + 1
  (q = (offset mod P) // L), the latter for the elements that wrapped around the local axis.

  Args:
    tree: per-worker pytree.
    axis_name: the worker axes (None: one worker, returned as is).
    offset: static shift of any sign and size.

  Returns:
    The pytree of worker (i - offset) mod P, on worker i.
  """
  axes = _axes(axis_name)
  _check_layout(tree, axes)
  sizes = [lax.axis_size(a) for a in axes]
  remaining = int(offset) % num_workers(axis_name)
  out = tree
  below = 1  # product of the sizes of the axes after axis t
  for t in reversed(range(len(axes))):
    axis, size = axes[t], sizes[t]
    digit, low = (remaining // below) % size, remaining % below
    if low == 0 or size == 1:  # nobody borrows, or both shifts are the identity
      out = _shift(out, axis, size, digit)
    else:
      borrow = worker_index(axes[t + 1:]) < low
      plain, borrowed = _shift(out, axis, size, digit), _shift(out, axis, size, digit + 1)
      out = jax.tree.map(lambda a, b: jnp.where(borrow, b, a), plain, borrowed)
    below *= size
  return out


def _xor_digits(axis_name: AxisName, mask: int, what: str) -> list[tuple[Hashable, int, int]]:
  """(axis, size, part of the mask on that axis) per axis, after checking P is a power of two and the mask."""
  axes = _axes(axis_name)
  sizes = [lax.axis_size(a) for a in axes]
  workers = num_workers(axis_name)
  if workers & (workers - 1):
    raise ValueError(f'{what} needs a power-of-two number of workers, got P={workers} (axis sizes {sizes})')
  if not 0 <= mask < workers:
    raise ValueError(f'{what} mask must be in [0, P={workers}), got {mask}')
  # With P a power of two every axis size is a power of two, so the device-major index is the axes' bits concatenated:
  # the last axis holds the lowest bits of the mask.
  digits = []
  for axis, size in zip(reversed(axes), reversed(sizes)):
    digits.append((axis, size, mask % size))
    mask //= size
  return digits


def xor_exchange(tree: Any, axis_name: AxisName, mask: int) -> Any:
  """Worker i receives the value of worker i XOR mask (a pairwise swap; the identity for mask 0).

  XOR acts on each axis's bits independently, so a multi-axis exchange (which fails when workers are vmapped)
  is one single-axis ppermute per axis whose part of the mask is nonzero: the last (local) axis takes the low
  log2 L bits, the device axis the rest. An exchange along the vmapped axis compiles to a local permutation.

  Args:
    tree: per-worker pytree.
    axis_name: the worker axes (None: one worker).
    mask: static int in [0, P).

  Returns:
    The pytree of worker i XOR mask, on worker i.

  Raises:
    ValueError: P is not a power of two, or the mask is outside [0, P).
  """
  _check_layout(tree, _axes(axis_name))
  out = tree
  for axis, size, part in _xor_digits(axis_name, operator.index(mask), 'xor_exchange'):
    if part:
      out = lax.ppermute(out, axis, perm=[(j, j ^ part) for j in range(size)])
  return out


def xor_group_sum(tree: Any, axis_name: AxisName, masks: Sequence[int]) -> Any:
  """Sum over the group of worker i: the workers i XOR (any XOR of a subset of `masks`), 2^len(masks) of them.

  Recursive doubling: round r adds the partner's partial sum, x + xor_exchange(x, masks[r]); after all
  rounds every member of a group holds the group's sum. The masks must be distinct powers of two (the groups
  are then the cosets of the subgroup they span, each of exactly 2^len(masks) workers, each worker counted
  once). No masks: each worker is its own group (identity). WAGMA-SGD takes m_r = 1 << ((t*g + r) mod G).

  Args:
    tree: per-worker pytree.
    axis_name: the worker axes (None: one worker).
    masks: static distinct powers of two below P.

  Returns:
    The group sum of each leaf, on every member of the group.

  Raises:
    ValueError: P is not a power of two, or a mask is not a power of two below P or is repeated.
  """
  masks = [operator.index(m) for m in masks]
  if len(set(masks)) != len(masks):
    raise ValueError(f'xor_group_sum masks must be distinct, got {masks}')
  for m in masks:
    if m <= 0 or m & (m - 1):
      raise ValueError(f'xor_group_sum masks must be powers of two, got {m} in {masks}')
    _xor_digits(axis_name, m, 'xor_group_sum')  # raises on P or a mask out of range, named for this caller
  out = tree
  for m in masks:
    out = jax.tree.map(jnp.add, out, xor_exchange(out, axis_name, m))
  return out


def matching_exchange(tree: Any, axis_name: AxisName, partners: Sequence[int]) -> Any:
  """Worker i receives the value of worker partners[i], its partner in a matching (MATCHA's gossip).

  A matching pairs workers at most once each: partners[partners[i]] == i, and partners[i] == i for a worker
  left out, which keeps its own value (no message). Point-to-point only, never an all-reduce:
  - one worker axis of size > 1 (one worker per device on a pod, or one vmapped axis): one ppermute whose pairs
    are the matching's edges (and an unmatched worker to itself), so every worker sends and receives one message;
  - several axes (vmapped workers on several devices) with a XOR matching (partner i XOR m for every i, P a
    power of two): one `xor_exchange`;
  - otherwise one `ring_shift` per distinct offset partners[i] - i mod P, each receiver keeping the shift that
    brings its partner's value (a ring's matchings have offsets +1 and -1: two shifts, twice the minimum data
    movement on that layout; multi-axis ppermutes fail when workers are vmapped, so there is no single one).

  Args:
    tree: per-worker pytree.
    axis_name: the worker axes (None: one worker).
    partners: static sequence of P ints, an involution of range(P).

  Returns:
    The pytree of worker partners[i] on worker i (its own where partners[i] == i).

  Raises:
    ValueError: `partners` is not an involution of range(P).
  """
  partners = tuple(operator.index(j) for j in partners)
  p = num_workers(axis_name)
  if len(partners) != p or any(not 0 <= j < p or partners[j] != i for i, j in enumerate(partners)):
    raise ValueError(f'matching_exchange partners must pair the P={p} workers at most once each '
                     f'(partners[partners[i]] == i), got {partners}')
  matched = [i for i in range(p) if partners[i] != i]
  if not matched:
    return tree
  axes = _axes(axis_name)
  _check_layout(tree, axes)
  wide = [a for a in axes if lax.axis_size(a) > 1]
  if len(wide) == 1:  # the global index is the index along that axis
    # The whole involution (an unmatched worker "sends" to itself: a local copy): ppermute along a vmapped axis
    # takes only full permutations.
    return lax.ppermute(tree, wide[0], perm=list(enumerate(partners)))
  me = worker_index(axis_name)
  if not p & (p - 1) and len({i ^ j for i, j in enumerate(partners)}) == 1:
    received = xor_exchange(tree, axis_name, partners[0])
  else:
    offset = [(partners[i] - i) % p for i in range(p)]
    mine = jnp.asarray(offset, jnp.int32)[me]
    received = None
    for d in sorted({offset[i] for i in matched}):
      shifted = ring_shift(tree, axis_name, -d)  # worker i receives worker i + d
      received = shifted if received is None else jax.tree.map(
          lambda s, r, d=d: jnp.where(mine == d, s, r), shifted, received)
  if len(matched) == p:
    return received
  keep = jnp.asarray([partners[i] == i for i in range(p)])[me]
  return jax.tree.map(lambda own, r: jnp.where(keep, own, r), tree, received)
