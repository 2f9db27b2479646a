"""A run's set-up, before anything compiles: the config validated and built into a `Run`, runs that share one
program as a `Group`, the initial state, the clock, and the memory checks that split runs into groups that fit."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from waitless import config_errors as errors
from waitless.algorithms import optimizers
from waitless.cluster import registry
from waitless.cluster import factory as cluster_factory
from waitless.cluster.rules import base as rules_base
from waitless.data import registry as data_registry
from waitless.experiments.harness import compilation_cache
from waitless.experiments.harness import duration
from waitless.experiments.harness import measured_time
from waitless.experiments.harness import replicas as replicas_lib
from waitless.experiments.harness import step as step_lib
from waitless.experiments.harness import tasks
from waitless.experiments.harness import validation
from waitless.experiments.harness import workers as workers_lib
from waitless.models import registry as model_registry

log = logging.getLogger('waitless')
PROGRESS_EVERY_S = 10.0  # a line at most this often while a long step runs


def param_count_and_bytes(params) -> tuple[int, int]:
  leaves = jax.tree.leaves(params)
  return sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)


@dataclasses.dataclass
class Run:
  """Everything built from a config before training starts (no compilation yet)."""
  config: ml_collections.ConfigDict
  cost: cluster_factory.Effective  # what the clock charges (`validation.validate`'s, the profile read once)
  spec: Any
  layout: workers_lib.WorkerLayout
  dataset: Any
  task: tasks.Task
  model: Any
  tx: Any
  rule: rules_base.TimeRule

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
  """Validates the config (`validation.validate`, here and only here on a run's path) and builds a run's pieces.

  A config with `num_epochs` is resolved here, once: `run.config` is a copy with
  num_steps = ceil(num_epochs x train_size / (workers x batch_size)) (`duration.steps_for_epochs`; the global
  batch is workers x per-worker batch) and num_epochs None, on which the checks that read `num_steps` run
  (`validation.validate_counts`). Otherwise `run.config` is `config` itself.
  """
  cost = validation.validate(config)
  layout = workers_lib.WorkerLayout.create(config.workers, config.devices)
  dataset = data_registry.make_dataset(config)
  if config.get('num_epochs') is not None:
    epochs = config.num_epochs
    config = duration.resolve_num_steps(config, dataset.train_size)
    validation.validate_counts(config)
    log.info('num_epochs=%g: %d steps (%d training examples, global batch %d x %d)', epochs, config.num_steps,
             dataset.train_size, config.workers, config.batch_size)
  spec = registry.get(config.algorithm.name)
  model = model_registry.make_model(config.model, dataset.num_classes)
  return Run(config=config, cost=cost, spec=spec, layout=layout, dataset=dataset, task=tasks.get(dataset.task),
             model=model, tx=make_tx(config, spec, layout.axis_name), rule=registry.time_rule(config))


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


def build_group(configs: Sequence[ml_collections.ConfigDict], built: Optional[Sequence[Optional[Run]]] = None) -> Group:
  """Validates and builds the runs of `configs`, which must be able to share one program (`replicas.partition`).

  `built`: per config, its run built already (`plan_groups`' `PlannedGroup.built`), or None to build it here.
  """
  built = built or [None] * len(configs)
  runs, last_line = [], time.monotonic()
  for config, run in zip(configs, built, strict=True):
    runs.append(build(config) if run is None else run)
    if time.monotonic() - last_line > PROGRESS_EVERY_S:  # thousands of replicas: seconds to minutes
      log.info('built %d of %d runs of one program (data, model, transformation)', len(runs), len(configs))
      last_line = time.monotonic()
  if len(runs) == 1:
    return Group(runs, {})
  keys = {replicas_lib.program_key(run.config) for run in runs}
  if None in keys or len(keys) > 1:
    raise ValueError('these runs cannot share one program: their configs differ beyond the replica fields '
                     '(experiments.harness.replicas.partition groups runs that can)')
  return Group(runs, replicas_lib.varying_values([run.config for run in runs]))


def as_group(run_or_group) -> Group:
  return run_or_group if isinstance(run_or_group, Group) else Group([run_or_group], {})


def clock_for(run: Run, model_bytes: float):
  """The run's clock: a fresh seeded simulated clock driving its time rule and charging its cost model
  (`cluster.factory.make_clock`), or for a measured run its `measured_time.MeasuredClock`."""
  if run.measured:
    return measured_time.MeasuredClock(run.config, run.rule, model_bytes, run.layout.devices)
  return cluster_factory.make_clock(run.config, run.rule, model_bytes, run.cost)


def set_stragglers(run: Run, stragglers: ml_collections.ConfigDict) -> None:
  """Replaces the run's compute-time model (`config.stragglers`: a calibrated run's, measured on this machine) and
  the cost model its clock charges with it. A calibrated run names no cluster profile: nothing is read."""
  run.config.stragglers = stragglers
  run.cost = cluster_factory.effective(run.config)


def init_state(run_or_group) -> step_lib.TrainState:
  """Identical initial parameters on every worker (from the seed), each worker's algorithm state.

  For a group of R > 1 every leaf gets a leading replica axis (R, P, ...), replica r initialised from its own
  seed exactly as that run alone. The model's initialisation is one program for every seed (the seed is its
  argument), run once per replica.
  """
  return _init_state(run_or_group, _model_init)


def init_model(run: Run) -> tuple[Any, Any]:
  """One copy of the initial (params, model state) from the seed: the row `init_state` gives every worker (a
  parameter server's one model, a learner's first view), without the P copies."""
  example = jax.tree.map(lambda x: np.asarray(x)[None], run.dataset.example)
  variables = _model_init(run.model, run.layout.platform)(run.config.seed, run.task.model_inputs(example))
  return variables['params'], {k: v for k, v in variables.items() if k != 'params'}


def _init_state(run_or_group, model_init_for) -> step_lib.TrainState:
  """`init_state`, the model initialised by `model_init_for(model, platform)(seed, inputs)`."""
  group = as_group(run_or_group)
  run = group.lead
  example = jax.tree.map(lambda x: np.asarray(x)[None], run.dataset.example)
  inputs = run.task.model_inputs(example)
  model_init = model_init_for(run.model, run.layout.platform)
  variables = [model_init(r.config.seed, inputs) for r in group.runs]

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


def _traced_model_init(model, platform: str):
  """`model.init(key(seed), inputs, train=False)` for a trace (`state_bytes_of`'s `jax.eval_shape`): a nested jit
  takes no compiler options."""
  del platform
  return lambda seed, inputs: model.init(jax.random.key(seed), inputs, train=False)


@functools.lru_cache(maxsize=16)
def _model_init(model, platform: str):
  """`_traced_model_init` jitted, one per model (Flax modules compare by their fields), so that every run of the
  process with this model reuses its compiled program: runs differ in their seed. The key is made inside the
  program (made outside, it was two more programs to compile), and on CPU it compiles at -O1
  (`compilation_cache.quick_compile_options`)."""
  options = compilation_cache.quick_compile_options(platform)
  return jax.jit(_traced_model_init(model, platform), compiler_options=options)


def state_bytes_of(run: Run) -> int:
  """Bytes of one run's whole training state (every worker), from shapes only (`jax.eval_shape`)."""
  return param_count_and_bytes(jax.eval_shape(lambda: _init_state(run, _traced_model_init)))[1]


def replica_memory_bytes(run: Run, state_bytes: Optional[int] = None) -> tuple[float, float]:
  """(training state, block inputs) bytes of one replica of `run` on one device's memory, from shapes only
  (`jax.eval_shape`: nothing is allocated; `state_bytes`, `state_bytes_of(run)`, when the caller has it). CPU
  devices share the host's memory: there, all of them."""
  state_bytes = state_bytes_of(run) if state_bytes is None else state_bytes
  example = jax.tree.map(np.asarray, run.dataset.example)
  _, example_bytes = param_count_and_bytes(example)
  input_bytes = example_bytes * run.config.batch_size * run.config.workers * run.config.steps_per_call
  share = 1 if run.layout.platform == 'cpu' else run.layout.devices
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


@dataclasses.dataclass
class PlannedGroup:
  """One program's runs as `plan_groups` splits them.

  Attributes:
    indices: the runs, as indices into the configs `plan_groups` was given.
    built: per index, the run `plan_groups` built (and validated) to size the program, or None; hand it to
      `build_group` (through `train.train_group`) so that no run is built twice.
  """
  indices: list[int]
  built: list[Optional[Run]]


def plan_groups(configs: Sequence[ml_collections.ConfigDict], workdirs: Sequence[str],
                max_replicas: Optional[int] = None) -> list[PlannedGroup]:
  """The runs split into the groups that `train.train_group` trains as one program each.

  `replicas.partition`, with at most `max_replicas` runs per program, or, unset, as many as fit in memory
  (`replicas.replicas_that_fit`, said in one line when a set of runs is split for it). Checked before
  anything compiles: the first run of each program that several runs could share is built to size it.

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
  built: dict[int, Run] = {}
  for i, config in enumerate(configs):
    key = replicas_lib.program_key(config)
    if key is None or key in limits or (counts[key] == 1 and max_replicas is None):
      continue
    run = built[i] = build(config)
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
  groups = replicas_lib.partition(configs, workdirs, lambda config: limits.get(replicas_lib.program_key(config)))
  return [PlannedGroup(group, [built.get(i) for i in group]) for group in groups]


@functools.lru_cache(maxsize=None)
def _replica_slicer(sharding, platform: str):
  """jitted (group state, r) -> replica r's state, new arrays: r is traced, so one program serves every replica
  and every checkpoint step (one program returning all R replicas at once compiles far slower). Copies only, exact
  at any optimisation level: compiled quick (-O1 on CPU), as it runs at checkpoints and restores."""
  return jax.jit(lambda state, r: jax.tree.map(lambda x: x[r], state), out_shardings=sharding,
                 compiler_options=compilation_cache.quick_compile_options(platform))


def replica_state(group: Group, state, r: int):
  """Replica r's state (P, ...), a new array (the group's state itself for a group of one)."""
  if not group.batched:
    return state
  layout = group.lead.layout
  return _replica_slicer(layout.sharding(), layout.platform)(state, r)


def stack_replicas(group: Group, states: Sequence[Any]):
  """The group's state from each replica's (P, ...) state."""
  if not group.batched:
    return states[0]
  stack = lambda *trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
  return jax.jit(stack, out_shardings=group.lead.layout.sharding(None))(*states)


