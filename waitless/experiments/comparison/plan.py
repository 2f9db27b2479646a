"""The plan of a comparison: which runs, with which configs, in which workdirs (`experiments.compare`).

Entries `ALGORITHM[,key=value...]` and sweep points (parsed by `configs/arguments.py`: `parse_entries`,
`parse_sweeps`, each entry's config from `entry_config`) and seeds make the runs;
`plan` builds and validates every run's config before anything compiles, and gives each its own workdir
`ROOT/<entry>[/<sweep point>]/seed<N>`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from typing import Any, Callable, Optional, Sequence

from waitless.experiments import config_paths


def check_sweep_axes(specs: Sequence[str], runs: Sequence['PlannedRun']) -> None:
  """Refuses a --sweep whose keys move together but of which some change the compiled program (workers, k, group
  size, ...) and others are replica values (seed, learning rate, ...: `replicas.replica_fields`): each of its
  points would need a program of its own, which is rarely what was meant; two --sweep flags make a grid, whose
  replica values then share each program.

  Raises:
    config_errors.ConfigError: naming the --sweep flag.
  """
  from waitless import config_errors as errors
  from waitless.experiments.configs import arguments
  from waitless.experiments.harness import replicas
  for spec in specs:
    keys = [k.strip() for k in spec.partition('=')[0].split(':')]
    if len(keys) < 2:
      continue
    for run in runs:
      fields = set(replicas.replica_fields(run.config))
      kinds = {arguments.resolve_key(run.config, k) in fields for k in keys}
      if len(kinds) > 1:
        scalar = [k for k in keys if arguments.resolve_key(run.config, k) in fields]
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


def plan(get_config: Callable[[str], Any], entries: Sequence[str], sweeps: Sequence[tuple[tuple[str, str], ...]],
         seeds: int, root: str, common_pairs: Sequence[str] = (), overrides: Optional[dict[str, Any]] = None,
         skip_invalid: bool = False, sim_time: Optional[float] = None, max_steps: Optional[int] = None,
         evals: int = 50) -> tuple[list[PlannedRun], dict[str, str]]:
  """Builds and validates every run's config before anything compiles.

  Args:
    get_config: the workload's `get_config(arg)`.
    entries: 'ALGORITHM[,key=value...]' each.
    sweeps: sweep points (`arguments.parse_sweeps`); [()] for none.
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
  from waitless.experiments.comparison import sim_budget
  from waitless.experiments.configs import arguments
  from waitless.experiments.harness import duration
  from waitless.experiments.harness import measured_time
  from waitless.experiments.harness import tasks
  from waitless.experiments.harness import validation
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
        base = arguments.entry_config(get_config, entry, point, common_pairs, overrides)
        first_seed, cadence_steps = base.seed, None
        validation.check_seeds(first_seed, seeds)
        for i in range(seeds):
          config = base.copy_and_resolve_references()
          config.seed = first_seed + i
          cost = validation.validate(config)
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
              budget_steps[clock_key] = sim_budget.steps_for_sim_time(config, sim_time, max_steps, model_bytes[key],
                                                                      cost)
            steps = budget_steps[clock_key]
            errors.require(max_steps is not None or steps < sim_budget.MAX_STEPS, '--sim_time', sim_time,
                           f'is more than {sim_budget.MAX_STEPS:.0e} iterations of this run; give a shorter '
                           'budget, or --max_steps to cap it')
            config.num_epochs = None  # the budget is simulated seconds
            cadence_steps = steps if cadence_steps is None else cadence_steps  # the first seed's: one program
            for field, value in sim_budget.even_blocks(config, steps, evals, max_steps, cadence_steps).items():
              config[field] = value
            validation.validate_counts(config)
          elif config.get('num_epochs') is not None:  # the iterations, for the progress lines and the table
            key = json.dumps(config.dataset.to_dict(), sort_keys=True, default=str)
            if key not in train_size:
              train_size[key] = data_registry.make_dataset(config).train_size
            config = duration.resolve_num_steps(config, train_size[key])
          parts = [root, slug(entry)] + ([slug(sweep_label(point))] if point else []) + [f'seed{config.seed}']
          runs.append(PlannedRun(entry, tuple(point), config.seed, os.path.join(*parts), config))
      except errors.ConfigError as e:
        if not skip_invalid:
          raise errors.ConfigError(f'{entry}: {e}') from e
        skipped[entry] = str(e)
        runs = [r for r in runs if r.entry != entry]
        break
  return runs, skipped

