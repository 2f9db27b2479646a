"""The block step of a run or a group (`BlockStep`): its compiled block programs (`block_program.py`), and their
measurements brought to the host."""

from __future__ import annotations

import functools

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from waitless.experiments.harness import block_program
from waitless.experiments.harness import measured_time
from waitless.experiments.harness import replicas as replicas_lib
from waitless.experiments.harness import setup
from waitless.experiments.harness import transfer
from waitless.experiments.harness import xla_cpu


def to_host(tree):
  """Fetches (possibly multi-host sharded) arrays as numpy on every process."""
  if jax.process_count() == 1:
    return jax.tree.map(transfer.fetch, tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def measurements_to_host(packed, timed: bool = False) -> dict[str, np.ndarray]:
  """The block program's packed measurements as the host dict of `block_program.unpack_measurements` (`timed`:
  a program with a stopwatch)."""
  return block_program.unpack_measurements(to_host(packed), timed)


class BlockStep:
  """The block programs of a run or a group: `(state, packed, packing, steps, slots) -> (state, measurements)`.

  The block's inputs come packed (`transfer.pack`) with their static `packing`, `steps` is a host int32 array and
  `slots` the block's static number of gradient slots (`block_program.gradient_slots`; None: every worker
  computes). A data set held in memory lives on the devices (placed once, here), and the program reads its
  micro-batches there by index. A block of whole rounds of the algorithm's `round_length` runs the
  round-structured program where `rounds` is true (default: `xla_cpu.rounds_pay_off`), any other block the
  per-iteration one. Each program compiles once per block length (and, for `run.finished_only`, once per
  power-of-two batch size). For a group of R > 1 the programs carry a replica axis and take the group's
  differing values as inputs (`block_program.ReplicaAxis`).
  """

  def __init__(self, run_or_group, rounds: bool | None = None, vectorized: bool = True,
               busy_loop: bool | None = None):
    """`rounds`: whole-round blocks run the round-structured program (None: `xla_cpu.rounds_pay_off`);
    `busy_loop`: busy gradient slots computed in a loop (None: `xla_cpu.busy_loop_pays_off`);
    `vectorized`: a group's replicas vectorised (`jax.vmap`) or one after another (`lax.map`)."""
    group = setup.as_group(run_or_group)
    run = group.lead
    platform = run.layout.platform
    # A measured run times every device's gradient phase; `compiled`: whether the last call compiled.
    self.stopwatch = measured_time.Stopwatch() if run.measured else None
    self.busy_loop = xla_cpu.busy_loop_pays_off(platform) if busy_loop is None else busy_loop
    self.compiled = False
    replica_axis, self.values = None, None
    streams = run.dataset.train
    self.data = None if streams.resident is None else jax.device_put(
        {k: jnp.asarray(v) for k, v in streams.resident.items()}, run.layout.replicated())  # once, every device
    if group.batched:
      def build_replica(values):
        config = replicas_lib.traced_config(run.config, values)
        return setup.make_tx(config, run.spec, run.layout.axis_name), values.get('seed', run.config.seed)
      replica_axis = block_program.ReplicaAxis(group.size, build_replica, vectorized)
      self.values = jax.device_put({k: jnp.asarray(v) for k, v in group.values.items()}, run.layout.replicated())
    make = functools.partial(block_program.make_block_step, run, replica_axis, stopwatch=self.stopwatch,
                             busy_loop=self.busy_loop)
    if rounds is None:
      rounds = xla_cpu.rounds_pay_off(platform)
    self.round_length = run.round_length if rounds else None
    self.per_iteration = make()
    self.rounds = None if self.round_length is None else make(round_length=self.round_length)
    self.slots_per_device = group.size * run.layout.local
    self._compiled_slots: dict[tuple, set[int]] = {}  # (program, packing, input shapes) -> slots compiled for

  def whole_rounds(self, steps: np.ndarray) -> bool:
    r = self.round_length
    return r is not None and int(steps[0]) % r == 0 and len(steps) % r == 0

  def program(self, steps: np.ndarray):
    """The jitted program that runs the block of `steps`."""
    return self.rounds if self.whole_rounds(steps) else self.per_iteration

  def reuse_slots(self, program, packed, packing, slots):
    """The gradient slots to run a block that needs `slots` with: a program already compiled for more of them,
    at most twice as many, rather than a new compile (a group's busy slots per device wander between powers of
    two as its replicas' stragglers line up and as replicas freeze). A gathered slot's gradient is the same
    computation whatever the count and the padding is dropped, so the update is the same to the bit. A measured
    run keeps its own count (its times are of the program that ran); with `busy_loop` every count runs one
    program (its trips follow the busy slots), compiled for slots=1."""
    if slots is None:
      return None
    if self.busy_loop:
      return 1
    if self.stopwatch is not None or slots >= self.slots_per_device:
      return slots
    key = (id(program), packing, tuple(x.shape for x in jax.tree.leaves(packed)))
    compiled = self._compiled_slots.setdefault(key, set())
    fits = [s for s in compiled if slots <= s <= 2 * slots]
    slots = min(fits) if fits else slots
    compiled.add(slots)
    return slots

  def __call__(self, state, packed, packing, steps, slots=None):
    program = self.program(steps)
    slots = self.reuse_slots(program, packed, packing, slots)
    if self.stopwatch is None:
      return program(state, packed, self.data, self.values, packing=packing, slots=slots)
    programs = program._cache_size()
    self.stopwatch.start()
    out = program(state, packed, self.data, self.values, packing=packing, slots=slots)
    self.compiled = program._cache_size() > programs
    return out

  def lower(self, state, packed, packing, steps, slots=None):
    return self.program(steps).lower(state, packed, self.data, self.values, packing=packing, slots=slots)
