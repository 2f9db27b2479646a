"""Compares algorithms on one workload, straggler trace and seeds: who reaches the target first.

  python -m experiments.compare --config=experiments/configs/digits.py --workdir=runs/cmp \
      --algorithms='sync,local_sgd,ksync,k=6' --seeds=2 --sweep=optimizer.learning_rate=0.02,0.05,0.1 \
      --config.stragglers.slow_fraction=0.25 --config.stragglers.slow_factor=3

`--algorithms`: entries `ALGORITHM[,key=value...]`, the config argument of `experiments.main`. A name starts
a new entry and a `key=value` belongs to the entry before it, so `sync,local_sgd,ksync,k=6` is three entries;
`;` also separates entries (`'sync;ksync,k=6'`); `all` is every registered algorithm
(`algorithms.registry.names()`, each with its defaults; one whose config is invalid for the workload is
skipped with a note). `--sweep KEY=V1,V2,...` (repeatable: the grid of all of them) runs every entry at every
value (`KEY1:KEY2=A1:B1,A2:B2` moves keys together); each entry is then reported at its best value (fewest seeds missing the target accuracy, then the
shortest mean time to it, then the lowest final eval loss), every run is kept and listed. `--seeds=N` runs
seeds `config.seed + 0 .. N-1`. `--sim_time=T` gives every run the same budget of simulated seconds instead
of the same `num_steps` (an asynchronous iteration is one gradient, a synchronous one P of them): each run's
`num_steps` is what its own seeded clock needs to reach T (computed before anything compiles; `--max_steps`
caps it) and it is evaluated `--evals` times. `--config.FIELD=VALUE` overrides, and the `key=value` pairs of a config
argument (`--config=FILE:ARG`; its algorithm name is ignored), apply to every run; an entry's own pairs,
then the sweep's, win over them.

Each run trains with `experiments.train.train_and_evaluate` in its own workdir,
`WORKDIR/<entry>[/<sweep value>]/seed<N>`, so every file of a run (metrics.jsonl, summary.json, checkpoints)
is the one `experiments.main` writes. Rerunning the same command skips finished runs (summary.json present,
or a recorded divergence or stall), resumes an interrupted one from its checkpoint (also after `kill -9`), and
writes the same report. All runs run one after another in this process, sharing the imports, the JAX
backend and the datasets' in-memory caches (a run after the first starts in about a second, not ten), and a
persistent compilation cache (`--compilation_cache_dir`, default WORKDIR/jax_cache, '' for none): a resumed comparison, and
runs whose programs are identical (entries that differ only in their time rule, e.g. `ksync,k=4` and
`ksync,k=6`), compile once. A seed or a learning rate is a constant of the compiled step, so each seed and
sweep value compiles its own.

Same trace for all: the clock, the data order and the initial parameters are functions of `config.seed` alone
(`cluster/factory.py`, `data/in_memory.py`), so runs with the same seed see the same data order, the same
persistent slow workers and the same random delays (`stragglers.delayed_workers`: drawn per (seed, job,
worker)), whatever the algorithm. Random compute distributions (`exponential`, `pareto`, ...) draw from the
clock's seeded generator in the order a time rule asks, so there the algorithms see the same distribution but
not the same draws; use `trace` to replay one measured table for all.

Writes in WORKDIR: `comparison.md` (the table), `comparison.json` (the same figures, per run and per
algorithm) and `comparison.png` (eval loss and accuracy against simulated time and against steps, one line per
algorithm at its best value, mean over seeds, shaded between the lowest and highest seed). Times to target are
interpolated linearly between the two evaluations around the crossing (never quantised by `eval_every`);
`time_to_target_at_eval` is the quantised value of summary.json. Exit statuses as in `experiments.main`:
2 for a bad flag or config, 75 after SIGTERM / Ctrl-C (rerun to resume).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import logging
import math
import os
import re
import sys
import time
from typing import Any, Callable, Optional, Sequence

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import compilation_cache
from experiments import main as main_lib  # the --config and --workdir flags, the flag parser, device forcing

_ALGORITHMS = flags.DEFINE_string('algorithms', None, "Entries 'ALGORITHM[,key=value...]' separated by ',' "
                                  "(a name starts an entry) or ';'; 'all': every registered algorithm.")
_SEEDS = flags.DEFINE_integer('seeds', 1, 'Seeds per run: config.seed + 0 .. N-1.')
_SWEEP = flags.DEFINE_multi_string('sweep', [], 'KEY=V1,V2,...: run every entry at every value (repeat: grid; '
                                  "'KEY1:KEY2=A1:B1,A2:B2' moves keys together).")
_BASELINE = flags.DEFINE_string('baseline', 'sync', 'Entry the speed-up is measured against.')
_TARGET_LOSS = flags.DEFINE_float('target_loss', None, 'Eval loss for "time to target loss" (default: the '
                                  'highest of the lowest eval losses of the runs that reached the target '
                                  'accuracy, a level each of them reached).')
_SIM_TIME = flags.DEFINE_float('sim_time', None, 'A budget of simulated seconds for every run instead of '
                                'config.num_steps: each run gets the iterations its own clock needs to reach it.')
_MAX_STEPS = flags.DEFINE_integer('max_steps', None, 'With --sim_time: at most this many iterations per run.')
_EVALS = flags.DEFINE_integer('evals', 50, 'With --sim_time: about this many evaluations per run (they also '
                              'set log_every, steps_per_call and checkpoint_every: see sim_budget.even_blocks).')
flags.mark_flag_as_required('algorithms')

FAILED_FILE = 'compare_failed.json'  # a diverged or stalled run: rerunning would fail the same way
SUMMARY_FILE = 'summary.json'
INTERPOLATION = 'linear interpolation between the two evaluations around the crossing'

log = logging.getLogger('waitless')


# ---------------------------------------------------------------------------------------------------------
# The plan: which runs, with which configs, in which workdirs.

def parse_entries(text: str) -> list[str]:
  """'sync,ksync,k=6;local_sgd' -> ['sync', 'ksync,k=6', 'local_sgd']; 'all' -> every registered algorithm."""
  from algorithms import registry  # pylint: disable=g-import-not-at-top
  from experiments.configs import common  # pylint: disable=g-import-not-at-top
  import config_errors as errors  # pylint: disable=g-import-not-at-top
  entries: list[list[str]] = []
  for group in (text or '').split(';'):
    start = True  # after ';' the next part starts an entry even if it has a '='
    for part in common.split_arg(group):
      if part == 'all':
        entries.extend([name] for name in registry.names())
      elif '=' in part and not start:
        if not entries:
          raise errors.ConfigError('--algorithms', text, 'must start with an algorithm name')
        entries[-1].append(part)
      elif '=' in part:
        raise errors.ConfigError('--algorithms', part, 'an entry must start with an algorithm name')
      else:
        registry.get(part)  # an unknown name lists the known ones
        entries.append([part])
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
  from experiments.configs import common  # pylint: disable=g-import-not-at-top
  import config_errors as errors  # pylint: disable=g-import-not-at-top
  axes = []
  for spec in specs:
    key, sep, values = spec.partition('=')
    keys, values = [k.strip() for k in key.split(':')], common.split_arg(values)
    if not sep or not all(keys) or not values:
      raise errors.ConfigError('--sweep', spec, 'expected KEY=V1,V2,... (e.g. optimizer.learning_rate=0.05,0.1) '
                               'or KEY1:KEY2=A1:B1,A2:B2,...')
    axis = []
    for value in values:
      parts = value.split(':') if len(keys) > 1 else [value]
      if len(parts) != len(keys):
        raise errors.ConfigError('--sweep', spec, f'the value {value!r} must have {len(keys)} parts separated by '
                                 f"':', one per key of {':'.join(keys)}")
      axis.append(tuple(zip(keys, (v.strip() for v in parts))))
    axes.append(axis)
  return [tuple(pair for group in point for pair in group) for point in itertools.product(*axes)]


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
  spec = importlib.util.spec_from_file_location(f'_compare_config_{slug(path)}', path)
  if spec is None or spec.loader is None or not os.path.exists(path):
    raise FileNotFoundError(f'config file {path} not found')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _apply_overrides(config, overrides: dict[str, Any], named: set[str]) -> None:
  """Sets each `--config.PATH=VALUE` that this run's config has and its entry or sweep does not name."""
  for path, value in overrides.items():
    if path in named:
      continue
    node = config
    parts = path.split('.')
    for part in parts[:-1]:
      node = node.get(part) if hasattr(node, 'get') else None
    if node is not None and hasattr(node, 'keys') and parts[-1] in node:
      node[parts[-1]] = value


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
      evaluation periods, and it is evaluated about `evals` times in blocks of one length (`sim_budget.even_blocks`).

  Returns:
    (the runs, entry -> why it was skipped).
  """
  import config_errors as errors  # pylint: disable=g-import-not-at-top
  from data import registry as data_registry  # pylint: disable=g-import-not-at-top
  from experiments import sim_budget  # pylint: disable=g-import-not-at-top
  from experiments import tasks  # pylint: disable=g-import-not-at-top
  from experiments import validation  # pylint: disable=g-import-not-at-top
  from experiments.configs import common  # pylint: disable=g-import-not-at-top
  errors.require_int(seeds, '--seeds', 1)
  if sim_time is not None:
    errors.require_number(sim_time, '--sim_time', 'must be a number > 0', lambda v: v > 0)
    errors.require_int(evals, '--evals', 1)
    if max_steps is not None:
      errors.require_int(max_steps, '--max_steps', 1)
  runs, skipped, model_bytes, train_size = [], {}, {}, {}
  for entry in entries:
    name, *pairs = entry.split(',', 1)
    for point in sweeps:
      arg = ','.join([name, *common_pairs, *pairs, *(f'{k}={v}' for k, v in point)])
      named = {k.strip() for k, _ in point} | {p.split('=', 1)[0].strip() for p in common.split_arg(entry)[1:]}
      named |= {f'algorithm.{k}' for k in named if '.' not in k}  # a bare key: algorithm.* first (common._set)
      try:
        base = get_config(arg)
        _apply_overrides(base, overrides or {}, named)
        first_seed = base.seed
        for i in range(seeds):
          config = base.copy_and_resolve_references()
          config.seed = first_seed + i
          validation.validate(config)
          if sim_time is not None:
            errors.require(not config.stragglers.calibrate, 'stragglers.calibrate', True,
                           'a --sim_time budget needs the configured times (calibration rescales them at run time)')
            key = json.dumps([config.dataset.to_dict(), config.model.to_dict()], sort_keys=True, default=str)
            model_bytes.setdefault(key, tasks.model_bytes(config))
            steps = sim_budget.steps_for_sim_time(config, sim_time, max_steps, model_bytes[key])
            config.num_epochs = None  # the budget is simulated seconds
            for field, value in sim_budget.even_blocks(config, steps, evals, max_steps).items():
              config[field] = value
            validation.validate(config)
          elif config.get('num_epochs') is not None:  # the iterations, for the progress lines and the table
            key = json.dumps(config.dataset.to_dict(), sort_keys=True, default=str)
            train_size.setdefault(key, data_registry.make_dataset(config).train_size)
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


# ---------------------------------------------------------------------------------------------------------
# Running: one process, one run after another.

def run_status(workdir: str) -> Optional[str]:
  """'finished', 'diverged' or 'stalled' when the run needs no more work; None otherwise."""
  if os.path.exists(os.path.join(workdir, SUMMARY_FILE)):
    return 'finished'
  path = os.path.join(workdir, FAILED_FILE)
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)['status']
  return None


class _Progress(logging.Filter):
  """Prefixes the training loop's lines with the run (i/N) and adds the whole comparison's ETA."""

  def __init__(self, runs: Sequence[PlannedRun]):
    super().__init__()
    self.runs, self.index, self.done_steps, self.done_seconds = runs, 0, 0, 0.0

  def remaining_steps(self) -> int:
    return sum(r.config.num_steps for r in self.runs[self.index + 1:] if run_status(r.workdir) is None)

  def overall_eta(self, run_eta: float = 0.0) -> str:
    """This run's ETA plus the remaining runs' iterations at the seconds per iteration of the finished runs
    (their start-up and compilation included)."""
    if not self.done_steps:
      return 'after the first run'
    return format_duration(run_eta + self.remaining_steps() * self.done_seconds / self.done_steps)

  def filter(self, record):
    prefix = f'[{self.index + 1}/{len(self.runs)} {self.runs[self.index].name}] '
    if isinstance(record.msg, str) and record.msg.startswith('step %d/%d') and len(record.args) == 6:
      record.msg = prefix + record.msg + '  (comparison ETA %s)'
      record.args = tuple(record.args) + (self.overall_eta(record.args[5]),)
    elif isinstance(record.msg, str):
      record.msg = prefix + record.msg
    return True


def format_duration(seconds: float) -> str:
  seconds = max(0, int(round(seconds)))
  return f'{seconds // 60}m{seconds % 60:02d}s' if seconds >= 60 else f'{seconds}s'


def run_all(runs: Sequence[PlannedRun], stop_requests_factory=None) -> None:
  """Trains every unfinished run in this process, in order; finished ones are skipped.

  A run that diverges or stalls is recorded (`compare_failed.json` in its workdir) and the others go on.
  `train.Preempted`, KeyboardInterrupt and user errors propagate: rerunning resumes where it stopped.
  """
  from experiments import preemption  # pylint: disable=g-import-not-at-top
  from experiments import train  # pylint: disable=g-import-not-at-top
  progress = _Progress(runs)
  log.addFilter(progress)
  try:
    for i, run in enumerate(runs):
      progress.index = i
      status = run_status(run.workdir)
      if status is not None:
        log.info('%s already (%s), skipped', status, run.workdir)
        continue
      log.info('-> %s, %d steps  (comparison ETA %s)', run.workdir, run.config.num_steps, progress.overall_eta())
      start = time.time()
      stop_requests = (stop_requests_factory or preemption.StopRequests)()
      try:
        summary = train.train_and_evaluate(run.config.copy_and_resolve_references(), run.workdir, stop_requests)
        log.info('done in %s: eval accuracy %.4f, loss %.4f, sim time %.3g s', format_duration(time.time() - start),
                 summary['final_eval_accuracy'], summary['final_eval_loss'], summary['sim_time'])
      except (train.TrainingDiverged, train.ClusterStalled) as e:
        failed = 'diverged' if isinstance(e, train.TrainingDiverged) else 'stalled'
        with open(os.path.join(run.workdir, FAILED_FILE), 'w') as f:
          json.dump({'status': failed, 'error': str(e)}, f)
        log.info('%s: %s', failed, e)
      progress.done_steps += run.config.num_steps
      progress.done_seconds += time.time() - start
  finally:
    log.removeFilter(progress)


# ---------------------------------------------------------------------------------------------------------
# Reading the runs back: every figure comes from the run's own metrics.jsonl and summary.json.

def crossing(rows: Sequence[dict[str, Any]], key: str, target: float, above: bool, x: str = 'sim_time'):
  """The first `x` at which `rows[key]` reaches `target` (>= if `above`, else <=), interpolated linearly between
  the evaluation before and the first one that reached it; the first evaluation's `x` if that one already did.

  Returns (interpolated x, x of the first evaluation that reached it), or (None, None).
  """
  points = [(float(r[x]), float(r[key])) for r in rows if r.get(key) is not None and math.isfinite(r[key])]
  reached = (lambda v: v >= target) if above else (lambda v: v <= target)
  for i, (xi, vi) in enumerate(points):
    if reached(vi):
      if i == 0:
        return xi, xi
      x0, v0 = points[i - 1]
      return x0 + (target - v0) / (vi - v0) * (xi - x0), xi
  return None, None


def read_run(run: PlannedRun) -> dict[str, Any]:
  """The run's rows and summary (None while unfinished) and its status."""
  from experiments import metrics_io  # pylint: disable=g-import-not-at-top
  summary = None
  path = os.path.join(run.workdir, SUMMARY_FILE)
  if os.path.exists(path):
    with open(path) as f:
      summary = json.load(f)
  return {'rows': metrics_io.read_rows(run.workdir), 'summary': summary, 'status': run_status(run.workdir)}


