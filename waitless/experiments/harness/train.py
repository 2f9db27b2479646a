"""The training loop: one algorithm, P workers, a simulated cluster clock, checkpoints that resume exactly.

Each block of iterations: the clock samples the schedules (who finished what, how long it took), the data
streams serve every worker the micro-batches at its own positions, one jitted call runs the block, and the
host logs, evaluates the consensus model and checkpoints at fixed step boundaries. Block lengths depend only on
absolute step numbers, so a resumed run executes the same programs on the same inputs as an uninterrupted one.

Several runs can share the loop and its program (`experiments/harness/replicas.py`): `train_runs` groups runs whose
configs differ only in their seed, budget and scalar hyper-parameters, and `train_group` trains a group as R
replicas of one compiled block step, each with its own clock, data positions, budget and workdir (metrics,
summary, TensorBoard, checkpoints: the files a run alone writes). `train_and_evaluate` is a group of one.

With `stragglers.kind='measured'` nothing is simulated (`experiments/harness/measured_time.py`): the clock is a
`MeasuredClock`, `sim_time` and `time_to_target` hold measured training seconds (every row and the summary say
`"clock": "measured"`), and nonblocking's counts come from the devices' measured speeds.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from typing import Any, Optional, Sequence

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np

from waitless import config_errors as errors
from waitless.algorithms import optimizers
from waitless.algorithms import registry
from waitless.cluster import calibration
from waitless.cluster import clock as clock_lib
from waitless.cluster import factory as cluster_factory
from waitless.cluster import rules as rules_lib
from waitless.data import registry as data_registry
from waitless.experiments.harness import atomic_files
from waitless.experiments.harness import checkpointing
from waitless.experiments.harness import measured_time
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import preemption
from waitless.experiments.harness import replicas as replicas_lib
from waitless.experiments.harness import step as step_lib
from waitless.experiments.harness import transfer
from waitless.experiments.harness import tasks
from waitless.experiments.harness import validation
from waitless.experiments.harness import workers as workers_lib
from waitless.experiments.configs import common as config_common
from waitless.models import registry as model_registry

# Fields that may differ when a run is resumed: they do not change the trajectory.
RESUMABLE_CHANGES = frozenset({'progress_every_s', 'devices', 'eval_batch_size', 'bleu'})


log = logging.getLogger('waitless')

class TrainingDiverged(RuntimeError):
  """The training loss became NaN or infinite; the last good checkpoint is kept."""


class ClusterStalled(RuntimeError):
  """The simulated cluster cannot go on: the algorithm waits for a worker that failed for good."""


class WorkdirConflict(ValueError):
  """The workdir holds a run with another config."""


def to_host(tree):
  """Fetches (possibly multi-host sharded) arrays as numpy on every process."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def measurements_to_host(packed, timed: bool = False) -> dict[str, np.ndarray]:
  """The block step's packed measurements as the host dict of `step.unpack_measurements` (`timed`: a step with
  a `Stopwatch`)."""
  return step_lib.unpack_measurements(to_host(packed), timed)


