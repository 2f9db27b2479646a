"""The plan of a comparison: which runs, with which configs, in which workdirs (`experiments.compare`).

Entries `ALGORITHM[,key=value...]` (`parse_entries`), sweep points (`parse_sweeps`) and seeds make the runs;
`plan` builds and validates every run's config before anything compiles, and gives each its own workdir
`ROOT/<entry>[/<sweep point>]/seed<N>`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
import re
from typing import Any, Callable, Optional, Sequence

from waitless.experiments import config_paths


def parse_entries(text: str) -> list[str]:
  """'sync,ksync,k=6;local_sgd' -> ['sync', 'ksync,k=6', 'local_sgd']; 'all' -> every registered algorithm."""
  from waitless.cluster import registry
  from waitless.experiments.configs import common
  from waitless import config_errors as errors
  entries: list[list[str]] = []
  for group in (text or '').split(';'):
    start, after_all = True, False  # after ';' the next part starts an entry even if it has a '='
    for part in common.split_arg(group):
      if part == 'all':
        entries.extend([name] for name in registry.names())
        after_all = True
      elif '=' in part and not start:
        if not entries:
          raise errors.ConfigError('--algorithms', text, 'must start with an algorithm name')
        if after_all:  # it would bind to the last registered algorithm only
          raise errors.ConfigError('--algorithms', text, f"'all' takes no key=value pairs ({part}): set a field "
                                   'of every run with --config.FIELD=VALUE, or name the entries')
        entries[-1].append(part)
      elif '=' in part:
        raise errors.ConfigError('--algorithms', part, 'an entry must start with an algorithm name')
      else:
        registry.get(part)  # an unknown name lists the known ones
        entries.append([part])
        after_all = False
      start = False
  if not entries:
    raise errors.ConfigError('--algorithms', text, "name at least one algorithm, or 'all'")
  labels = [','.join(e) for e in entries]
  duplicates = sorted({label for label in labels if labels.count(label) > 1})
  if duplicates:
    raise errors.ConfigError('--algorithms', text, f'entries appear twice: {", ".join(duplicates)}')
  return labels


def parse_sweeps(specs: Sequence[str]) -> list[tuple[tuple[str, str], ...]]:
  """['a=1,2', 'b=x,y'] -> the grid [(('a','1'),('b','x')), (('a','1'),('b','y')), ...]; [] -> [()].

  Keys joined by ':' move together (one axis of tuples, not a grid): 'a:b=1:x,2:y' -> [(('a','1'),('b','x')),
  (('a','2'),('b','y'))], e.g. a learning rate with its momentum.
  """
  from waitless.experiments.configs import common
  from waitless import config_errors as errors
  axes = []
  for spec in specs:
    key, sep, values = spec.partition('=')
    keys, values = [k.strip() for k in key.split(':')], common.split_arg(values)
    if not sep or not all(keys) or not values:
      raise errors.ConfigError('--sweep', spec, 'expected KEY=V1,V2,... (e.g. optimizer.learning_rate=0.05,0.1) '
                               'or KEY1:KEY2=A1:B1,A2:B2,...')
    for k in keys:
      _require_hyperparameter(k, spec)
    axis = []
    for value in values:
      parts = value.split(':') if len(keys) > 1 else [value]
      if len(parts) != len(keys):
        raise errors.ConfigError('--sweep', spec, f'the value {value!r} must have {len(keys)} parts separated by '
                                 f"':', one per key of {':'.join(keys)}")
      axis.append(tuple(zip(keys, (v.strip() for v in parts))))
    repeated = sorted({value for value in values if values.count(value) > 1})
    if repeated:  # it would plan one workdir twice, and the table would count it as two seeds
      raise errors.ConfigError('--sweep', spec, f'the value {repeated[0]!r} appears twice')
    swept = {k for a in axes for k, _ in a[0]}
    if swept & set(keys):
      raise errors.ConfigError('--sweep', spec, f'{sorted(swept & set(keys))[0]} is swept twice: give all its '
                               'values in one --sweep')
    axes.append(axis)
  return [tuple(pair for group in point for pair in group) for point in itertools.product(*axes)]


CLUSTER_SECTIONS = ('stragglers', 'network', 'cluster')  # the simulated cluster: a setting, never a choice


def _require_hyperparameter(key: str, spec: str) -> None:
  """Raises ConfigError naming --sweep for a key a sweep must not choose: the seed (a paired trial: --seeds) or
  a field of the simulated cluster (a setting of the comparison: the "best cluster" is not a result)."""
  from waitless import config_errors as errors
  if key == 'seed':
    raise errors.ConfigError('--sweep', spec, 'a sweep chooses hyper-parameters and seed is none: give the number '
                             'of seeds with --seeds')
  if key.split('.', 1)[0] in CLUSTER_SECTIONS:
    raise errors.ConfigError('--sweep', spec, f'{key} is a setting of the simulated cluster, not a hyper-parameter '
                             'to choose: run one comparison per value (--config.FIELD=V, each with its own --workdir)')


def config_path(config, key: str) -> str:
  """The dotted path a config-argument key names: a bare key is `algorithm.*` first, then top-level (`common._set`)."""
  if '.' in key or key not in config.algorithm:
    return key
  return f'algorithm.{key}'


def check_sweep_axes(specs: Sequence[str], runs: Sequence['PlannedRun']) -> None:
  """Refuses a --sweep whose keys move together but of which some change the compiled program (workers, k, group
  size, ...) and others are replica values (seed, learning rate, ...: `replicas.replica_fields`): each of its
  points would need a program of its own, which is rarely what was meant; two --sweep flags make a grid, whose
  replica values then share each program.

  Raises:
    config_errors.ConfigError: naming the --sweep flag.
  """
  from waitless import config_errors as errors
  from waitless.experiments.harness import replicas
  for spec in specs:
    keys = [k.strip() for k in spec.partition('=')[0].split(':')]
    if len(keys) < 2:
      continue
    for run in runs:
      fields = set(replicas.replica_fields(run.config))
      kinds = {config_path(run.config, k) in fields for k in keys}
      if len(kinds) > 1:
        scalar = [k for k in keys if config_path(run.config, k) in fields]
        program = [k for k in keys if k not in scalar]
        raise errors.ConfigError('--sweep', spec, f'moves {", ".join(program)} (changes the compiled program of '
                                 f'{run.entry}) together with {", ".join(scalar)} (a replica value, an input of one '
                                 'program): give them as two --sweep flags (a grid)')


def slug(text: str) -> str:
  """A directory name for an entry or a sweep point: 'ksync,k=6' -> 'ksync_k=6'."""
  return re.sub(r'[^A-Za-z0-9.=+-]+', '_', text).strip('_') or '_'


def sweep_label(point: Sequence[tuple[str, str]]) -> str:
  return ','.join(f'{k}={v}' for k, v in point)


@dataclasses.dataclass
class PlannedRun:
  """One (entry, sweep point, seed): its config and workdir."""
  entry: str
  sweep: tuple[tuple[str, str], ...]
  seed: int
  workdir: str
  config: Any

  @property
  def name(self) -> str:
    point = f' {sweep_label(self.sweep)}' if self.sweep else ''
    return f'{self.entry}{point} seed {self.seed}'


def load_config_module(path: str):
  """The workload's config module from its file (`get_config(arg)`), as config_flags loads it."""
  path = config_paths.resolve(path)
  spec = importlib.util.spec_from_file_location(f'_compare_config_{slug(path)}', path)
  if spec is None or spec.loader is None or not os.path.exists(path):
    raise FileNotFoundError(f'config file {path} not found')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _apply_overrides(config, overrides: dict[str, Any], named: set[str]) -> None:
  """Sets each `--config.PATH=VALUE` that this run's config has and its entry or sweep does not name."""
  from waitless.experiments.configs import common
  common.override_duration(config, [path for path in overrides if path not in named])
  for path, value in overrides.items():
    if path in named:
      continue
    node = config
    parts = path.split('.')
    for part in parts[:-1]:
      node = node.get(part) if hasattr(node, 'get') else None
    if node is not None and hasattr(node, 'keys') and parts[-1] in node:
      node[parts[-1]] = value
      common.mark_explicit(config, [path])


