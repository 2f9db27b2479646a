"""Orbax checkpoints of everything a run needs to continue bit for bit.

Each checkpoint holds two items: `state` (the TrainState arrays, sharded per worker, written by every process
for its own shards) and `meta` (JSON: step, per-worker data positions, the cluster clock's state, simulated and
wall time so far, the first time the target accuracy was reached, the last metrics window). Saves are
asynchronous; an interrupted save is never the one restored (orbax finalises a step atomically).

Orbax checks only its index files: flipped bytes in an array's data read back as other numbers. So each save
writes a checksum of the state's content into `meta` (`state_checksum`, computed on the devices, the same on every
process), and one of `meta` itself; a restore recomputes both and compares. A checkpoint that orbax finalised but
that cannot be read back or does not match its checksums (a truncated or corrupted file, a disk error) is reported
in one line, moved to `<workdir>/corrupt_checkpoints/<step>`, and the previous one is restored. Before anything
trains, `check_writable` makes sure the workdirs can take the checkpoints at all (all the runs of a group
together).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import zlib
from typing import Any, Callable, Optional, Sequence

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from waitless.experiments.harness import compilation_cache
from waitless.experiments.harness import distributed

log = logging.getLogger('waitless')


class UnusableWorkdir(ValueError):
  """The workdir cannot hold the run's outputs (read-only, or not enough free space for a checkpoint)."""


def check_writable(workdirs: Sequence[str], checkpoint_bytes: float = 0.0) -> None:
  """Raises UnusableWorkdir (one line) unless every one of `workdirs` takes a file and each filesystem has room for
  two checkpoints of `checkpoint_bytes` of every run written there (the runs of a group write theirs at once)."""
  devices: dict[int, list[str]] = {}
  for workdir in workdirs:
    probe = os.path.join(workdir, f'.write_probe_{jax.process_index()}')
    try:
      os.makedirs(workdir, exist_ok=True)
      with open(probe, 'wb') as f:
        f.write(b'\0' * 4096)
      os.remove(probe)
      devices.setdefault(os.stat(workdir).st_dev, []).append(workdir)
    except OSError as e:
      raise UnusableWorkdir(f'workdir {workdir} is not writable ({e.strerror or e}): use another --workdir') from e
  if checkpoint_bytes <= 0:
    return
  for runs in devices.values():
    free = shutil.disk_usage(runs[0]).free
    needed = len(runs) * (2.0 * checkpoint_bytes + (1 << 20))  # the kept checkpoint, the one being written, metadata
    if free < needed:
      whose = 'this run' if len(runs) == 1 else f'each of the {len(runs)} runs of this group written there'
      raise UnusableWorkdir(f'workdir {runs[0]} has {free / 1e6:.1f} MB free but two checkpoints of {whose} need '
                            f'about {needed / 1e6:.1f} MB: free some space, use another --workdir'
                            + ('' if len(runs) == 1 else ' or fewer replicas (--max_replicas)'))


def background_error_filter(record: logging.LogRecord) -> bool:
  """False for orbax's log of a failed background save (a traceback at ERROR): the same error is raised again
  at the next save or wait (`Checkpointer`), where the program reports it in one line."""
  return 'in background save thread' not in record.getMessage()


# One program copies the whole state (per-leaf `jnp.copy` compiles one program per leaf shape).
_copy_tree = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


class CorruptCheckpoint(ValueError):
  """A checkpoint read back other content than was saved (its checksums do not match)."""


def _words(x: jax.Array) -> jax.Array:
  """The bit patterns of `x` as a flat uint32 vector (8-byte values as two words each)."""
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32).ravel()
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()


def _leaf_sums(tree) -> jax.Array:
  """Per leaf a Fletcher-style pair (sum of the words, sum of the words times their position), modulo 2**32:
  a changed word changes the first, a moved or swapped one the second."""
  sums = []
  for leaf in jax.tree.leaves(tree):
    words = _words(leaf)
    position = jnp.arange(1, words.size + 1, dtype=jnp.uint32)
    sums.append(jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * position, dtype=jnp.uint32)]))
  return jnp.stack(sums) if sums else jnp.zeros((0, 2), jnp.uint32)


@functools.lru_cache(maxsize=None)
def _jitted_leaf_sums(platform: str):
  """`_leaf_sums` jitted, for CPU at -O1 (`compilation_cache.quick_compile_options`: integer ops, exact at any
  level): on a short CPU run its compile at -O2 took longer than the run's checkpoint itself."""
  return jax.jit(_leaf_sums, compiler_options=compilation_cache.quick_compile_options(platform))


def _host_leaf_sums(leaves: Sequence[jax.Array]) -> np.ndarray:
  """`_leaf_sums` computed with numpy: the same words, the same sums modulo 2**32."""
  sums = np.zeros((len(leaves), 2), np.uint32)
  for i, leaf in enumerate(leaves):
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    x = np.ascontiguousarray(leaf)
    words = x.astype(np.uint32) if x.dtype == np.bool_ else x.view(f'u{min(x.dtype.itemsize, 4)}').astype(np.uint32)
    words = words.ravel()
    sums[i] = words.sum(dtype=np.uint32), (words * np.arange(1, words.size + 1, dtype=np.uint32)).sum(dtype=np.uint32)
  return sums


