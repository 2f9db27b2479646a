"""The jitted block step of a run or a group (`BlockStep`), and its measurements brought to the host."""

from __future__ import annotations

import functools

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from waitless.experiments.harness import compilation_cache
from waitless.experiments.harness import replicas as replicas_lib
from waitless.experiments.harness import setup
from waitless.experiments.harness import step as step_lib
from waitless.experiments.harness import transfer
from waitless.experiments.harness import workers as workers_lib


def to_host(tree):
  """Fetches (possibly multi-host sharded) arrays as numpy on every process."""
  if jax.process_count() == 1:
    return jax.tree.map(transfer.fetch, tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def measurements_to_host(packed, timed: bool = False) -> dict[str, np.ndarray]:
  """The block step's packed measurements as the host dict of `step.unpack_measurements` (`timed`: a step with
  a `Stopwatch`)."""
  return step_lib.unpack_measurements(to_host(packed), timed)


@functools.lru_cache(maxsize=64)
def _join_rows(platform: str):
  """A jitted concatenation of packed measurements along their rows (they keep their sharding over the workers):
  a copy, exact at any optimisation level, so compiled quickly (once per span's pattern of block lengths)."""
  options = compilation_cache.quick_compile_options(platform)
  return jax.jit(lambda *packed: jnp.concatenate(packed, axis=-2), compiler_options=options)


def join_measurements(measured: list, platform: str):
  """The packed measurements of several blocks as one array on the devices, their rows one block after another
  (`measurements_to_host_each` splits them again). Dispatched like any program: before the next block, it runs
  right after the last of these, so that fetching it does not wait for the next block."""
  return measured[0] if len(measured) == 1 else _join_rows(platform)(*measured)


def measurements_to_host_each(joined, rows: list[int], timed: bool = False) -> list[dict[str, np.ndarray]]:
  """Each block's host measurements (as `measurements_to_host`) from their `join_measurements`, whose blocks had
  `rows` rows each: ONE fetch for them all. On XLA:CPU a fetch is a copy from every device's thread, and one per
  block of the digits MLP cost its loop about 1.5% (benchmarks/harness_overhead.py)."""
  host = to_host(joined)
  bounds = np.cumsum([0] + list(rows))
  return [step_lib.unpack_measurements(host[..., a:b, :], timed) for a, b in zip(bounds[:-1], bounds[1:])]


def rounds_pay_off(layout: workers_lib.WorkerLayout) -> bool:
  """Whether whole-round blocks run the round-structured program on this mesh: on accelerators (GPU, TPU), where
  a collective issued at a static position can run under the compute that follows it; not on XLA:CPU, where
  collectives are rendezvous of the device threads and nothing overlaps, and the unrolled round runs slower per
  iteration than the per-iteration program (`benchmarks/` measures it). Block lengths are whole rounds either way,
  so the blocks, logs and checkpoints are the same."""
  return layout.platform != 'cpu'


def busy_loop_pays_off(layout: workers_lib.WorkerLayout) -> bool:
  """Whether a device computes its busy gradient slots in a loop of exactly as many trips (`step.make_block_step`'s
  `busy_loop`): on XLA:CPU, where a vmapped gradient of k slots costs k single ones (MNIST-1D's CNN: 63-69 us per
  slot for 1 to 16 slots), so the vmap's padding to the block's most busy slots was computed for nothing; not on
  accelerators, where the slots of one vmap run side by side."""
  return layout.platform == 'cpu'


def flat_norms_pay_off(layout: workers_lib.WorkerLayout) -> bool:
  """Whether the step measures its norms over the leaves concatenated (`step.tree_l2`'s `flat`): on XLA:CPU, where
  each operation of the block's loop is dispatched on every device's thread, and a norm of one operation per leaf
  cost the digits MLP's loop about 1% (`step.tree_l2`); not on accelerators, where the per-leaf sums
  are cheap and a concatenated copy of a large model's gradient is memory."""
  return layout.platform == 'cpu'


class BlockStep:
  """The jitted block step (`step.make_block_step`) of a run or a group, with the algorithm's hooks.

  `(state, packed, spec, steps, slots) -> (state, measurements)`: the block's inputs packed
  (`experiments.harness.transfer`) with their static spec, `steps` a host int32 array and `slots` the block's static
  number of gradient slots (`step.gradient_slots`; None: every worker computes). A data set held in memory
  lives on the devices (placed once, here), and the step reads its micro-batches there by index. A block of whole
  rounds of the algorithm's `round_length` runs the round-structured program where `rounds` is true (default:
  `rounds_pay_off`, i.e. on accelerators), any other block the per-iteration one. The two programs compute the
  same update (the tests check it in float64); in float32 they round differently. Each program compiles once
  per block length (and, for `run.finished_only`, once per power-of-two batch size). For a group of R > 1 the
  programs carry a replica axis and take the group's differing values as inputs (`step.ReplicaAxis`).
  """

  def __init__(self, run_or_group, rounds: bool | None = None, vectorized: bool = True,
               loss_hook=None, busy_loop: bool | None = None, flat_norms: bool | None = None):
    """`rounds`: whole-round blocks run the round-structured program (None: `rounds_pay_off`, on accelerators);
    `busy_loop`: busy gradient slots computed in a loop (None: `busy_loop_pays_off`, on CPU);
    `flat_norms`: the measured norms over the leaves concatenated (None: `flat_norms_pay_off`, on CPU);
    `vectorized`: a group's replicas vectorised (`jax.vmap`) or one after another (`lax.map`; `step.ReplicaAxis`);
    `loss_hook`: TEST-ONLY, on every micro-batch's loss (`experiments.harness.slowdown`)."""
    group = setup.as_group(run_or_group)
    run = group.lead
    # A measured run times every device's gradient phase (`step.Stopwatch`); `compiled`: the last call compiled.
    self.stopwatch = step_lib.Stopwatch() if run.measured else None
    self.busy_loop = busy_loop_pays_off(run.layout) if busy_loop is None else busy_loop
    self.compiled = False
    replica_axis, self.values = None, None
    streams = run.dataset.train
    self.data = None if streams.resident is None else jax.device_put(
        {k: jnp.asarray(v) for k, v in streams.resident.items()}, run.layout.replicated())  # once, every device
    if group.batched:
      def build_replica(values):
        config = replicas_lib.traced_config(run.config, values)
        return setup.make_tx(config, run.spec, run.layout.axis_name), values.get('seed', run.config.seed)
      replica_axis = step_lib.ReplicaAxis(group.size, build_replica, vectorized)
      self.values = jax.device_put({k: jnp.asarray(v) for k, v in group.values.items()}, run.layout.replicated())
    make = functools.partial(
        step_lib.make_block_step, run.task, run.model, run.tx, run.layout, run.microbatches, run.config.seed,
        schedule_type=run.rule.schedule_type, gradient_params=run.spec.gradient_params,
        finished_only=run.finished_only, gradient_sums=run.spec.gradient_sums, replicas=replica_axis,
        loss_hook=loss_hook, stopwatch=self.stopwatch, busy_loop=self.busy_loop,
        flat_norms=flat_norms_pay_off(run.layout) if flat_norms is None else flat_norms)
    if rounds is None:
      rounds = rounds_pay_off(run.layout)
    self.round_length = run.round_length if rounds else None
    self.per_iteration = make()
    self.rounds = None if self.round_length is None else make(round_length=self.round_length)
    self.slots_per_device = group.size * run.layout.local
    self._compiled_slots: dict[tuple, set[int]] = {}  # (program, spec, input shapes) -> the slots it compiled for

  def whole_rounds(self, steps: np.ndarray) -> bool:
    r = self.round_length
    return r is not None and int(steps[0]) % r == 0 and len(steps) % r == 0

  def program(self, steps: np.ndarray):
    """The jitted program that runs the block of `steps`."""
    return self.rounds if self.whole_rounds(steps) else self.per_iteration

  def reuse_slots(self, program, packed, spec, slots):
    """The gradient slots to run a block that needs `slots` with: a program already compiled for more of them,
    at most twice as many, rather than a new compile (a group's busy slots per device wander between powers of
    two as its replicas' stragglers line up and as replicas freeze; each new count was a compile of seconds).
    Only among the programs that gather their busy slots (fewer than every slot of the device): a gathered
    slot's gradient is the same computation whatever the count, and the padding is dropped, so the update is
    the same to the bit. A measured run keeps its own count (its times are of the program that ran). With
    `busy_loop` every count runs one program (the loop's trips follow the busy slots), compiled for slots=1."""
    if slots is None:
      return None
    if self.busy_loop:  # one program whatever the count: it loops over the busy slots
      return 1
    if self.stopwatch is not None or slots >= self.slots_per_device:
      return slots
    key = (id(program), spec, tuple(x.shape for x in jax.tree.leaves(packed)))
    compiled = self._compiled_slots.setdefault(key, set())
    fits = [s for s in compiled if slots <= s <= 2 * slots]
    slots = min(fits) if fits else slots
    compiled.add(slots)
    return slots

  def __call__(self, state, packed, spec, steps, slots=None):
    program = self.program(steps)
    slots = self.reuse_slots(program, packed, spec, slots)
    if self.stopwatch is None:
      return program(state, packed, self.data, self.values, spec=spec, slots=slots)
    programs = program._cache_size()
    self.stopwatch.start()
    out = program(state, packed, self.data, self.values, spec=spec, slots=slots)
    self.compiled = program._cache_size() > programs
    return out

  def lower(self, state, packed, spec, steps, slots=None):
    return self.program(steps).lower(state, packed, self.data, self.values, spec=spec, slots=slots)