def entry_config(get_config: Callable[[str], Any], entry: str, point: Sequence[tuple[str, str]] = (),
                 common_pairs: Sequence[str] = (), overrides: Optional[dict[str, Any]] = None):
  """The config of `entry` at sweep `point` (seed not yet varied, not validated): the workload's config for
  'ALGORITHM,<common pairs>,<entry pairs>,<point>', then each `--config.PATH` override the entry or point does
  not name."""
  from waitless.experiments.configs import common
  name, *pairs = entry.split(',', 1)
  arg = ','.join([name, *common_pairs, *pairs, *(f'{k}={v}' for k, v in point)])
  named = {k.strip() for k, _ in point} | {p.split('=', 1)[0].strip() for p in common.split_arg(entry)[1:]}
  named |= {f'algorithm.{k}' for k in named if '.' not in k}  # a bare key: algorithm.* first (common._set)
  config = get_config(arg)
  _apply_overrides(config, overrides or {}, named)
  return config


def plan(get_config: Callable[[str], Any], entries: Sequence[str], sweeps: Sequence[tuple[tuple[str, str], ...]],
         seeds: int, root: str, common_pairs: Sequence[str] = (), overrides: Optional[dict[str, Any]] = None,
         skip_invalid: bool = False, sim_time: Optional[float] = None, max_steps: Optional[int] = None,
         evals: int = 50) -> tuple[list[PlannedRun], dict[str, str]]:
  """Builds and validates every run's config before anything compiles.

  Args:
    get_config: the workload's `get_config(arg)`.
    entries: 'ALGORITHM[,key=value...]' each.
    sweeps: sweep points (`parse_sweeps`); [()] for none.
    seeds: runs per (entry, point), seeds config.seed + 0 .. seeds-1.
    root: the comparison's workdir.
    common_pairs: 'key=value' pairs for every run, applied before the entry's own.
    overrides: `--config.PATH` -> value for every run, unless the entry or sweep names PATH.
    skip_invalid: drop an entry whose config is invalid (reported in the returned dict) instead of raising.
    sim_time: a budget of simulated seconds instead of `num_steps`: each run's `num_steps` becomes the
      iterations its clock needs to reach it (`sim_budget.steps_for_sim_time`, at most `max_steps`), rounded up to whole
      evaluation periods, and it is evaluated about `evals` times in blocks of one length (`sim_budget.even_blocks`),
      every seed of an entry and sweep point at the first seed's cadence (so that they share one program).

  Returns:
    (the runs, entry -> why it was skipped).
  """
  from waitless import config_errors as errors
  from waitless.data import registry as data_registry
  from waitless.experiments.harness import measured_time
  from waitless.experiments.comparison import sim_budget
  from waitless.experiments.harness import tasks
  from waitless.experiments.harness import validation
  from waitless.experiments.configs import common
  errors.require_int(seeds, '--seeds', 1)
  if sim_time is not None:
    errors.require_number(sim_time, '--sim_time', 'must be a number > 0', lambda v: v > 0)
    errors.require_int(evals, '--evals', 1)
    if max_steps is not None:
      errors.require_int(max_steps, '--max_steps', 1)
  elif max_steps is not None:
    raise errors.ConfigError('--max_steps', max_steps, 'caps a --sim_time budget; without --sim_time every run '
                             'does config.num_steps (set --config.num_steps)')
  runs, skipped, model_bytes, train_size, budget_steps = [], {}, {}, {}, {}
  for entry in entries:
    for point in sweeps:
      try:
        base = entry_config(get_config, entry, point, common_pairs, overrides)
        first_seed, cadence_steps = base.seed, None
        validation.check_seeds(first_seed, seeds)
        for i in range(seeds):
          config = base.copy_and_resolve_references()
          config.seed = first_seed + i
          validation.validate(config)
          errors.require(config.runtime != 'ray', 'runtime', config.runtime,
                         'experiments.compare trains lock-step replica programs (runtime=spmd); run a Ray run with '
                         'experiments.main (--seeds for several seeds), or compare the simulated family')
          if sim_time is not None:
            errors.require(not config.stragglers.calibrate, 'stragglers.calibrate', True,
                           'a --sim_time budget needs the configured times (calibration rescales them at run time)')
            errors.require(not measured_time.is_measured(config), 'stragglers.kind', measured_time.KIND,
                           'a --sim_time budget needs simulated times; a measured run knows its time only as it runs')
            key = json.dumps([config.dataset.to_dict(), config.model.to_dict()], sort_keys=True, default=str)
            if key not in model_bytes:  # not setdefault: its argument, a data load and a trace, runs every time
              model_bytes[key] = tasks.model_bytes(config)
            # The clock reads no optimizer field: the sweep points of a seed share its count of iterations.
            clock_key = json.dumps([key, {k: v for k, v in config.to_dict().items() if k != 'optimizer'}],
                                   sort_keys=True, default=str)
            if clock_key not in budget_steps:
              budget_steps[clock_key] = sim_budget.steps_for_sim_time(config, sim_time, max_steps, model_bytes[key])
            steps = budget_steps[clock_key]
            errors.require(max_steps is not None or steps < sim_budget.MAX_STEPS, '--sim_time', sim_time,
                           f'is more than {sim_budget.MAX_STEPS:.0e} iterations of this run; give a shorter '
                           'budget, or --max_steps to cap it')
            config.num_epochs = None  # the budget is simulated seconds
            cadence_steps = steps if cadence_steps is None else cadence_steps  # the first seed's: one program
            for field, value in sim_budget.even_blocks(config, steps, evals, max_steps, cadence_steps).items():
              config[field] = value
            validation.validate(config)
          elif config.get('num_epochs') is not None:  # the iterations, for the progress lines and the table
            key = json.dumps(config.dataset.to_dict(), sort_keys=True, default=str)
            if key not in train_size:
              train_size[key] = data_registry.make_dataset(config).train_size
            config = common.resolve_num_steps(config, train_size[key])
          parts = [root, slug(entry)] + ([slug(sweep_label(point))] if point else []) + [f'seed{config.seed}']
          runs.append(PlannedRun(entry, tuple(point), config.seed, os.path.join(*parts), config))
      except errors.ConfigError as e:
        if not skip_invalid:
          raise errors.ConfigError(f'{entry}: {e}') from e
        skipped[entry] = str(e)
        runs = [r for r in runs if r.entry != entry]
        break
  return runs, skipped

