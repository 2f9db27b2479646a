"""Orbax checkpoints of everything a run needs to continue bit for bit.

Each checkpoint holds two items: `state` (the TrainState arrays, sharded per worker, written by every process
for its own shards) and `meta` (JSON: step, per-worker data positions, the cluster clock's state, simulated and
wall time so far, the first time the target accuracy was reached, the last metrics window). Saves are
asynchronous; an interrupted save is never the one restored (orbax finalises a step atomically).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, directory: str, max_to_keep: int = 2):
    self._manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    # The training step donates its state: the next call may reuse these buffers while the asynchronous save
    # is still reading them (on CPU the "host copy" can alias the device buffer). Save a private copy.
    state = jax.tree.map(jnp.copy, state)
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, like_state: Any) -> tuple[Any, dict[str, Any]]:
    """The state (with `like_state`'s structure, shapes and shardings) and meta saved at `step`."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return restored['state'], restored['meta']

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