def run_figures(rows: Sequence[dict[str, Any]], summary: Optional[dict[str, Any]], target_accuracy: float,
                target_loss: Optional[float]) -> dict[str, Any]:
  """One run's figures: the final ones from summary.json, the others from metrics.jsonl.

  idle_fraction and staleness are means over iterations (each row holds its window's mean, weighted by the
  window's iterations); bytes_communicated is the total.
  """
  evals = [r for r in rows if r.get('eval_accuracy') is not None]
  last_eval = evals[-1] if evals else {}
  s = summary or {}
  out = {
      'final_eval_accuracy': s.get('final_eval_accuracy', last_eval.get('eval_accuracy')),
      'final_eval_loss': s.get('final_eval_loss', last_eval.get('eval_loss')),
      'sim_time': s.get('sim_time', rows[-1]['sim_time'] if rows else None),
      'steps': s.get('steps', rows[-1]['step'] if rows else 0),
      'wall_time': s.get('wall_time'),
      'time_to_target_at_eval': s.get('time_to_target') if summary else crossing(
          evals, 'eval_accuracy', target_accuracy, True)[1],
      'best_eval_loss': min((r['eval_loss'] for r in evals if r.get('eval_loss') is not None), default=None),
  }
  out['time_to_target_accuracy'], _ = crossing(evals, 'eval_accuracy', target_accuracy, True)
  out['steps_to_target_accuracy'], _ = crossing(evals, 'eval_accuracy', target_accuracy, True, x='step')
  if target_loss is not None:
    out['time_to_target_loss'], _ = crossing(evals, 'eval_loss', target_loss, False)
    out['steps_to_target_loss'], _ = crossing(evals, 'eval_loss', target_loss, False, x='step')
  previous, weighted, iterations, total_bytes = 0, {'idle_fraction': 0.0, 'staleness': 0.0}, 0, 0.0
  for r in rows:
    n = r['step'] - previous
    previous = r['step']
    iterations += n
    for key in weighted:
      weighted[key] += n * (r.get(key) or 0.0)
    total_bytes += r.get('bytes_communicated') or 0.0
  for key, value in weighted.items():
    out[key] = value / iterations if iterations else None
  out['bytes_communicated'] = total_bytes
  return out


