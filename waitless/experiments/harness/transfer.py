"""A block's inputs in ONE transfer (`pack` on the host), and back inside the program (`unpack`).

Every array handed to the devices is a transfer of its own to each device, whatever its size. So the host packs
every integer of a block into ONE array sharded over the workers: the examples' indices (when the data set lives
on the devices and the program gathers its micro-batches there), every per-worker field of the schedule, then
the uniform fields, the step numbers and the uniform fields that differ between replicas, each repeated in every
worker's row. Bools and ints travel as integers, floats bitcast to the integers of their width: unpacking gives
back exactly what a direct transfer gives. A data set that does not live on the devices still sends its
examples as arrays of their own.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
from jax import lax
from jax._src.interpreters import pxla  # private: `put`'s fast path, with a fallback
import jax.numpy as jnp
import numpy as np


class Packing(NamedTuple):
  """What a pack holds, in order (static: part of the compiled program's key)."""
  per_worker: tuple[tuple[str, str], ...]  # (field, kind) after the indices; kind: 'bool', 'int' or 'float'
  shared: tuple[tuple[str, str], ...]      # uniform fields every replica shares, then ('step', 'int')
  own: tuple[tuple[str, str], ...]         # uniform fields that differ between replicas, (R, n, .)
  index_shape: Optional[tuple[int, ...]]   # (m, micro-batch) of the examples' indices; None: examples sent


class Packed(NamedTuple):
  """The arrays of one block: the (..., n, P, F) integers (indices, per-worker fields, then the uniform ones:
  shared, the steps, own), and the examples themselves (a dict of (..., n, P, m, b, ...) arrays) when they are
  not indices."""
  per_worker: Any
  batches: Any


_BATCHED_DEVICE_PUT = getattr(pxla, 'batched_device_put', None)  # None: a JAX without it (`put` falls back)


def put(array: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """`jax.device_put(array, sharding)` of a host array in this process, by the call it ends in
  (`pxla.batched_device_put`: each device's slice handed over at once) without the tree walk and checks around
  it. Falls back to `jax.device_put` where a JAX version lacks that call (tests/.../test_transfer.py checks that
  the pinned one has it, and that both give the same array)."""
  fast = _BATCHED_DEVICE_PUT
  if fast is None or sharding.is_fully_replicated:
    return jax.device_put(array, sharding)
  devices, indices = _shards(sharding, array.shape)
  return fast(pxla.core.shaped_abstractify(array), sharding, [array[i] for i in indices], list(devices))


def fetch(array: jax.Array) -> np.ndarray:
  """`np.asarray(array)` of an array whose shards all live in this process, assembled here from its shards by
  position (`addressable_data`, without the `Shard` objects that `addressable_shards` builds at each read)."""
  if not isinstance(array, jax.Array):
    return np.asarray(array)
  if array.is_fully_replicated:
    return np.asarray(array.addressable_data(0))
  out = np.empty(array.shape, array.dtype)
  for i, index in enumerate(_shards(array.sharding, array.shape)[1]):
    out[index] = np.asarray(array.addressable_data(i))
  return out


@functools.lru_cache(maxsize=256)
def _shards(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[tuple, tuple]:
  """(this process's devices, where each one's shard of an array of `shape` goes), in the sharding's addressable
  device order, the order `addressable_data` numbers an array's shards (tests/experiments/harness/test_transfer.py
  checks it on a permuted mesh); computed once per sharding and shape."""
  placement = sharding.addressable_devices_indices_map(shape)
  return tuple(placement), tuple(placement.values())


def _int_dtype():
  return jax.dtypes.canonicalize_dtype(np.int64)  # int32, or int64 with x64 (floats of the same width fit)


def _float_dtype():
  return jax.dtypes.canonicalize_dtype(np.float64)


def _kind(array: np.ndarray) -> str:
  if array.dtype == np.bool_:
    return 'bool'
  return 'float' if np.issubdtype(array.dtype, np.floating) else 'int'


def _as_int(array: np.ndarray) -> np.ndarray:
  if _kind(array) == 'float':
    return np.asarray(array, _float_dtype()).view(_int_dtype())
  return np.asarray(array, _int_dtype())


def _as_kind(column: jax.Array, kind: str) -> jax.Array:
  if kind == 'bool':
    return column != 0
  if kind == 'float':
    return lax.bitcast_convert_type(column, _float_dtype())
  return column


def _columns(fields: dict[str, np.ndarray], lead: tuple[int, ...]) -> list[np.ndarray]:
  return [_as_int(v).reshape(lead + (1,)) for v in fields.values()]


def pack(per_worker: dict[str, np.ndarray], shared: dict[str, np.ndarray], own: dict[str, np.ndarray],
         steps: np.ndarray, indices: Optional[np.ndarray] = None,
         batches: Optional[dict[str, np.ndarray]] = None) -> tuple[Packed, Packing]:
  """Packs a block's host arrays: per-worker fields (..., n, P), shared uniform fields (n,), own uniform fields
  (R, n), the steps (n,), and either the examples' `indices` (..., n, P, m, b) or the examples (`batches`)."""
  lead = next(iter(per_worker.values())).shape
  columns = _columns(per_worker, lead)
  if indices is not None:
    columns.insert(0, np.asarray(indices, _int_dtype()).reshape(lead + (-1,)))
  uniform = _columns(shared, steps.shape) + [_as_int(steps).reshape(-1, 1)]  # (n, 1) each
  uniform = [np.broadcast_to(c[..., None, :], lead + (1,)) for c in uniform]
  uniform += [np.broadcast_to(c[..., None, :], lead + (1,)) for c in _columns(own, lead[:-1])]  # (R, n, 1) each
  packing = Packing(per_worker=tuple((k, _kind(v)) for k, v in per_worker.items()),
                  shared=tuple((k, _kind(v)) for k, v in shared.items()) + (('step', 'int'),),
                  own=tuple((k, _kind(v)) for k, v in own.items()),
                  index_shape=None if indices is None else tuple(indices.shape[len(lead):]))
  return Packed(np.concatenate(columns + uniform, axis=-1), batches), packing


def unpack(packed: Packed, packing: Packing):
  """Inside the program, from a device's block of the pack ((n, L, F) for a run, (R, n, L, F) for a group):
  (the examples' indices (..., n, L, m, b) or the examples, per-worker fields (..., n, L), shared uniform fields
  (n,), own uniform fields (R, n), the steps (n,) as int32). The uniform fields are read from the device's first
  worker's row (every row holds them) and, for a group, the shared ones from its first replica."""
  columns = packed.per_worker
  offset = 0
  indices = packed.batches
  if packing.index_shape is not None:
    offset = int(np.prod(packing.index_shape))
    indices = columns[..., :offset].reshape(columns.shape[:-1] + packing.index_shape)
  per_worker = {name: _as_kind(columns[..., offset + i], kind) for i, (name, kind) in enumerate(packing.per_worker)}
  offset += len(packing.per_worker)
  first_row = columns[..., 0, :]  # (n, F) or (R, n, F)
  shared_rows = first_row if first_row.ndim == 2 else first_row[0]
  shared = {name: _as_kind(shared_rows[:, offset + i], kind) for i, (name, kind) in enumerate(packing.shared)}
  offset += len(packing.shared)
  steps = shared.pop('step').astype(jnp.int32)
  own = {name: _as_kind(first_row[..., offset + i], kind) for i, (name, kind) in enumerate(packing.own)}
  return indices, per_worker, shared, own, steps