def _next_boundary(step: int, config) -> int:
  candidates = [config.num_steps]
  for every in (config.log_every, config.eval_every, config.checkpoint_every):
    candidates.append((step // every + 1) * every)
  return min(candidates)


def block_length(step: int, config, round_length: int | None = None) -> int:
  """Iterations in the block starting at `step`: never crosses a log, eval or checkpoint boundary.

  With a round length R the block is whole rounds where it can be (max(1, steps_per_call // R) of them); after
  a boundary that falls inside a round, a shorter block reaches the next round boundary. Lengths depend only on
  absolute step numbers, so a resumed run runs the same blocks.
  """
  limit = _next_boundary(step, config) - step
  if round_length is None:
    return min(config.steps_per_call, limit)
  if step % round_length:
    return min(round_length - step % round_length, limit)
  return min(round_length * max(1, config.steps_per_call // round_length), limit)


def param_count_and_bytes(params) -> tuple[int, int]:
  leaves = jax.tree.leaves(params)
  return sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)


@dataclasses.dataclass
class Run:
  """Everything built from a config before training starts (no compilation yet)."""
  config: ml_collections.ConfigDict
  spec: Any
  layout: workers_lib.WorkerLayout
  dataset: Any
  task: tasks.Task
  model: Any
  tx: Any
  rule: rules_lib.TimeRule

  @property
  def round_length(self) -> int | None:
    """The algorithm's fixed period (whole-round blocks), or None."""
    return self.spec.round_length(self.config)

  @property
  def microbatches(self) -> int:
    """Micro-batches in each worker's batch per iteration (the step masks those not finished)."""
    return self.spec.microbatches_per_iteration(self.config)

  @property
  def measured(self) -> bool:
    """Real time, nothing simulated (`stragglers.kind='measured'`, experiments/harness/measured_time.py)."""
    return measured_time.is_measured(self.config)

  @property
  def finished_only(self) -> bool:
    """The batch can hold more than m micro-batches per worker (K-batch rules: up to K mini-batches, about K / P
    of them finished): each block's batch then holds only as many as its busiest worker finished (rounded up
    to a power of two, so that few programs compile), and the step loops over the finished ones. Measured
    nonblocking too: a slow device must really run fewer micro-batches (a while loop of its own count)."""
    return self.microbatches > self.config.microbatches or measured_time.counts_measured(self.config)


def make_tx(config: ml_collections.ConfigDict, spec, axis_name) -> Any:
  """The algorithm's per-worker transformation around the config's inner optimizer."""
  inner = optimizers.make_optimizer(config.optimizer, config.num_steps)
  return spec.build(config, inner, axis_name)


def build(config: ml_collections.ConfigDict) -> Run:
  """Validates the config and builds the pieces of a run.

  A config with `num_epochs` is resolved here, once: `run.config` is a copy with
  num_steps = ceil(num_epochs x train_size / (workers x batch_size)) (`common.steps_for_epochs`; the global
  batch is workers x per-worker batch) and num_epochs None. Otherwise `run.config` is `config` itself.
  """
  validation.validate(config)
  layout = workers_lib.WorkerLayout.create(config.workers, config.devices)
  dataset = data_registry.make_dataset(config)
  if config.get('num_epochs') is not None:
    epochs = config.num_epochs
    config = config_common.resolve_num_steps(config, dataset.train_size)
    validation.validate(config)  # checks that depend on the number of steps
    log.info('num_epochs=%g: %d steps (%d training examples, global batch %d x %d)', epochs, config.num_steps,
             dataset.train_size, config.workers, config.batch_size)
  spec = registry.get(config.algorithm.name)
  model = model_registry.make_model(config.model, dataset.num_classes)
  return Run(config=config, spec=spec, layout=layout, dataset=dataset, task=tasks.get(dataset.task),
             model=model, tx=make_tx(config, spec, layout.axis_name), rule=spec.time_rule(config))


@dataclasses.dataclass
class Group:
  """R runs trained by one program (`experiments/harness/replicas.py`).

  Attributes:
    runs: one `Run` per replica: its config, its dataset (its seed's data order), its transformation.
    values: the replica fields that differ between the runs (dotted path -> (R,)): the program's inputs. Empty
      for a group of one, which is a plain run: its state has no replica axis and its program is a single run's.
  """
  runs: list[Run]
  values: dict[str, np.ndarray]

  @property
  def lead(self) -> Run:
    return self.runs[0]

  @property
  def size(self) -> int:
    return len(self.runs)

  @property
  def batched(self) -> bool:
    """Whether the state has a replica axis: every leaf (R, P, ...)."""
    return len(self.runs) > 1


def build_group(configs: Sequence[ml_collections.ConfigDict]) -> Group:
  """Validates and builds the runs of `configs`, which must be able to share one program (`replicas.partition`)."""
  runs = [build(config) for config in configs]
  if len(runs) == 1:
    return Group(runs, {})
  keys = {replicas_lib.program_key(run.config) for run in runs}
  if None in keys or len(keys) > 1:
    raise ValueError('these runs cannot share one program: their configs differ beyond the replica fields '
                     '(experiments.harness.replicas.partition groups runs that can)')
  return Group(runs, replicas_lib.varying_values([run.config for run in runs]))


def as_group(run_or_group) -> Group:
  return run_or_group if isinstance(run_or_group, Group) else Group([run_or_group], {})


def rounds_pay_off(layout: workers_lib.WorkerLayout) -> bool:
  """Whether whole-round blocks run the round-structured program on this mesh: on accelerators (GPU, TPU), where
  a collective issued at a static position can run under the compute that follows it; not on XLA:CPU, where
  collectives are rendezvous of the device threads and nothing overlaps. There the unrolled round measured
  10-35% slower per iteration than the per-iteration program (digits MLP, 8 workers: `local_sgd`, `dasgd`,
  `diloco`, `streaming_diloco`), without a collective too (plain SGD unrolled 8 times: 244 us against 132 us per
  iteration). Block lengths are whole rounds either way, so the blocks, logs and checkpoints are the same."""
  return layout.mesh.devices.flat[0].platform != 'cpu'


def vectorize_evaluation(layout: workers_lib.WorkerLayout) -> bool:
  """Whether a group's evaluation vectorises its replicas (`jax.vmap`) or runs them one after another in its
  program (`lax.map`). On XLA:CPU one after another: vectorised, a convolution with per-replica kernels becomes
  a grouped convolution, and MNIST-1D's CNN evaluated 10 replicas on a batch of 512 in 0.185 s against 0.017 s
  one after another. (Its training step, batch 32 per worker, measured the other way round, 1.11 s vectorised
  against 1.29 s per block: training stays vectorised.) On accelerators, vectorised."""
  return layout.mesh.devices.flat[0].platform != 'cpu'


class BlockStep:
  """The jitted block step (`experiments.harness.step.make_block_step`) of a run or a group, with the algorithm's hooks.

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
               loss_hook=None):
    group = as_group(run_or_group)
    run = group.lead
    # A measured run times every device's gradient phase (`step.Stopwatch`); `compiled`: the last call compiled.
    self.stopwatch = step_lib.Stopwatch() if run.measured else None
    self.compiled = False
    replica_axis, self.values = None, None
    streams = run.dataset.train
    self.data = None if streams.resident is None else jax.device_put(
        {k: jnp.asarray(v) for k, v in streams.resident.items()}, run.layout.replicated())  # once, every device
    if group.batched:
      def build_replica(values):
        config = replicas_lib.traced_config(run.config, values)
        return make_tx(config, run.spec, run.layout.axis_name), values.get('seed', run.config.seed)
      replica_axis = step_lib.ReplicaAxis(group.size, build_replica, vectorized)
      self.values = jax.device_put({k: jnp.asarray(v) for k, v in group.values.items()}, run.layout.replicated())
    make = functools.partial(
        step_lib.make_block_step, run.task, run.model, run.tx, run.layout, run.microbatches, run.config.seed,
        schedule_type=run.rule.schedule_type, gradient_params=run.spec.gradient_params,
        finished_only=run.finished_only, gradient_sums=run.spec.gradient_sums, replicas=replica_axis,
        loss_hook=loss_hook, stopwatch=self.stopwatch)
    if rounds is None:
      rounds = rounds_pay_off(run.layout)
    self.round_length = run.round_length if rounds else None
    self.per_iteration = make()
    self.rounds = None if self.round_length is None else make(round_length=self.round_length)

  def whole_rounds(self, steps: np.ndarray) -> bool:
    r = self.round_length
    return r is not None and int(steps[0]) % r == 0 and len(steps) % r == 0

  def program(self, steps: np.ndarray):
    """The jitted program that runs the block of `steps`."""
    return self.rounds if self.whole_rounds(steps) else self.per_iteration

  def __call__(self, state, packed, spec, steps, slots=None):
    program = self.program(steps)
    if self.stopwatch is None:
      return program(state, packed, self.data, self.values, spec=spec, slots=slots)
    programs = program._cache_size()  # pylint: disable=protected-access
    self.stopwatch.start()
    out = program(state, packed, self.data, self.values, spec=spec, slots=slots)
    self.compiled = program._cache_size() > programs  # pylint: disable=protected-access
    return out

  def lower(self, state, packed, spec, steps, slots=None):
    return self.program(steps).lower(state, packed, self.data, self.values, spec=spec, slots=slots)


def make_block_step(run_or_group, rounds: bool | None = None, vectorized: bool = True,
                    loss_hook=None) -> BlockStep:
  """The block step of a run or group; `rounds`: see `BlockStep` (None: the round program on accelerators);
  `vectorized`: a group's replicas vectorised (`jax.vmap`) or one after another (`lax.map`; `step.ReplicaAxis`);
  `loss_hook`: TEST-ONLY, on every micro-batch's loss (`experiments.harness.slowdown`)."""
  return BlockStep(run_or_group, rounds, vectorized, loss_hook)


def make_clock(run: Run, model_bytes: float):
  """A fresh seeded clock driving the run's time rule; for a measured run, its `measured_time.MeasuredClock`."""
  if run.measured:
    return measured_time.MeasuredClock(run.config, run.rule, model_bytes, run.layout.devices)
  return cluster_factory.make_clock(run.config, run.rule, model_bytes)


def init_state(run_or_group) -> step_lib.TrainState:
  """Identical initial parameters on every worker (from the seed), each worker's algorithm state.

  For a group of R > 1 every leaf gets a leading replica axis (R, P, ...), replica r initialised from its own
  seed exactly as that run alone. The model's initialisation is one program for every seed (the key is its
  argument: compiling it costs about 2 s on XLA:CPU, vmapped over 10 seeds 5 s), run once per replica.
  """
  group = as_group(run_or_group)
  run = group.lead
  example = jax.tree.map(lambda x: np.asarray(x)[None], run.dataset.example)
  inputs = run.task.model_inputs(example)
  model_init = _model_init(run.model)
  variables = [model_init(jax.random.key(r.config.seed), inputs) for r in group.runs]

  def place(variables, tx):
    params = variables['params']
    model_state = {k: v for k, v in variables.items() if k != 'params'}
    stack = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (run.config.workers,) + x.shape), tree)
    params, model_state = stack(params), stack(model_state)
    return step_lib.TrainState(params=params, opt_state=jax.vmap(tx.init)(params), model_state=model_state)

  if not group.batched:
    return jax.jit(lambda v: place(v, run.tx), out_shardings=run.layout.sharding())(variables[0])

  def place_replica(variables, values):
    config = replicas_lib.traced_config(run.config, values)
    return place(variables, make_tx(config, run.spec, run.layout.axis_name))

  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *variables)
  return jax.jit(jax.vmap(place_replica), out_shardings=run.layout.sharding(None))(stacked, group.values)