def spread(values: Sequence[Optional[float]]) -> dict[str, Any]:
  """Mean, sample std, min and max over the seeds that have a value; `n` of `of` seeds."""
  have = [float(v) for v in values if v is not None and math.isfinite(v)]
  out = {'n': len(have), 'of': len(values), 'values': list(values)}
  if have:
    mean = sum(have) / len(have)
    std = math.sqrt(sum((v - mean) ** 2 for v in have) / (len(have) - 1)) if len(have) > 1 else 0.0
    out.update(mean=mean, std=std, min=min(have), max=max(have))
  else:
    out.update(mean=None, std=None, min=None, max=None)
  return out


FIGURES = ('time_to_target_accuracy', 'time_to_target_loss', 'final_eval_accuracy', 'final_eval_loss', 'sim_time',
           'idle_fraction', 'staleness', 'bytes_communicated', 'time_to_target_at_eval', 'steps_to_target_accuracy',
           'steps_to_target_loss', 'wall_time')


def _rank(group: dict[str, Any]):
  """Sort key of a (entry, sweep point): fewest seeds missing the target, shortest time to it, lowest loss."""
  t = group['figures']['time_to_target_accuracy']
  loss = group['figures']['final_eval_loss']['mean']
  return (t['of'] - t['n'], t['mean'] if t['mean'] is not None else math.inf,
          loss if loss is not None else math.inf)


