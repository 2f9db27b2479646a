r"""Compares algorithms on one workload, straggler trace and seeds: who reaches the target first.

  python -m waitless.experiments.compare --config=experiments/configs/digits.py --workdir=runs/cmp \
      --algorithms='sync,local_sgd,ksync,k=6' --seeds=2 --sweep=optimizer.learning_rate=0.02,0.05,0.1 \
      --config.stragglers.slow_fraction=0.25 --config.stragglers.slow_factor=3

`--algorithms`: entries `ALGORITHM[,key=value...]`, the config argument of `experiments.main` (the language of
`experiments/configs/arguments.py`, which parses every list below). A name starts a new entry and a `key=value`
belongs to the entry before it, so `sync,local_sgd,ksync,k=6` is three entries; `;` also separates entries
(`'sync;ksync,k=6'`); `all` is every registered algorithm (`cluster.registry.names()`, each with its defaults; one
whose config is invalid for the workload is skipped with a note). `--sweep KEY=V1,V2,...` (repeatable: the grid of
all of them) runs every entry at every value (`KEY1:KEY2=A1:B1,A2:B2` moves keys together); each entry is then
reported at its best value (the lowest median time to target accuracy, seeds that miss it included, then the lowest
median final eval loss), every run is kept and listed. `--seeds=N` runs seeds `config.seed + 0 .. N-1`; with a
sweep, `--tuning_seeds=K` chooses each entry's value on the first K of them and reports every figure on the others
(default 0: chosen on the reported seeds themselves, which the table calls optimistic). `--sim_time=T` gives every
run the same budget of simulated seconds instead of the same `num_steps` (an asynchronous iteration is one
gradient, a synchronous one P of them): each run's `num_steps` is what its own seeded clock needs to reach T
(computed before anything compiles; `--max_steps` caps it) and it is evaluated `--evals` times;
`--sim_baseline_steps=N` gives that budget as the simulated time the baseline entry needs for N iterations, so that
one command fits every cluster profile. `--config.FIELD=VALUE` overrides, and the `key=value` pairs of a config
argument (`--config=FILE:ARG`; its algorithm name is ignored), apply to every run; an entry's own pairs, then the
sweep's, win over them.

Each run has its own workdir, `WORKDIR/<entry>[/<sweep value>]/seed<N>`, and every file of a run (metrics.jsonl,
summary.json, checkpoints) is the one `experiments.main` writes. Runs that differ only in their seed, budget and
scalar hyper-parameters train as the replicas of one compiled program (`experiments/harness/replicas.py`,
`setup.plan_groups`: at most `--max_replicas`, or as many as fit in memory); the programs run one after another
in this process, sharing the imports, the JAX backend, the datasets' in-memory caches and a persistent
compilation cache (`--compilation_cache_dir`, default WORKDIR/jax_cache, '' for none). Rerunning the same
command skips finished runs (summary.json present, or a recorded divergence or stall), resumes interrupted ones
from their checkpoints (also after `kill -9`), and writes the same report.

Same trace for all: the clock, the data order and the initial parameters are functions of `config.seed` alone
(`cluster/factory.py`, `data/in_memory.py`), so runs with the same seed see the same data order, the same
persistent slow workers and the same random delays (`stragglers.delayed_workers`: drawn per (seed, job,
worker)), whatever the algorithm. Random compute distributions (`exponential`, `pareto`, ...) draw from the
clock's seeded generator in the order a time rule asks, so there the algorithms see the same distribution but
not the same draws; use `trace` to replay one measured table for all.

Writes in WORKDIR: `comparison.md` (the table), `comparison.json` (the same figures, per run and per algorithm),
`comparison.png` (eval loss and accuracy against simulated time and against steps, one line per algorithm at its
best value, the median over the reporting seeds, shaded by the pointwise bootstrap interval of that median; at most
six entries a row of panels, the baseline in every row) and `comparison_intervals.png` (the median time to target
per entry with its interval, sorted, coloured by verdict, the baseline marked, beside the probability of beating the
baseline: rliable's interval plot). The terminal gets the verdict table and these files' paths; the notes and the
list of runs are in comparison.md. Figures over seeds (`experiments.comparison.statistics`): medians with
`--confidence` (0.95) bootstrap intervals, a seed that misses a target censored at its budget (never dropped), the
probability of beating `--baseline` on paired seeds with its interval, and a verdict (faster / slower / tied). Times
to target are interpolated linearly between the two evaluations around the crossing (never quantised by
`eval_every`); `time_to_target_at_eval` is the quantised value of summary.json. Exit statuses as in
`experiments.main`: 2 for a bad flag or config, 75 after SIGTERM / Ctrl-C (rerun to resume).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

from absl import app
from absl import flags
from ml_collections import config_flags

from waitless.experiments.comparison import plan as compare_plan
from waitless.experiments.comparison import report as report_lib
from waitless.experiments.comparison import runs as compare_runs
from waitless.experiments import shared_flags  # --config, --workdir, --seeds, ..., the flag parser, device forcing
from waitless.experiments.comparison import statistics
from waitless.experiments.harness import compilation_cache

flags.adopt_module_key_flags(shared_flags)  # --config, --workdir, --seeds, ... in `--help` too

_ALGORITHMS = flags.DEFINE_string('algorithms', None, "Entries 'ALGORITHM[,key=value...]' separated by ',' "
                                  "(a name starts an entry) or ';'; 'all': every registered algorithm.")
_SWEEP = flags.DEFINE_multi_string('sweep', [], 'KEY=V1,V2,...: run every entry at every value (repeat: grid; '
                                  "'KEY1:KEY2=A1:B1,A2:B2' moves keys together).")
_BASELINE = flags.DEFINE_string('baseline', 'sync', 'Entry the speed-up is measured against.')
_TARGET_LOSS = flags.DEFINE_float('target_loss', None, 'Eval loss for "time to target loss" (default: the '
                                  'highest of the lowest eval losses of the runs that reached the target '
                                  'accuracy, a level each of them reached).')
_SIM_TIME = flags.DEFINE_float('sim_time', None, 'A budget of simulated seconds for every run instead of '
                                'config.num_steps: each run gets the iterations its own clock needs to reach it.')
_SIM_BASELINE_STEPS = flags.DEFINE_integer(
    'sim_baseline_steps', None, 'The --sim_time budget as the simulated time the baseline entry (its first seed) '
    'needs for this many iterations, so that one command fits every cluster profile.')
_MAX_STEPS = flags.DEFINE_integer('max_steps', None, 'With --sim_time: at most this many iterations per run.')
_TUNING_SEEDS = flags.DEFINE_integer(
    'tuning_seeds', 0, 'With a sweep: the first K seeds choose each entry\'s sweep point and every figure of the '
    'table is over the other seeds (0: chosen on the reported seeds themselves, an optimistic choice).')
_CONFIDENCE = flags.DEFINE_float('confidence', 0.95, 'Level of the bootstrap intervals, in (0, 1).')
_EVALS = flags.DEFINE_integer('evals', 50, 'With --sim_time: about this many evaluations per run (they also '
                              'set log_every, steps_per_call and checkpoint_every: see sim_budget.even_blocks).')
flags.mark_flag_as_required('algorithms')

log = logging.getLogger('waitless')


# ---------------------------------------------------------------------------------------------------------

def _compare(argv_config: str, root: str) -> dict[str, Any]:
  from waitless import config_errors as errors
  from waitless.experiments.configs import arguments
  statistics.check_options(shared_flags.SEEDS.value, _TUNING_SEEDS.value, _CONFIDENCE.value)  # before anything runs
  errors.require(not _TUNING_SEEDS.value or bool(_SWEEP.value), '--tuning_seeds', _TUNING_SEEDS.value,
                 'the tuning seeds choose each entry\'s --sweep point; without a sweep there is nothing to choose '
                 'and every seed reports: leave it 0')
  if _TARGET_LOSS.value is not None:
    errors.require_number(_TARGET_LOSS.value, '--target_loss', 'must be a finite number > 0', lambda v: v > 0)
  if shared_flags.MAX_REPLICAS.value is not None:  # checked again where the programs are planned; news now
    errors.require_int(shared_flags.MAX_REPLICAS.value, '--max_replicas', 1)
  devices = shared_flags.CONFIG.value.devices
  shared_flags.force_host_devices(devices)  # before anything starts a JAX backend
  path, _, arg = argv_config.partition(':')
  module = compare_plan.load_config_module(path)
  common_pairs = arguments.pairs(arg)
  text = _ALGORITHMS.value
  entries = arguments.parse_entries(text)
  # The default baseline may be absent (a comparison without sync); one given by name must be an entry.
  errors.require(_BASELINE.value in entries or not flags.FLAGS['baseline'].present, '--baseline', _BASELINE.value,
                 f'must be one of the entries: {", ".join(entries)}')
  everything = any(part.strip() == 'all' for part in re.split('[;,]', text))
  overrides = dict(config_flags.get_override_values(flags.FLAGS['config']))
  sim_time = _SIM_TIME.value
  if _SIM_BASELINE_STEPS.value is not None:
    sim_time = _budget_of_baseline_steps(module.get_config, entries, common_pairs, overrides)
  runs, skipped = compare_plan.plan(
      module.get_config, entries, arguments.parse_sweeps(_SWEEP.value), shared_flags.SEEDS.value, root, common_pairs,
      overrides, skip_invalid=everything, sim_time=sim_time, max_steps=_MAX_STEPS.value, evals=_EVALS.value)
  compare_plan.check_sweep_axes(_SWEEP.value, runs)
  for entry, why in skipped.items():
    print(f'[compare] skipped {entry}: {why}', file=sys.stderr)
  if not runs:
    raise errors.ConfigError('--algorithms', text, 'no entry has a valid config')
  if _BASELINE.value not in entries:
    print(f'[compare] no entry {_BASELINE.value!r}: no speed-up column', file=sys.stderr)
  for r in runs:
    errors.require(r.config.devices == devices, 'devices', r.config.devices,
                   f'must be the same for every run of a comparison ({devices}: set it with --config.devices)')
  from waitless.experiments.harness import workdir as workdir_lib
  for r in runs:  # a rerun with other settings must not skip runs of the old ones and report them as the new
    try:
      workdir_lib.check_workdir(r.workdir, r.config)
    except workdir_lib.WorkdirConflict as e:
      raise workdir_lib.WorkdirConflict(f'{e} (this workdir holds a comparison with other settings: rerun it with the '
                                  'same flags, or give the new one its own --workdir)') from e
  from waitless.experiments.harness import workdir_lock
  lock = workdir_lock.WorkdirLock(root)  # a second comparison on this workdir would train every run twice
  try:
    return _run_and_report(runs, root, path, skipped, sim_time)
  finally:
    lock.release()


def _run_and_report(runs, root: str, path: str, skipped: dict[str, str], sim_time: float | None) -> dict[str, Any]:
  """Trains the unfinished runs, then writes the report (`sim_time`: the budget of every run, --sim_time's or
  the one --sim_baseline_steps gave; None: config.num_steps)."""
  print(f'[compare] {len(runs)} runs ({len(set(r.entry for r in runs))} entries x '
        f'{len(set(r.sweep for r in runs))} sweep points x {shared_flags.SEEDS.value} seeds) in {root}',
        file=sys.stderr)
  cache = shared_flags.COMPILATION_CACHE.value  # here on by default
  cache = os.path.join(root, 'jax_cache') if cache is None else cache
  if cache:
    compilation_cache.enable(cache)
  compare_runs.run_all(runs, max_replicas=shared_flags.MAX_REPLICAS.value)
  budget = (f'{runs[0].config.num_steps} steps per run' if sim_time is None else
            f'{sim_time:.4g} simulated seconds per run' + (f' (what {_budget_entry([r.entry for r in runs])} needs for '
                                                           f'{_SIM_BASELINE_STEPS.value} iterations)'
                                                           if _SIM_BASELINE_STEPS.value is not None else ''))
  profile = runs[0].config.get('cluster', {}).get('profile', '')  # every table names the cluster it holds for
  cluster = f'cluster profile {profile}' if profile else 'no cluster profile (configured times, ideal network)'
  title = f'{os.path.basename(path)}: {runs[0].config.workers} workers, {budget}, {cluster}'
  return report_lib.write_report(runs, root, title, runs[0].config.target_accuracy, _TARGET_LOSS.value,
                                 _BASELINE.value, skipped, tuning_seeds=_TUNING_SEEDS.value,
                                 confidence=_CONFIDENCE.value)


def _budget_entry(entries: list[str]) -> str:
  """The entry whose iterations --sim_baseline_steps counts: the baseline, or the first entry without one."""
  return _BASELINE.value if _BASELINE.value in entries else entries[0]


def _budget_of_baseline_steps(get_config, entries: list[str], common_pairs: list[str],
                              overrides: dict[str, Any]) -> float:
  """--sim_baseline_steps in simulated seconds: the time the baseline entry's clock (the first entry's when the
  baseline is not one; its first seed, on its cluster profile if any) needs for that many iterations."""
  from waitless import config_errors as errors
  from waitless.experiments.comparison import sim_budget
  from waitless.experiments.configs import arguments
  from waitless.experiments.harness import validation
  steps = _SIM_BASELINE_STEPS.value
  errors.require(_SIM_TIME.value is None, '--sim_baseline_steps', steps,
                 f'and --sim_time={_SIM_TIME.value} both give the budget: set one of them')
  errors.require_int(steps, '--sim_baseline_steps', 1)
  entry = _budget_entry(entries)
  config = arguments.entry_config(get_config, entry, (), common_pairs, overrides)
  cost = validation.validate(config)
  sim_time = sim_budget.sim_time_of_steps(config, steps, cost=cost)
  profile = cost.profile
  print(f'[compare] --sim_baseline_steps={steps}: {entry} needs {sim_time:.4g} simulated seconds for {steps} '
        f'iterations{" on " + profile if profile else ""}: the budget of every run', file=sys.stderr)
  return sim_time


def main(argv):
  del argv
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.WARNING)
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter('%(asctime)s %(message)s', '%H:%M:%S'))
  log.addHandler(handler)
  log.setLevel(logging.INFO)
  log.propagate = False
  from waitless import config_errors as errors
  from waitless.experiments.harness import checkpointing
  from waitless.experiments.harness import metrics_io
  from waitless.experiments.harness import preemption
  from waitless.experiments.harness import workdir as workdir_lib
  from waitless.experiments.harness import workdir_lock
  root = shared_flags.WORKDIR.value
  preemption.exit_before_training()
  try:
    report = _compare(config_flags.get_config_filename(flags.FLAGS['config']), root)
  except (errors.ConfigError, workdir_lib.WorkdirConflict, checkpointing.UnusableWorkdir, FileNotFoundError,
          metrics_io.CutLog, workdir_lock.WorkdirBusy) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  except preemption.Preempted as e:
    print(f'{e}\nrerun the same compare command to resume', file=sys.stderr)
    sys.exit(preemption.EXIT_PREEMPTED)
  except KeyboardInterrupt as e:
    print(f'interrupted: rerun the same command to resume in {root}', file=sys.stderr)
    sys.exit(preemption.exit_code(e))
  print(report_lib.terminal(report, root))  # ends with the verdict table and the files' paths


if __name__ == '__main__':
  from waitless.experiments.harness import preemption
  preemption.exit_before_training()
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
  app.run(main, flags_parser=shared_flags.parse_flags)