@functools.lru_cache(maxsize=16)
def _model_init(model):
  """The jitted `model.init(key, inputs, train=False)`, one per model (Flax modules compare by their fields), so
  that every run of the process with this model reuses its compiled program: runs differ in their seed."""
  return jax.jit(lambda key, inputs: model.init(key, inputs, train=False))


def state_bytes_of(run: Run) -> int:
  """Bytes of one run's whole training state (every worker), from shapes only (`jax.eval_shape`)."""
  return param_count_and_bytes(jax.eval_shape(lambda: init_state(run)))[1]


def replica_memory_bytes(run: Run, state_bytes: Optional[int] = None) -> tuple[float, float]:
  """(training state, block inputs) bytes of one replica of `run` on one device's memory, from shapes only
  (`jax.eval_shape`: nothing is allocated; `state_bytes`, `state_bytes_of(run)`, when the caller has it). CPU
  devices share the host's memory: there, all of them."""
  state_bytes = state_bytes_of(run) if state_bytes is None else state_bytes
  example = jax.tree.map(np.asarray, run.dataset.example)
  _, example_bytes = param_count_and_bytes(example)
  input_bytes = example_bytes * run.config.batch_size * run.config.workers * run.config.steps_per_call
  share = 1 if run.layout.mesh.devices.flat[0].platform == 'cpu' else run.layout.devices
  return state_bytes / share, input_bytes / share


def check_memory(group: Group, state_bytes: Optional[int] = None) -> None:
  """Raises errors.ConfigError (naming `workers`) when the group's state and inputs cannot fit in the memory
  of a device, from shapes only: before anything is allocated (`state_bytes`: `state_bytes_of(group.lead)`)."""
  run = group.lead
  state_bytes, input_bytes = replica_memory_bytes(run, state_bytes)
  need = group.size * replicas_lib.bytes_per_replica(state_bytes, input_bytes)
  available = replicas_lib.available_memory_bytes(run.layout.mesh.devices.flat[0])
  errors.require(available is None or need <= available, 'workers', run.config.workers,
                 f'this run needs about {need / 1e9:.3g} GB per device for its training state and inputs '
                 f'({group.size} run(s) of {run.config.algorithm.name}: workers, threads, model and batch), more '
                 f'than the {(available or 0) / 1e9:.3g} GB available: make it smaller')