def summarize(runs: Sequence[PlannedRun], target_accuracy: float, target_loss: Optional[float] = None,
              baseline: str = 'sync') -> dict[str, Any]:
  """Every run's figures, each (entry, sweep point) over seeds, and each entry at its best point."""
  read = [(run, read_run(run)) for run in runs]
  derived = target_loss is None
  if derived:  # a loss level every run that reached the target accuracy reached (all runs if none did)
    lows, successful = [], []
    for _, d in read:
      evals = [r for r in d['rows'] if r.get('eval_loss') is not None and math.isfinite(r['eval_loss'])]
      if evals and d['status'] != 'diverged':
        lows.append(min(r['eval_loss'] for r in evals))
        successful.append(crossing(evals, 'eval_accuracy', target_accuracy, True)[0] is not None)
    if any(successful):
      lows = [v for v, ok in zip(lows, successful) if ok]
    target_loss = max(lows) if lows else None
  per_run = []
  for run, data in read:
    per_run.append({'entry': run.entry, 'sweep': dict(run.sweep), 'seed': run.seed,
                    'workdir': run.workdir, 'status': data['status'] or 'unfinished',
                    **run_figures(data['rows'], data['summary'], target_accuracy, target_loss)})
  groups: dict[tuple[str, tuple], dict[str, Any]] = {}
  for run, record in zip(runs, per_run):
    group = groups.setdefault((run.entry, run.sweep), {'entry': run.entry, 'sweep': dict(run.sweep), 'runs': []})
    group['runs'].append(record)
  for group in groups.values():
    group['figures'] = {k: spread([r[k] if r['status'] != 'diverged' else None for r in group['runs']])
                        for k in FIGURES}
    group['statuses'] = sorted({r['status'] for r in group['runs']})
  entries = list(dict.fromkeys(run.entry for run in runs))
  best = {}
  for entry in entries:
    candidates = [g for g in groups.values() if g['entry'] == entry]
    best[entry] = min(candidates, key=_rank)
  base = best.get(baseline)
  for group in groups.values():
    group['speedup'] = None
    for key in ('time_to_target_accuracy', 'time_to_target_loss'):
      b, t = (base or {}).get('figures', {}).get(key, {}).get('mean'), group['figures'][key]['mean']
      group[f'speedup_{key}'] = b / t if b is not None and t else None
    group['speedup'] = group['speedup_time_to_target_accuracy']
  algorithms = [dict(best[e], best_sweep=dict(best[e]['sweep']) if len(
      [g for g in groups.values() if g['entry'] == e]) > 1 else None) for e in entries]
  algorithms.sort(key=_rank)
  return {'targets': {'accuracy': target_accuracy, 'loss': target_loss, 'loss_derived': derived},
          'time_to_target': INTERPOLATION, 'baseline': baseline if base is not None else None,
          'algorithms': [{k: v for k, v in a.items() if k != 'runs'} for a in algorithms],
          'sweep': [{k: v for k, v in g.items() if k != 'runs'} for g in groups.values()],
          'runs': per_run}


