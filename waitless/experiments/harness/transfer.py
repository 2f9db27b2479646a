"""A block's inputs in one transfer per sharding (`pack` on the host), and back inside the program (`unpack`).

Every array handed to the devices is a transfer of its own to each device (about 70-100 us on XLA:CPU, whatever
its size), and a block's inputs were up to ten of them. The host packs the per-worker integers into ONE array
sharded over the workers: the examples' indices, when the data set lives on the devices (the step gathers its
micro-batches there), then every per-worker field of the schedule. The uniform fields and the step numbers go
into ONE replicated array (and the uniform fields that differ between replicas into one more). Bools and ints
travel as integers, floats bitcast to the integers of their width: unpacking gives back exactly what a direct
transfer gives. A data set that does not live on the devices still sends its examples as arrays of their own.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np


class PackSpec(NamedTuple):
  """What a pack holds, in order (static: part of the compiled program's key)."""
  per_worker: tuple[tuple[str, str], ...]  # (field, kind) after the indices; kind: 'bool', 'int' or 'float'
  shared: tuple[tuple[str, str], ...]      # uniform fields every replica shares, then ('step', 'int')
  own: tuple[tuple[str, str], ...]         # uniform fields that differ between replicas, (R, n, .)
  index_shape: Optional[tuple[int, ...]]   # (m, micro-batch) of the examples' indices; None: examples sent


class Packed(NamedTuple):
  """The arrays of one block: per-worker (..., n, P, F) integers, shared (n, U + 1), own (R, n, V) or None,
  and the examples themselves (a dict of (..., n, P, m, b, ...) arrays) when they are not indices."""
  per_worker: Any
  shared: Any
  own: Any
  batches: Any


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
         batches: Optional[dict[str, np.ndarray]] = None) -> tuple[Packed, PackSpec]:
  """Packs a block's host arrays: per-worker fields (..., n, P), shared uniform fields (n,), own uniform fields
  (R, n), the steps (n,), and either the examples' `indices` (..., n, P, m, b) or the examples (`batches`)."""
  lead = next(iter(per_worker.values())).shape
  columns = _columns(per_worker, lead)
  if indices is not None:
    columns.insert(0, np.asarray(indices, _int_dtype()).reshape(lead + (-1,)))
  packed_shared = np.concatenate(_columns(shared, steps.shape) + [_as_int(steps).reshape(-1, 1)], axis=-1)
  packed_own = np.concatenate(_columns(own, next(iter(own.values())).shape), axis=-1) if own else None
  spec = PackSpec(per_worker=tuple((k, _kind(v)) for k, v in per_worker.items()),
                  shared=tuple((k, _kind(v)) for k, v in shared.items()) + (('step', 'int'),),
                  own=tuple((k, _kind(v)) for k, v in own.items()),
                  index_shape=None if indices is None else tuple(indices.shape[len(lead):]))
  return Packed(np.concatenate(columns, axis=-1), packed_shared, packed_own, batches), spec


def unpack(packed: Packed, spec: PackSpec):
  """Inside the program: (the examples' indices (..., n, P, m, b) or the examples, per-worker fields,
  shared uniform fields, own uniform fields, the steps as int32)."""
  offset = 0
  indices = packed.batches
  if spec.index_shape is not None:
    offset = int(np.prod(spec.index_shape))
    indices = packed.per_worker[..., :offset].reshape(packed.per_worker.shape[:-1] + spec.index_shape)
  per_worker = {name: _as_kind(packed.per_worker[..., offset + i], kind)
                for i, (name, kind) in enumerate(spec.per_worker)}
  shared = {name: _as_kind(packed.shared[..., i], kind) for i, (name, kind) in enumerate(spec.shared)}
  steps = shared.pop('step').astype(jnp.int32)
  own = {name: _as_kind(packed.own[..., i], kind) for i, (name, kind) in enumerate(spec.own)}
  return indices, per_worker, shared, own, steps
