"""The worker mesh: P workers on D devices, P/D workers vmapped per device inside `jax.shard_map`.

Worker w lives on device w // L at local slot w % L (L = P / D). Every per-worker array has a leading
dimension P sharded over the mesh axis `DEVICE_AXIS`. Algorithms receive `axis_name`:
`DEVICE_AXIS` when L = 1, `(DEVICE_AXIS, LOCAL_AXIS)` when workers share a device.

JAX's varying-axes check (`check_vma`) does not model `vmap` axes: a collective over the vmapped axis inside
`shard_map` fails that check (an assertion in `pvary`), so the check is on only when L = 1, which covers every
multi-device pod layout; the vmapped layout is covered by tests against the L = 1 layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from waitless import config_errors as errors

DEVICE_AXIS = 'workers'
LOCAL_AXIS = 'local_workers'


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
  """P workers over the first D devices."""
  workers: int
  mesh: Mesh

  @classmethod
  def create(cls, workers: int, devices: int) -> 'WorkerLayout':
    available = jax.devices()
    if devices > len(available):
      raise ValueError(f'devices={devices} but only {len(available)} {available[0].platform} device(s) are '
                       'visible; lower `devices` (workers are vmapped onto fewer devices)')
    if jax.process_count() > 1 and devices != len(available):
      # Every process must feed some workers: a mesh over a prefix of the devices would leave some out.
      raise errors.ConfigError('devices', devices, f'must be {len(available)}, all devices of the '
                               f'{jax.process_count()} processes, in a multi-process run')
    return cls(workers=workers, mesh=Mesh(np.array(available[:devices]), (DEVICE_AXIS,)))

  @property
  def devices(self) -> int:
    return self.mesh.size

  @property
  def platform(self) -> str:
    """The devices' platform: 'cpu', 'gpu' or 'tpu'."""
    return self.mesh.devices.flat[0].platform

  @property
  def local(self) -> int:
    return self.workers // self.devices

  @property
  def axis_name(self):
    return DEVICE_AXIS if self.local == 1 else (DEVICE_AXIS, LOCAL_AXIS)

  def sharding(self, *leading: None) -> NamedSharding:
    """Sharding of an array whose worker dimension comes after `len(leading)` unsharded ones."""
    return _named_sharding(self.mesh, PartitionSpec(*leading, DEVICE_AXIS))

  def replicated(self) -> NamedSharding:
    return _named_sharding(self.mesh, PartitionSpec())

  def local_worker_ids(self) -> np.ndarray:
    """Global ids of the workers whose devices belong to this process (all of them on one host); read-only."""
    return _local_worker_ids(self.mesh, self.local, jax.process_index())

  def per_worker(self, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Lifts fn(per-worker args) to the device's block of L workers (leading dimension L)."""
    if self.local > 1:
      return jax.vmap(fn, axis_name=LOCAL_AXIS)

    def squeezed(*args):
      out = fn(*jax.tree.map(lambda x: x[0], args))
      return jax.tree.map(lambda x: x[None], out)
    return squeezed

  def shard_map(self, fn: Callable[..., Any], in_specs, out_specs) -> Callable[..., Any]:
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=self.local == 1)


# The loop asks for these every block: one NamedSharding per mesh and spec, not a new one that the transfer and
# the jitted call's cache hash again.
@functools.lru_cache(maxsize=64)
def _named_sharding(mesh: Mesh, spec: PartitionSpec) -> NamedSharding:
  return NamedSharding(mesh, spec)


@functools.lru_cache(maxsize=16)
def _local_worker_ids(mesh: Mesh, local: int, process: int) -> np.ndarray:
  mine = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == process]
  ids = np.concatenate([np.arange(i * local, (i + 1) * local) for i in mine])
  ids.flags.writeable = False  # shared by every caller
  return ids