# ---------------------------------------------------------------------------------------------------------
# The report: comparison.md, comparison.json, comparison.png.

def _cell(figure: dict[str, Any], fmt: str = '{:.3g}', scale: float = 1.0) -> str:
  if figure['mean'] is None:
    return 'not reached' if figure['of'] else '-'
  text = fmt.format(figure['mean'] * scale)
  if figure['of'] > 1:
    text += ' ± ' + fmt.format(figure['std'] * scale)
  if figure['n'] < figure['of']:
    text += f' ({figure["n"]}/{figure["of"]})'
  return text


def _bytes(figure: dict[str, Any]) -> str:
  mean = figure['mean']
  if mean is None:
    return '-'
  unit, scale = next(((u, s) for u, s in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)) if mean >= s), ('B', 1.0))
  return _cell(figure, '{:.3g}', 1 / scale) + f' {unit}'


def _row(group: dict[str, Any], label: str) -> list[str]:
  f = group['figures']
  speedup = f'{group["speedup"]:.2f}x' if group['speedup'] is not None else '-'
  failed = [s for s in group['statuses'] if s in ('diverged', 'stalled', 'unfinished')]
  return [label + (f' ({", ".join(failed)})' if failed else ''), _cell(f['time_to_target_accuracy']),
          _cell(f['time_to_target_loss']), _cell(f['final_eval_accuracy'], '{:.4f}'),
          _cell(f['final_eval_loss'], '{:.4f}'), _cell(f['sim_time']), _cell(f['idle_fraction'], '{:.2f}'),
          _cell(f['staleness'], '{:.2f}'), _bytes(f['bytes_communicated']), speedup]