def plan_groups(configs: Sequence[ml_collections.ConfigDict], workdirs: Sequence[str],
                max_replicas: Optional[int] = None) -> list[list[int]]:
  """The runs split into the groups that `train_group` trains as one program each (indices into `configs`).

  `replicas.partition`, with at most `max_replicas` runs per program, or, unset, as many as fit in memory
  (`replicas.replicas_that_fit`, said in one line when a set of runs is split for it). Checked before
  anything compiles.

  Raises:
    config_errors.ConfigError: `max_replicas` is not a positive integer, or more replicas than fit.
  """
  if max_replicas is not None:
    errors.require_int(max_replicas, '--max_replicas', 1)
  counts: dict[Optional[str], int] = {}
  for config in configs:
    key = replicas_lib.program_key(config)
    counts[key] = counts.get(key, 0) + 1
  limits: dict[str, Optional[int]] = {}
  for config in configs:
    key = replicas_lib.program_key(config)
    if key is None or key in limits or (counts[key] == 1 and max_replicas is None):
      continue
    run = build(config)
    state_bytes, input_bytes = replica_memory_bytes(run)
    available = replicas_lib.available_memory_bytes(run.layout.mesh.devices.flat[0])
    fit = replicas_lib.replicas_that_fit(state_bytes, input_bytes, available)
    name = f'{config.algorithm.name} (seed {config.seed})'
    if max_replicas is not None:
      errors.require(fit is None or max_replicas <= fit, '--max_replicas', max_replicas,
                     f'only {fit} replicas of {name} fit in memory ({available / 1e9:.1f} GB available, about '
                     f'{(state_bytes + input_bytes) / 1e6:.1f} MB of state and inputs each): lower it, or leave it '
                     'unset to split the runs into programs that fit')
      limits[key] = max_replicas
    else:
      limits[key] = fit
      if fit is not None and counts[key] > fit:
        log.info('%d runs of %s share a program, but only %d fit in memory (%.1f GB available): %d programs',
                 counts[key], name, fit, available / 1e9, -(-counts[key] // fit))
  return replicas_lib.partition(configs, workdirs, lambda config: limits.get(replicas_lib.program_key(config)))


_replica_of = jax.jit(lambda state, r: jax.tree.map(lambda x: x[r], state))


def replica_state(group: Group, state, r: int):
  """Replica r's state (P, ...), a new array (the group's state itself for a group of one)."""
  if not group.batched:
    return state
  return jax.jit(_replica_of, out_shardings=group.lead.layout.sharding())(state, r)


def stack_replicas(group: Group, states: Sequence[Any]):
  """The group's state from each replica's (P, ...) state."""
  if not group.batched:
    return states[0]
  stack = lambda *trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
  return jax.jit(stack, out_shardings=group.lead.layout.sharding(None))(*states)


def _to_devices(layout, packed: transfer.Packed, leading: int = 1) -> transfer.Packed:
  """`packed` on the devices, one transfer per array: the per-worker pack and the examples sharded on the worker
  dimension (after `leading` others) from this process's workers' rows, the uniform packs replicated."""
  sharding = layout.sharding(*([None] * leading))
  per_worker = (packed.per_worker, packed.batches)
  uniform = (packed.shared, packed.own)
  if jax.process_count() == 1:
    shardings = (jax.tree.map(lambda _: sharding, per_worker), jax.tree.map(lambda _: layout.replicated(), uniform))
    (per_worker, batches), (shared, own) = jax.device_put((per_worker, uniform), shardings)
    return transfer.Packed(per_worker, shared, own, batches)
  shape = lambda v: v.shape[:leading] + (layout.workers,) + v.shape[leading + 1:]
  per_worker, batches = jax.tree.map(lambda v: jax.make_array_from_process_local_data(sharding, v, shape(v)),
                                     per_worker)
  shared, own = jax.tree.map(jnp.asarray, uniform)
  return transfer.Packed(per_worker, shared, own, batches)


def batch_slots(run: Run, blocks) -> int:
  """Micro-batch slots in each worker's batch of these blocks: all of them, or for `run.finished_only` the most
  any worker finished in one iteration rounded up to a power of two (the same on every process). Measured
  nonblocking keeps all m: its counts change with every fit, and a new batch shape is a new program whose first
  execution is slow (it landed in the probe at n = 1 and made the fast device look slow for a block)."""
  if not run.finished_only or measured_time.counts_measured(run.config):
    return run.microbatches
  done = max(int(block.schedule.microbatches_done.max()) for block in blocks)
  return min(run.microbatches, 1 << max(done - 1, 0).bit_length())


def host_inputs(run: Run, block, positions: np.ndarray, slots: int):
  """This process's host arrays for `block`: (the examples of every worker's micro-batches read at its own
  positions, or their indices when the data set lives on the devices; per-worker schedule fields; uniform ones),
  and the data positions after the block."""
  done = block.schedule.microbatches_done.astype(np.int64)
  starts = positions[None] + np.cumsum(done, axis=0) - done
  local_ids = run.layout.local_worker_ids()
  streams = run.dataset.train
  if streams.resident is not None:
    examples = streams.read_indices(local_ids, starts[:, local_ids], slots)
  else:
    examples = streams.read(local_ids, starts[:, local_ids], slots)
  per_worker, same = rules_lib.base.split(block.schedule)
  per_worker = {name: v[:, local_ids] for name, v in per_worker.items()}
  return (examples, per_worker, same), positions + done.sum(axis=0)


def _pack(run: Run, examples, per_worker, shared, own, steps):
  if run.dataset.train.resident is not None:
    return transfer.pack(per_worker, shared, own, steps, indices=examples)
  return transfer.pack(per_worker, shared, own, steps, batches=examples)


def block_inputs(run: Run, block, positions: np.ndarray, step: int):
  """The step's (packed inputs, their spec, steps, slots) for `block`: every worker's micro-batches at its own
  positions (or their indices), the schedule and the steps packed (`experiments.harness.transfer`), the steps on the
  host (`BlockStep` picks the program by them) and the block's gradient slots (`step.gradient_slots`).

  Returns the four arguments after the state, and the data positions after the block.
  """
  (examples, per_worker, same), positions = host_inputs(run, block, positions, batch_slots(run, [block]))
  steps = np.arange(step, step + len(block.duration), dtype=np.int32)
  packed, spec = _pack(run, examples, per_worker, same, {}, steps)
  slots = step_lib.gradient_slots(block.schedule.microbatches_done, run.layout.devices)
  return (_to_devices(run.layout, packed), spec, steps, slots), positions


def stacked_inputs(group: Group, blocks: Sequence[Any], positions: Sequence[np.ndarray], step: int):
  """The step's (packed inputs, spec, steps, slots) for replica r's `blocks[r]` at `positions[r]`, stacked on a
  leading replica axis, and each replica's data positions after its block.

  A replica with no block (`None`: frozen, its budget spent or its run failed) gets a copy of the first
  replica's inputs with no finished micro-batch: it takes no gradient, its update is never read, and the uniform
  fields stay shared. A uniform field that every replica shares goes in once, (n,), so the program's
  conditionals over it stay conditionals; one that differs goes in as (R, n).
  """
  run = group.lead
  live = [b for b in blocks if b is not None]
  slots = batch_slots(run, live)
  made = [None if b is None else host_inputs(group.runs[r], b, positions[r], slots) for r, b in enumerate(blocks)]
  first = next(m for m in made if m is not None)
  host = [first[0] if m is None else m[0] for m in made]
  after = [positions[r] if m is None else m[1] for r, m in enumerate(made)]
  stack = lambda *xs: np.stack(xs)  # pylint: disable=unnecessary-lambda-assignment
  examples = jax.tree.map(stack, *[h[0] for h in host])
  per_worker = jax.tree.map(stack, *[h[1] for h in host])
  frozen = np.array([m is None for m in made])
  per_worker['microbatches_done'] = np.where(frozen[:, None, None], 0, per_worker['microbatches_done'])
  done = np.stack([np.zeros_like(live[0].schedule.microbatches_done) if b is None
                   else b.schedule.microbatches_done for b in blocks])
  shared, own = {}, {}
  for k in host[0][2]:
    if all(np.array_equal(h[2][k], host[0][2][k]) for h in host[1:]):
      shared[k] = host[0][2][k]
    else:
      own[k] = np.stack([h[2][k] for h in host])
  steps = np.arange(step, step + len(live[0].duration), dtype=np.int32)
  packed, spec = _pack(run, examples, per_worker, shared, own, steps)
  return (_to_devices(run.layout, packed, leading=2), spec, steps,
          step_lib.gradient_slots(done, run.layout.devices)), after


def prepare_block(run: Run, clock, positions: np.ndarray, step: int):
  """Samples the schedules of the block starting at `step` and reads every worker's micro-batches for it.

  Returns:
    (the clock's Block, the step's inputs after the state, the data positions after the block).
  """
  block = clock.next_block(block_length(step, run.config, run.round_length))
  inputs, positions = block_inputs(run, block, positions, step)
  return block, inputs, positions


def advance(run: Run, block_step, state, clock, positions: np.ndarray, step: int, n: int):
  """Runs iterations step .. step+n-1: samples their schedules, reads each worker's micro-batches, steps.

  Returns:
    (new state, measurements on the host (`step.unpack_measurements`), the clock's Block, new data positions).
  """
  block = clock.next_block(n)
  inputs, positions = block_inputs(run, block, positions, step)
  state, measured = block_step(state, *inputs)
  return state, measurements_to_host(measured), block, positions


def calibrated_stragglers(run: Run, block_step, state, model_bytes: float, workdir: str):
  """`config.stragglers` rescaled to the measured seconds per micro-batch of this machine's jitted step.

  Measured once per workdir on a copy of the state (the run's trajectory is untouched), broadcast from process
  0 and kept in `calibration.json`, so a resumed run simulates the same clock.
  """
  config = run.config
  path = os.path.join(workdir, 'calibration.json')
  if os.path.exists(path):
    with open(path) as f:
      seconds = json.load(f)['seconds_per_microbatch']
  else:
    scratch_clock = make_clock(run, model_bytes)
    inputs, _ = block_inputs(run, scratch_clock.next_block(config.steps_per_call),
                             np.zeros(config.workers, np.int64), 0)
    seconds = calibration.seconds_per_microbatch(
        block_step, jax.tree.map(jnp.copy, state), *inputs, carry=True,
        microbatches_per_call=calibration.microbatches_per_call(config, config.steps_per_call))
    seconds = float(multihost_utils.broadcast_one_to_all(np.float64(seconds)))
    if jax.process_index() == 0:
      atomic_files.write_json(path, {'seconds_per_microbatch': seconds, 'device': str(jax.devices()[0].device_kind)})
  log.info('calibrated: %.3g s per micro-batch on this machine', seconds)
  return calibration.calibrated(config.stragglers, seconds)


class Evaluator:
  """evaluate(state) -> {'eval_loss', 'eval_accuracy', 'param_norm', and the task's extra metrics} of the
  algorithm's consensus model; for a group of R > 1, a list of R such dicts, one evaluation program for all of
  them (the evaluation split does not depend on the seed).

  In two halves: `consensus(state)` dispatches the consensus model's computation, a new array (the loop may then
  dispatch the next block, which donates `state`: the runtime lets this read finish first), and `measure` of
  that snapshot evaluates it while the next block runs.
  """

  def __init__(self, consensus, measure):
    self.consensus, self.measure = consensus, measure

  def __call__(self, state):
    return self.measure(self.consensus(state))


def make_evaluator(run_or_group) -> Evaluator:
  """The `Evaluator` of a run or group."""
  group = as_group(run_or_group)
  run = group.lead

  def consensus_and_norm(state):
    params = run.spec.consensus(state.params, state.opt_state)
    model_state = jax.tree.map(lambda x: jnp.mean(x, axis=0).astype(x.dtype), state.model_state)
    return params, model_state, step_lib.tree_l2(params)  # the norm here: no op-by-op compiles on the host

  def sums_fn(params, model_state, batch):
    return run.task.eval_sums(run.model, params, model_state, batch)

  if group.batched:
    vectorized = vectorize_evaluation(run.layout)
    one_sums = sums_fn
    consensus_and_norm = step_lib.map_replicas(consensus_and_norm, vectorized)

    def sums_fn(params, model_state, batch):  # every replica on the same batch
      return step_lib.map_replicas(lambda p, m: one_sums(p, m, batch), vectorized)(params, model_state)
  consensus = jax.jit(consensus_and_norm, out_shardings=run.layout.replicated())
  sums = jax.jit(sums_fn, out_shardings=run.layout.replicated())
  place = lambda x: jax.device_put(x, run.layout.replicated())
  devices = run.layout.devices

  def spread(batch):
    """The batch split over the devices (each evaluates its share; the sums are all-reduced), padded with
    masked examples to a multiple of the device count: not every device evaluating all of it."""
    pad = -len(batch['mask']) % devices
    if pad:
      batch = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}
    return jax.device_put(batch, run.layout.sharding())

  def measure(snapshot):
    params, model_state, param_norm = snapshot
    total = {'loss_sum': 0.0, 'correct': 0.0, 'count': 0.0}
    for batch in run.dataset.eval_batches(run.config.eval_batch_size):
      for k, v in to_host(sums(params, model_state, spread(batch))).items():
        total[k] = total[k] + np.asarray(v, np.float64)
    norms = np.asarray(to_host(param_norm), np.float64)
    per_replica = []
    for r in range(group.size):
      pick = (lambda x: x) if not group.batched else (lambda x, r=r: x[r])
      count = max(float(pick(total['count'])), 1.0)
      metrics = {'eval_loss': float(pick(total['loss_sum'])) / count,
                 'eval_accuracy': float(pick(total['correct'])) / count, 'param_norm': float(pick(norms))}
      if run.task.extra_eval is not None:
        metrics.update(run.task.extra_eval(run.model, jax.tree.map(pick, params), run.dataset,
                                           group.runs[r].config, place))
      per_replica.append(metrics)
    return per_replica if group.batched else per_replica[0]

  return Evaluator(consensus, measure)


def check_workdir(workdir: str, config) -> None:
  """Raises WorkdirConflict (one line naming the fields) if `workdir` holds a run of another config, or a
  config.json that does not read back; a workdir without one (new, or killed before it was written) is free."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    return
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise WorkdirConflict(f'workdir {workdir} holds an unreadable config.json ({type(e).__name__}); remove that '
                          'workdir or use a new --workdir') from e
  if not isinstance(saved, dict):
    raise WorkdirConflict(f'workdir {workdir} holds a config.json that is not a config; remove that workdir or '
                          'use a new --workdir')
  current = json.loads(config.to_json_best_effort())
  differ = sorted(k for k in set(saved) | set(current)
                  if k not in RESUMABLE_CHANGES and saved.get(k) != current.get(k))
  if differ:
    raise WorkdirConflict(f'workdir {workdir} holds a run with a different config (fields: {", ".join(differ)}); '
                          'use a new --workdir or the same config to resume')


class _Window:
  """Per-iteration measurements since the last metrics row, each reduced as declared.

  The step's per-iteration measurements, idle fraction and staleness are means over the window's iterations,
  bytes a sum; `l2_params`, measured once per block, is the value after the window's last block ('last'); the
  time rule's own measurements are reduced as its `reports` declare ('mean', 'sum' or 'max').
  """

  def __init__(self, reports: dict[str, str], saved: dict[str, float] | None = None):
    self.reductions = {'train_loss': 'mean', 'l2_grads': 'mean', 'l2_params': 'last', 'idle_fraction': 'mean',
                       'staleness': 'mean', 'bytes_communicated': 'sum', **reports}
    self.sums = dict(saved or {})

  def add(self, block, **measured: np.ndarray) -> None:
    """Adds one block: the step's `measured` values ((n,), or a scalar for 'last') plus what the clock's
    `block` reports."""
    values = dict(measured, idle_fraction=block.idle_fraction, staleness=block.mean_staleness,
                  bytes_communicated=block.bytes_communicated, **block.measurements)
    for key, v in values.items():
      reduction = self.reductions[key]
      if reduction == 'last':
        self.sums[key] = float(v)
      elif reduction == 'max':
        self.sums[key] = max(self.sums.get(key, -np.inf), float(np.max(v)))
      else:
        self.sums[key] = self.sums.get(key, 0.0) + float(np.sum(v))
    self.sums['iterations'] = self.sums.get('iterations', 0.0) + len(block.duration)

  def row(self) -> dict[str, float]:
    n = max(self.sums.pop('iterations', 0.0), 1.0)
    out = {k: v / n if self.reductions[k] == 'mean' else v for k, v in self.sums.items()}
    self.sums = {}
    return out


@dataclasses.dataclass
class _Replica:
  """The host side of one replica of a group: its run's clock, data positions, metrics, checkpoints, outcome."""
  run: Run
  workdir: str
  clock: Any
  checkpointer: checkpointing.Checkpointer
  positions: np.ndarray
  window: _Window
  writer: Any = None
  wall_offset: float = 0.0
  time_to_target: Optional[float] = None
  last_eval: dict = dataclasses.field(default_factory=dict)
  last_train_loss: float = float('nan')
  sim_time: float = 0.0
  summary: Optional[dict] = None       # set when the run finished
  failure: Optional[Exception] = None  # TrainingDiverged or ClusterStalled: the run stopped there

  @property
  def config(self):
    return self.run.config

  @property
  def done(self) -> bool:
    return self.summary is not None or self.failure is not None


def _restore(group: Group, replicas: list[_Replica], state):
  """Restores every replica from the newest checkpoint step they all have (a kill between the replicas' saves
  leaves some a checkpoint ahead: they go back one); the group's state and that step, or (state, 0) if none.

  A checkpoint that does not read back is moved aside (`checkpointing.quarantine_step`) and the choice made again.
  """
  like = replica_state(group, state, 0) if group.batched else state
  while True:
    steps = [set(r.checkpointer.all_steps()) for r in replicas]
    if not any(steps):
      return state, 0
    common = set.intersection(*steps)
    if not common:
      raise ValueError('the runs of this group have no checkpoint step in common (latest: '
                       + ', '.join(f'{r.workdir}: {max(s) if s else None}' for r, s in zip(replicas, steps))
                       + '): train them in separate groups (experiments.harness.replicas.partition does)')
    step = max(common)
    restored = [r.checkpointer.restore_step(step, like, checkpointing.quarantine_step(r.workdir)) for r in replicas]
    if all(x is not None for x in restored):
      break
  for r, (_, meta) in zip(replicas, restored):
    r.wall_offset = float(meta['wall_time'])
    r.positions = np.asarray(meta['positions'], np.int64)
    r.clock.load_state_dict(meta['clock'])
    r.time_to_target, r.last_eval = meta['time_to_target'], meta['last_eval']
    r.window = _Window(_reports(r.run), meta['window'])
    r.last_train_loss = float(meta['train_loss'])
    r.sim_time = r.clock.sim_time
    log.info('Resumed from the checkpoint at step %d in %s', step, r.workdir)
  return stack_replicas(group, [s for s, _ in restored]), step


def _reports(run: Run) -> dict[str, str]:
  """The window's reductions beyond the step's: the rule's reports, and a measured run's counts and times."""
  return {**run.rule.reports, **(measured_time.reports(run.config) if run.measured else {})}


def _summary(r: _Replica, step: int, wall: float, num_params: int, group_size: int) -> dict[str, Any]:
  last_eval = r.last_eval
  measured = r.clock.summary() if r.run.measured else {}
  return {**measured,
      'steps': step, 'sim_time': r.sim_time, 'wall_time': wall,
      'final_train_loss': r.last_train_loss, 'final_eval_loss': last_eval.get('eval_loss'),
      'final_eval_accuracy': last_eval.get('eval_accuracy'), 'param_norm': last_eval.get('param_norm'),
      'time_to_target': r.time_to_target, 'num_params': num_params, 'replicas': group_size,
      **{f'final_{k}': v for k, v in last_eval.items() if k not in ('eval_loss', 'eval_accuracy', 'param_norm')},
  }


@dataclasses.dataclass
class _Prepared:
  """A block ready to dispatch: each replica's clock Block (None: frozen) and the step's inputs."""
  step: int
  blocks: list
  inputs: tuple
  stalled: dict  # replica index -> StalledError raised while sampling this block: it stops before it
  seconds: float = 0.0  # host seconds spent preparing it (a measured run's clock counts them)


def train_group(configs: Sequence[ml_collections.ConfigDict], workdirs: Sequence[str],
                stop_requests: preemption.StopRequests | None = None, loss_hook=None) -> list[Any]:
  """Trains the runs of `configs` in `workdirs` as the replicas of one program, resuming from their checkpoints.

  The configs must be able to share a program (`replicas.partition`): the same workload, algorithm and cadence,
  differing only in seed, budget (`num_steps`) and scalar hyper-parameters. Each replica writes in its workdir
  what a run alone writes (metrics.jsonl, summary.json, config.json, TensorBoard events, orbax checkpoints of its
  own state, at the same steps as the others); its trajectory is the one it has alone (float64: to rounding;
  float32: XLA may round the batched program differently). A replica that has spent its budget, or that
  diverged or stalled, is frozen (it computes what is never read) while the others go on.

  `loss_hook`: TEST-ONLY, applied to every micro-batch's loss (`experiments.harness.slowdown.loss_hook`).

  Returns:
    Per run, its summary dict, or the TrainingDiverged / ClusterStalled it stopped with.

  Raises:
    preemption.Preempted: SIGTERM or SIGINT (or `stop_requests.request()`) arrived; every unfinished replica
      finished its block and checkpointed, and the same call resumes them.
  """
  group = build_group(configs)
  lead = jax.process_index() == 0
  state_bytes = state_bytes_of(group.lead)  # shapes only (one trace of the init): nothing allocated yet
  for config, workdir in zip(configs, workdirs):
    check_workdir(workdir, config)  # on every process, so that a conflict stops all of them
    checkpointing.check_writable(workdir, checkpoint_bytes=state_bytes / jax.process_count())
  check_memory(group, state_bytes)
  if lead:
    for config, workdir in zip(configs, workdirs):
      os.makedirs(workdir, exist_ok=True)
      # Atomic: other processes may be reading it in check_workdir.
      atomic_files.write_text(os.path.join(workdir, 'config.json'), config.to_json_best_effort(indent=2))
  run = group.lead  # num_steps resolved (config.json keeps the duration as given)

  state = init_state(group)
  num_params, model_bytes = param_count_and_bytes(state.params)
  num_params, model_bytes = (num_params // (run.config.workers * group.size),
                             model_bytes // (run.config.workers * group.size))
  block_step = make_block_step(group, loss_hook=loss_hook)
  if run.config.stragglers.calibrate:  # a calibrated run never shares its program (replicas.program_key)
    run.config.stragglers = calibrated_stragglers(run, block_step, state, model_bytes, workdirs[0])
  replicas = []
  for r, workdir in zip(group.runs, workdirs):
    replicas.append(_Replica(
        run=r, workdir=workdir, clock=make_clock(r, model_bytes),
        checkpointer=checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints')),
        positions=np.zeros(r.config.workers, np.int64), window=_Window(_reports(r))))
  try:
    state, step = _restore(group, replicas, state)
    for r in replicas:
      r.writer = metrics_io.MetricsWriter(r.workdir, keep_through_step=step or None, enabled=lead)
    _train_loop(group, replicas, block_step, state, step, num_params, stop_requests)
  finally:
    for r in replicas:
      r.checkpointer.close()
      if r.writer is not None:
        r.writer.close()
  return [r.summary if r.failure is None else r.failure for r in replicas]


def _train_loop(group: Group, replicas: list[_Replica], block_step, state, step: int, num_params: int,
                stop_requests: preemption.StopRequests | None) -> None:
  """The block loop of `train_group`, from `step`: fills each replica's metrics, checkpoints and outcome."""
  run = group.lead
  lead = jax.process_index() == 0
  num_steps = max(r.config.num_steps for r in replicas)
  names = ', '.join(os.path.basename(os.path.normpath(r.workdir)) for r in replicas)
  log.info('%s: %d workers on %d %s device(s), %d parameters per worker, %d steps%s',
           run.config.algorithm.name, run.config.workers, run.layout.devices, jax.devices()[0].platform,
           num_params, num_steps, f'; {group.size} runs in one program ({names})' if group.batched else '')
  evaluate = make_evaluator(group)
  log.info('compiling the block step (or loading it from the compilation cache); the first block waits for it')
  start_wall, start_step, last_progress = time.time(), step, time.time()
  wall = lambda r: r.wall_offset + time.time() - start_wall  # pylint: disable=unnecessary-lambda-assignment

  def finish(r: _Replica, at: int) -> None:
    r.summary = _summary(r, at, wall(r), num_params, group.size)
    if lead:
      atomic_files.write_json(os.path.join(r.workdir, 'summary.json'), r.summary, indent=2)

  def running(at: int) -> list[int]:
    return [i for i, r in enumerate(replicas) if not r.done and r.config.num_steps > at]

  def prepare(at: int) -> Optional[_Prepared]:
    """Samples every running replica's next block and reads its data, moving its clock and data positions past
    the block (never across a checkpoint: see `lookahead`); None when no replica goes on."""
    live = running(at)
    if not live:
      return None
    begin = time.perf_counter()
    n = min(block_length(at, replicas[i].config, run.round_length) for i in live)
    blocks, stalled = [None] * len(replicas), {}
    for i in live:
      try:
        blocks[i] = replicas[i].clock.next_block(n)
      except clock_lib.StalledError as e:
        stalled[i] = e
    if all(b is None for b in blocks):
      return _Prepared(at, blocks, (), stalled)
    if group.batched:
      inputs, after = stacked_inputs(group, blocks, [r.positions for r in replicas], at)
    else:
      inputs, position = block_inputs(run, blocks[0], replicas[0].positions, at)
      after = [position]
    for r, position in zip(replicas, after):
      r.positions = position
    return _Prepared(at, blocks, inputs, stalled, time.perf_counter() - begin)

  def stall(i: int, error: Exception, at: int, first: bool) -> None:
    r = replicas[i]
    where = f'Stopped at step {at}.' if first else f'Stopped after step {at}; its metrics are in {r.workdir}.'
    r.failure = ClusterStalled(f'{error} {where}')
    log.info('%s: %s', r.workdir, r.failure)

  for r in replicas:  # a run resumed at its end (killed before its summary was written)
    if r.config.num_steps <= step:
      finish(r, step)

  # Keep the device busy: while it runs a block, the host samples the next block's schedules and reads its
  # data, and dispatches it before this one's results are read (an evaluation first takes its consensus model
  # of this block's state, which the next block donates). Not across a checkpoint (the saved clocks and data
  # positions must be those after the saved step), and not at all for a rule that adapts to this block's loss
  # (AdaSync): the schedules, and so the trajectory, stay exactly the same.
  # A measured run never looks ahead: its next block's counts need this block's times, and its clock times one
  # block at a time (`measured_time`).
  lookahead = not run.rule.uses_feedback and not run.measured
  stop_requests = preemption.StopRequests() if stop_requests is None else stop_requests
  try:
    stop_requests.install()
    current = prepare(step)
    measured = None
    while current is not None:
      for i, e in current.stalled.items():
        stall(i, e, step, first=True)
      if all(b is None for b in current.blocks):
        break
      if measured is None:
        state, measured = block_step(state, *current.inputs)
      live = [i for i, b in enumerate(current.blocks) if b is not None]
      n = len(current.blocks[live[0]].duration)
      end = step + n
      is_eval = {i: end % replicas[i].config.eval_every == 0 or end == replicas[i].config.num_steps for i in live}
      stop = stop_requests.agreed(step)  # then this block is the last: checkpoint after it, no lookahead
      is_checkpoint = {i: end % replicas[i].config.checkpoint_every == 0 or end == replicas[i].config.num_steps
                       or stop for i in live}
      following = next_measured = None
      # The evaluation's consensus model is taken before the next block is dispatched (it donates `state`).
      # A measured run takes it after its block's results (`measured_time`): compiling it on this thread while
      # the block runs would hold the Python lock that the block's clock reads wait for.
      snapshot = evaluate.consensus(state) if any(is_eval.values()) and not run.measured else None
      if lookahead and not any(is_checkpoint.values()):
        following = prepare(end)
        if following is not None and any(b is not None for b in following.blocks):
          state, next_measured = block_step(state, *following.inputs)

      if run.measured:  # wait with the Python lock released: the program's clock reads need it
        jax.block_until_ready(measured)
        ready = time.perf_counter()  # before the all-gather below, which compiles once per block length
      host = measurements_to_host(measured, timed=run.measured)
      if run.measured:  # group of one (a measured run never shares its program)
        seconds = measured_time.block_seconds(current.seconds, block_step.stopwatch.origin, ready,
                                              block_step.compiled, host['started_s'][0, run.layout.local_worker_ids()])
        current.blocks[0] = replicas[0].clock.record(current.blocks[0], host['compute_s'], seconds)
        if any(is_eval.values()):
          snapshot = evaluate.consensus(state)
      evaluated = None
      for i in live:
        r = replicas[i]
        if r.failure is not None:  # diverged in the previous block, whose successor was already dispatched
          continue
        mine = host if not group.batched else {k: v[i] for k, v in host.items()}
        block = current.blocks[i]
        contributed = block.schedule.microbatches_done > 0
        losses = np.where(contributed, mine['loss'], 0.0).sum(1) / np.maximum(contributed.sum(1), 1)
        if not np.all(np.isfinite(losses)):
          bad = step + int(np.argmin(np.isfinite(losses)))
          kept = r.checkpointer.latest_step()
          r.failure = TrainingDiverged(
              f'training loss is {losses[bad - step]} at step {bad + 1}; stopped, ' +
              (f'the last good checkpoint (step {kept}) is kept in {r.workdir}' if kept is not None else
               f'before its first checkpoint; its metrics are in {r.workdir}'))
          log.info('%s', r.failure)
          continue
        r.window.add(block, train_loss=losses, l2_grads=mine['l2_grads'].mean(1), l2_params=mine['l2_params'].mean())
        r.clock.feedback(train_loss=float(losses.mean()))  # AdaSync adapts K from it; other rules ignore it
        r.sim_time, r.last_train_loss = float(block.sim_time[-1]), float(losses[-1])
        if is_eval[i] or end % r.config.log_every == 0:
          row = {'step': end, 'sim_time': r.sim_time, 'wall_time': wall(r), **r.window.row()}
          if r.run.measured:
            row = measured_time.finish_row(row, r.config.workers)
          if is_eval[i]:
            if evaluated is None:
              evaluated = evaluate.measure(snapshot)
            r.last_eval = evaluated[i] if group.batched else evaluated
            row.update({k: v for k, v in r.last_eval.items() if k != 'param_norm'})
            if r.time_to_target is None and r.last_eval['eval_accuracy'] >= r.config.target_accuracy:
              r.time_to_target = row['sim_time']
          r.writer.write(row)
        if is_checkpoint[i]:
          meta = {'step': end, 'wall_time': wall(r), 'positions': r.positions.tolist(),
                  'clock': r.clock.state_dict(), 'time_to_target': r.time_to_target, 'window': r.window.sums,
                  'last_eval': r.last_eval, 'train_loss': r.last_train_loss}
          r.checkpointer.save(end, replica_state(group, state, i), meta, copy=not group.batched)
          if r.run.measured:  # not under the next timed block: it is left out of the clock, and must not slow it
            r.checkpointer.wait()
        if end == r.config.num_steps:
          finish(r, end)
      step = end
      if time.time() - last_progress >= run.config.progress_every_s or not running(step):
        last_progress = time.time()
        rate = (step - start_step) / max(time.time() - start_wall, 1e-9)
        losses = [replicas[i].last_train_loss for i in live if not replicas[i].failure]
        log.info('step %d/%d  loss %.4f  %s %.2fs  %.1f steps/s  ETA %.0fs', step, num_steps,
                 float(np.mean(losses)) if losses else float('nan'), 'measured' if run.measured else 'sim',
                 max(replicas[i].sim_time for i in live), rate, (num_steps - step) / max(rate, 1e-9))
      if stop and running(step):
        raise preemption.Preempted(step, ', '.join(replicas[i].workdir for i in running(step)),
                                   stop_requests.signal_name)
      if following is None:
        current = prepare(step) if running(step) else None
        measured = None
      else:
        for i, e in following.stalled.items():  # found while this block ran: it stops after this block
          stall(i, e, step, first=False)
        following.stalled = {}
        current, measured = following, next_measured
  finally:
    stop_requests.uninstall()


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_requests: preemption.StopRequests | None = None, loss_hook=None) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns the summary.

  Writes metrics.jsonl, summary.json, config.json, TensorBoard events and orbax checkpoints in `workdir`.

  Raises:
    TrainingDiverged, ClusterStalled: the run stopped there (its metrics up to then and its last good
      checkpoint are kept).
    preemption.Preempted: SIGTERM or SIGINT (or `stop_requests.request()`) arrived; the run finished its
      block and checkpointed, and the same call resumes it.
  """
  outcome, = train_group([config], [workdir], stop_requests, loss_hook)
  if isinstance(outcome, Exception):
    raise outcome
  return outcome