def _on_host(leaves: Sequence[Any]) -> bool:
  """Whether every leaf is a JAX array on CPU devices of this process: its checksum is then cheaper on the host
  (no program to compile, the arrays already in host memory) and the same."""
  return bool(leaves) and all(isinstance(x, jax.Array) and x.is_fully_addressable
                              and all(d.platform == 'cpu' for d in x.devices()) for x in leaves)


def state_checksum(state: Any) -> str:
  """A checksum of the content of `state` (its leaves' bits, in tree order), equal on every process."""
  leaves = jax.tree.leaves(state)
  if _on_host(leaves):
    local = _host_leaf_sums(leaves)
  else:
    device = next(iter(leaves[0].devices())) if leaves and isinstance(leaves[0], jax.Array) else jax.devices()[0]
    sums = _jitted_leaf_sums(device.platform)(state)
    local = np.asarray(sums.addressable_data(0))  # replicated: every process holds the whole result
  return format(zlib.crc32(local.astype('<u4').tobytes()), '08x')


CHECKSUM_KEYS = ('state_checksum', 'meta_checksum')  # what a save adds to `meta`, and a restore removes


def _meta_checksum(meta: dict[str, Any]) -> str:
  body = {k: v for k, v in meta.items() if k != 'meta_checksum'}
  return format(zlib.crc32(json.dumps(body, sort_keys=True).encode()), '08x')


def check_restored(state: Any, meta: dict[str, Any]) -> None:
  """Raises CorruptCheckpoint (one line) if `state` or `meta` differ from what their checkpoint's save wrote."""
  if meta.get('meta_checksum') != _meta_checksum(meta):
    raise CorruptCheckpoint('its meta item does not match its checksum')
  if meta.get('state_checksum') != state_checksum(state):
    raise CorruptCheckpoint('its state does not match the checksum written with it')


def barrier_prefix(directory: str) -> str:
  """The prefix of orbax's barrier keys for the checkpoints in `directory`: equal on every process (they run the
  same command), different for each workdir.

  Orbax names a save's barriers after its step ('async_write_complete.20'): the replicas of a group save the same
  step at once, and with one key they met at one barrier ("already ongoing": an abort, or a hang).
  """
  return 'waitless_' + format(zlib.crc32(os.path.normpath(directory).encode()), '08x')


class Checkpointer:
  """One run's orbax checkpoints in `directory` (the newest `max_to_keep` kept).

  In a multi-process run its barriers are keyed by `barrier_prefix(directory)`, and a save's barrier that a peer
  never reaches fails after the run's heartbeat timeout (`CheckpointBarrierTimeout` at the next save or wait)
  rather than orbax's 20 minutes.
  """

  def __init__(self, directory: str, max_to_keep: int = 2):
    self._manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                barrier_sync_key_prefix=barrier_prefix(directory)),
            async_options=ocp.options.AsyncOptions(timeout_secs=distributed.heartbeat_timeout_s())))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict[str, Any], copy: bool = True) -> None:
    """Saves `state` and `meta` at `step` (asynchronously). `copy=False` for a state no program will donate (a
    replica's slice of a group's state is a new array already)."""
    # The training step donates its state: the next call may reuse these buffers while the asynchronous save
    # is still reading them (on CPU the "host copy" can alias the device buffer). Save a private copy.
    if copy:
      state = _copy_tree(state)
    # The same for `meta`: the save serialises it later, and the loop keeps mutating what it holds (the metrics
    # window's sums). A JSON copy now is what the checkpoint means: the state of the loop at `step`.
    meta = json.loads(json.dumps(meta))
    meta['state_checksum'] = state_checksum(state)
    meta['meta_checksum'] = _meta_checksum(meta)
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, like_state: Any) -> tuple[Any, dict[str, Any]]:
    """The state (with `like_state`'s structure, shapes and shardings) and meta saved at `step`.

    Raises:
      CorruptCheckpoint: what was read back does not match the checksums written with it.
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    check_restored(restored['state'], restored['meta'])
    return restored['state'], {k: v for k, v in restored['meta'].items() if k not in CHECKSUM_KEYS}

  def restore_step(self, step: int, like_state: Any,
                   quarantine: Optional[Callable[[int], None]] = None) -> Optional[tuple[Any, dict]]:
    """(state, meta) of the checkpoint at `step`; None if it does not read back: then it is logged in one line
    and handed to `quarantine(step)` (which moves it away)."""
    try:
      return self.restore(step, like_state)
    except Exception as e:  # orbax / tensorstore / JSON errors alike
      reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
      log.warning('checkpoint at step %d is unreadable (%s: %s); trying the previous one',
                  step, type(e).__name__, reason)
      if quarantine is not None:
        quarantine(step)
        self._manager.reload()
      return None

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def quarantine_step(workdir: str) -> Callable[[int], None]:
  """Moves `<workdir>/checkpoints/<step>` to `<workdir>/corrupt_checkpoints/<step>` (process 0; all wait)."""
  def move(step: int) -> None:
    if jax.process_index() == 0:
      target = os.path.join(workdir, 'corrupt_checkpoints')
      os.makedirs(target, exist_ok=True)
      shutil.move(os.path.join(workdir, 'checkpoints', str(step)), os.path.join(target, str(step)))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f'quarantine checkpoint {step}')
  return move