def markdown(report: dict[str, Any], title: str) -> str:
  """The table of `summarize`'s report."""
  t = report['targets']
  loss_note = (' (derived: the highest of the lowest eval losses of the runs that reached the target accuracy, '
               'a level each of them reached)') if t['loss_derived'] else ''
  loss_target = f'{t["loss"]:.4g}' if t['loss'] is not None else '-'
  header = ['algorithm', f'time to acc >= {t["accuracy"]:g} (s)', f'time to loss <= {loss_target} (s)',
            'final acc', 'final loss', 'sim time (s)', 'idle', 'staleness', 'bytes', 'speed-up']
  seeds = max((a['figures']['sim_time']['of'] for a in report['algorithms']), default=0)
  lines = [f'# {title}', '',
           f'Mean ± sample std over {seeds} seed(s); (n/N): only n of N seeds reached the target, the mean is '
           f'over those. Times are simulated seconds, to target by {report["time_to_target"]}. '
           f'Target loss {loss_target}{loss_note}. idle: mean over iterations of the share of worker time spent '
           f'waiting in the iteration (not weighted by its length: a waiting iteration is longer); staleness: '
           f'mean staleness of applied contributions (iterations); bytes: all workers together; speed-up: '
           f'time to target accuracy of {report["baseline"] or "(no baseline)"} / this one\'s. Rows from the '
           f'fastest to target accuracy.', '']
  sweeping = any(a['best_sweep'] for a in report['algorithms'])
  rows = []
  for a in report['algorithms']:
    label = a['entry'] + (f' @ {sweep_label(a["best_sweep"].items())}' if a['best_sweep'] else '')
    rows.append(_row(a, label))
  lines += _table(header, rows)
  if sweeping:
    lines += ['', '## Every sweep point', '',
              'Each algorithm above is at its best point (fewest seeds missing the target accuracy, then the '
              'shortest time to it, then the lowest final loss).', '']
    lines += _table(header, [_row(g, f'{g["entry"]} @ {sweep_label(g["sweep"].items())}')
                             for g in report['sweep']])
  lines += ['', '## Runs', '', '| run | status | time to acc (s) | at eval (summary.json) | final acc | final loss '
            '| sim time (s) | workdir |', '| --- | --- | --- | --- | --- | --- | --- | --- |']
  fmt = lambda v, f='{:.4g}': '-' if v is None else f.format(v)  # pylint: disable=unnecessary-lambda-assignment
  for r in report['runs']:
    point = f' @ {sweep_label(r["sweep"].items())}' if r['sweep'] else ''
    lines.append(f'| {r["entry"]}{point} seed {r["seed"]} | {r["status"]} | {fmt(r["time_to_target_accuracy"])} '
                 f'| {fmt(r["time_to_target_at_eval"])} | {fmt(r["final_eval_accuracy"], "{:.4f}")} '
                 f'| {fmt(r["final_eval_loss"], "{:.4f}")} | {fmt(r["sim_time"])} | `{r["workdir"]}` |')
  return '\n'.join(lines) + '\n'


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
  return ['| ' + ' | '.join(header) + ' |', '|' + ' --- |' * len(header)] + ['| ' + ' | '.join(r) + ' |' for r in rows]


def _curves(group: dict[str, Any], x: str, key: str):
  """(grid, mean, low, high) of `key` against `x` over the group's seeds (None when no run has it)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from experiments import metrics_io  # pylint: disable=g-import-not-at-top
  series = []
  for record in group['runs']:
    rows = [r for r in metrics_io.read_rows(record['workdir']) if r.get(key) is not None and math.isfinite(r[key])]
    if rows:
      series.append((np.array([r[x] for r in rows], float), np.array([r[key] for r in rows], float)))
  if not series:
    return None
  end = min(s[0][-1] for s in series)  # where every seed has data
  grid = np.unique(np.concatenate([s[0][s[0] <= end] for s in series]))
  values = np.stack([np.interp(grid, xs, ys) for xs, ys in series])
  return grid, values.mean(0), values.min(0), values.max(0)


def plot(report: dict[str, Any], path: str, title: str) -> Optional[str]:
  """comparison.png: eval loss and accuracy against simulated time (top) and steps (bottom)."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    log.info('matplotlib is not installed: no comparison.png')
    return None
  groups = {(g['entry'], tuple(sorted(g['sweep'].items()))): g for g in _with_runs(report)}
  fig, axes = plt.subplots(2, 2, figsize=(15, 9.5))
  colors = plt.get_cmap('tab10')  # ten colours, then the same ten dashed: no two lines alike up to 20
  seeds = max((a['figures']['sim_time']['of'] for a in report['algorithms']), default=1)
  for i, a in enumerate(report['algorithms']):
    group = groups[(a['entry'], tuple(sorted(a['sweep'].items())))]
    short = ','.join(f'{k.rsplit(".", 1)[-1]}={v}' for k, v in (a['best_sweep'] or {}).items())
    label = a['entry'] + (f' ({short})' if short else '')
    style = dict(color=colors(i % 10), ls=('-', '--', ':')[i // 10 % 3], lw=1.8)
    for row, x in enumerate(('sim_time', 'step')):
      for col, key in enumerate(('eval_loss', 'eval_accuracy')):
        curve = _curves(group, x, key)
        if curve is None:
          continue
        grid, mean, low, high = curve
        ax = axes[row][col]
        ax.plot(grid, mean, **style, label=label if (row, col) == (0, 0) else None)
        if seeds > 1:
          ax.fill_between(grid, low, high, color=style['color'], alpha=0.15, lw=0)
  t = report['targets']
  steps = [r['steps'] for r in report['runs'] if r.get('steps')]
  if steps and max(steps) > 5 * min(steps):  # a --sim_time budget: from tens to thousands of iterations
    axes[1][0].set_xscale('log')
    axes[1][1].set_xscale('log')
  for row, x_label in enumerate(('simulated time (s)', 'steps (iterations)' + (
      ', log scale' if axes[1][0].get_xscale() == 'log' else ''))):
    loss_ax, acc_ax = axes[row]
    loss_ax.set_yscale('log')
    loss_ax.set_ylabel('eval loss (log scale)')
    acc_ax.set_ylabel('eval accuracy')
    if t['loss'] is not None:
      loss_ax.axhline(t['loss'], color='grey', ls=':', lw=1)
    acc_ax.axhline(t['accuracy'], color='grey', ls=':', lw=1)
    acc_ax.set_ylim(top=1.0)
    for ax in (loss_ax, acc_ax):
      ax.set_xlabel(x_label)
      ax.grid(alpha=0.3)
  spread_note = f'mean of {seeds} seeds, shaded: lowest to highest seed' if seeds > 1 else 'one seed'
  fig.suptitle(f'{title}\n{spread_note}; dotted: targets', fontsize=12)
  fig.tight_layout()
  fig.legend(loc='center left', bbox_to_anchor=(1.0, 0.5), fontsize=10, frameon=False,
             title='fastest to target first')
  fig.savefig(path, dpi=110, bbox_inches='tight')
  plt.close(fig)
  return path


def _with_runs(report):
  """The report's sweep groups with their runs (grouped again from `runs`)."""
  out = []
  for g in report['sweep']:
    runs = [r for r in report['runs'] if r['entry'] == g['entry'] and r['sweep'] == g['sweep']]
    out.append(dict(g, runs=runs))
  return out


def write_report(runs: Sequence[PlannedRun], root: str, title: str, target_accuracy: float,
                 target_loss: Optional[float] = None, baseline: str = 'sync',
                 skipped: Optional[dict[str, str]] = None) -> dict[str, Any]:
  """Writes comparison.md / .json / .png in `root`; returns the report (what comparison.json holds)."""
  report = summarize(runs, target_accuracy, target_loss, baseline)
  report['title'] = title
  report['skipped'] = dict(skipped or {})
  text = markdown(report, title)
  if skipped:
    text += '\n## Not run\n\n' + ''.join(f'- {e}: {why}\n' for e, why in skipped.items())
  os.makedirs(root, exist_ok=True)
  with open(os.path.join(root, 'comparison.md'), 'w') as f:
    f.write(text)
  with open(os.path.join(root, 'comparison.json'), 'w') as f:
    json.dump(report, f, indent=1)
  report['png'] = plot(report, os.path.join(root, 'comparison.png'), title)
  return report


# ---------------------------------------------------------------------------------------------------------

def _compare(argv_config: str, root: str) -> dict[str, Any]:
  import config_errors as errors  # pylint: disable=g-import-not-at-top
  from experiments.configs import common  # pylint: disable=g-import-not-at-top
  devices = main_lib._CONFIG.value.devices  # pylint: disable=protected-access
  main_lib.force_host_devices(devices)  # before anything starts a JAX backend
  path, _, arg = argv_config.partition(':')
  module = load_config_module(path)
  common_pairs = [p for p in common.split_arg(arg) if '=' in p]
  text = _ALGORITHMS.value
  entries = parse_entries(text)
  everything = any(part.strip() == 'all' for part in re.split('[;,]', text))
  overrides = dict(config_flags.get_override_values(flags.FLAGS['config']))
  runs, skipped = plan(module.get_config, entries, parse_sweeps(_SWEEP.value), _SEEDS.value, root, common_pairs,
                       overrides, skip_invalid=everything, sim_time=_SIM_TIME.value, max_steps=_MAX_STEPS.value,
                       evals=_EVALS.value)
  for entry, why in skipped.items():
    print(f'[compare] skipped {entry}: {why}', file=sys.stderr)
  if not runs:
    raise errors.ConfigError('--algorithms', text, 'no entry has a valid config')
  if _BASELINE.value not in entries:
    print(f'[compare] no entry {_BASELINE.value!r}: no speed-up column', file=sys.stderr)
  for r in runs:
    errors.require(r.config.devices == devices, 'devices', r.config.devices,
                   f'must be the same for every run of a comparison ({devices}: set it with --config.devices)')
  print(f'[compare] {len(runs)} runs ({len(set(r.entry for r in runs))} entries x '
        f'{len(set(r.sweep for r in runs))} sweep points x {_SEEDS.value} seeds) in {root}', file=sys.stderr)
  cache = flags.FLAGS.compilation_cache_dir  # experiments.main's flag; here on by default
  cache = os.path.join(root, 'jax_cache') if cache is None else cache
  if cache:
    compilation_cache.enable(cache)
  run_all(runs)
  budget = (f'{_SIM_TIME.value:g} simulated seconds per run' if _SIM_TIME.value is not None
            else f'{runs[0].config.num_steps} steps per run')
  title = f'{os.path.basename(path)}: {runs[0].config.workers} workers, {budget}'
  return write_report(runs, root, title, runs[0].config.target_accuracy, _TARGET_LOSS.value, _BASELINE.value,
                      skipped)


def main(argv):
  del argv
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  absl_logging.set_verbosity(absl_logging.WARNING)
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter('%(asctime)s %(message)s', '%H:%M:%S'))
  log.addHandler(handler)
  log.setLevel(logging.INFO)
  log.propagate = False
  import config_errors as errors  # pylint: disable=g-import-not-at-top
  from experiments import checkpointing  # pylint: disable=g-import-not-at-top
  from experiments import preemption  # pylint: disable=g-import-not-at-top
  from experiments import train  # pylint: disable=g-import-not-at-top
  root = main_lib._WORKDIR.value  # pylint: disable=protected-access
  try:
    report = _compare(config_flags.get_config_filename(flags.FLAGS['config']), root)
  except (errors.ConfigError, train.WorkdirConflict, checkpointing.UnusableWorkdir, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  except preemption.Preempted as e:
    print(f'{e}\nrerun the same compare command to resume', file=sys.stderr)
    sys.exit(preemption.EXIT_PREEMPTED)
  except KeyboardInterrupt:
    print(f'interrupted: rerun the same command to resume in {root}', file=sys.stderr)
    sys.exit(130)
  with open(os.path.join(root, 'comparison.md')) as f:
    print(f.read())
  print(f'table: {os.path.join(root, "comparison.md")}')
  if report.get('png'):
    print(f'plot: {report["png"]}')


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
  app.run(main, flags_parser=main_lib.parse_flags)
