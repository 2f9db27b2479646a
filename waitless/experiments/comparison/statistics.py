"""A comparison's figures: every run's from its own metrics.jsonl and summary.json, then over seeds.

Times to target are interpolated linearly between the two evaluations around the crossing (`crossing`), so
they are not quantised by `eval_every`.

Over seeds (`summarize`):
- Every figure is the median over seeds with a bootstrap confidence interval of that median
  (`scipy.stats.bootstrap`, percentile method, `N_RESAMPLES` resamples, fixed `RANDOM_STATE`: the same files
  give the same figures on every rerun). One seed has no interval.
- Censoring: a seed that misses a target (or diverged) is censored at its budget (its run's simulated time, or
  its steps for steps to target), never dropped: its time counts as greater than its budget and than every
  time that reached the target. A median or interval end that depends on a censored seed is not a number: it is
  reported as a lower bound (`*_above`: it exceeds that value, computed with each censored seed at its budget).
- Probability of improvement (Agarwal et al. 2021, "Deep RL at the edge of the statistical precipice"):
  P(A beats B) = mean over paired seeds of [T_A < T_B] + 0.5 [T_A = T_B] (both censored is a tie); a seed is
  the same straggler trace, data order and initial parameters for every entry. Its interval resamples the
  seeds jointly (paired).
- Verdicts against the baseline: 'faster' if the interval of P(entry beats baseline) lies entirely above 0.5,
  'slower' if entirely below, 'tied' otherwise (also with one seed: no interval). Against the best entry (the
  first row): 'tied' if the interval of P(entry beats best) contains 0.5, 'behind' if it lies below, 'ahead'
  if above (ahead on paired seeds despite a higher median).
- Tuning seeds: with a sweep, the first `tuning_seeds` seeds choose each entry's sweep point (the lowest median
  time to target accuracy, censoring included, then the lowest median final eval loss) and every figure of an
  entry is computed on the other seeds. With 0 the point is chosen on the seeds that are reported, which
  favours it (optimistic); without a sweep there is nothing to choose and every seed reports.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Sequence

import numpy as np

from waitless.experiments.comparison.plan import PlannedRun
from waitless.experiments.harness import atomic_files
from waitless.experiments.harness import metrics_io
from waitless.experiments.comparison.runs import SUMMARY_FILE
from waitless.experiments.comparison.runs import run_status

INTERPOLATION = 'linear interpolation between the two evaluations around the crossing'


def crossing(rows: Sequence[dict[str, Any]], key: str, target: float, above: bool, x: Optional[str] = None):
  """The first `x` at which `rows[key]` reaches `target` (>= if `above`, else <=), interpolated linearly between
  the evaluation before and the first one that reached it; the first evaluation's `x` if that one already did.
  `x` None: each row's time, whichever clock wrote it (`metrics_io.time_of`).

  Returns (interpolated x, x of the first evaluation that reached it), or (None, None).
  """
  points = [(metrics_io.time_of(r) if x is None else float(r[x]), float(r[key])) for r in rows
            if r.get(key) is not None and math.isfinite(r[key])]
  reached = (lambda v: v >= target) if above else (lambda v: v <= target)
  for i, (xi, vi) in enumerate(points):
    if reached(vi):
      if i == 0:
        return xi, xi
      x0, v0 = points[i - 1]
      return x0 + (target - v0) / (vi - v0) * (xi - x0), xi
  return None, None


def read_run(run: PlannedRun) -> dict[str, Any]:
  """The run's rows and summary (None while unfinished) and its status.

  Raises:
    metrics_io.CutLog: the run finished but its metrics.jsonl is cut, missing, has a gap or disagrees with
      summary.json (`metrics_io.check_finished_log`), or a stopped run's log has a gap.
  """
  summary = atomic_files.read_json(os.path.join(run.workdir, SUMMARY_FILE))
  status = run_status(run.workdir)
  rows = metrics_io.read_rows(run.workdir, complete=status == 'finished')
  config = run.config  # None: a test's run without one (its rows only checked against summary.json)
  cadence = None if config is None else (int(config.log_every), int(config.eval_every))
  if status == 'finished':
    metrics_io.check_finished_log(run.workdir, rows, summary, cadence,
                                  None if config is None else config.target_accuracy)
  elif status is not None and rows and config is not None:  # stopped for good (diverged, stalled): up to its end
    gaps = metrics_io.log_gaps([r['step'] for r in rows], rows[-1]['step'], *cadence, int(run.config.num_steps))
    if gaps is not None:
      raise metrics_io.CutLog(f'{os.path.join(run.workdir, metrics_io.METRICS_FILE)} has {gaps}: its figures would '
                              "come from a log with a gap; remove that run's workdir and rerun the comparison")
  return {'rows': rows, 'summary': summary, 'status': status}


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
      'sim_time': metrics_io.time_of(s) if summary else (metrics_io.time_of(rows[-1]) if rows else None),
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


CONFIDENCE = 0.95
N_RESAMPLES = 9999
PLOT_RESAMPLES = 1000  # a shaded band of a curve's hundreds of points: 10x cheaper, its edges move by pixels
RANDOM_STATE = 0
METHOD = 'percentile'  # as rliable: monotone in the data, so a bound computed at the budgets is a bound
INTERVAL = (f'bootstrap over seeds ({METHOD} method, {N_RESAMPLES} resamples, random state {RANDOM_STATE}, '
            'scipy.stats.bootstrap)')

# Figures a seed can miss, with the figure of the same run that is their budget.
CENSORED = {'time_to_target_accuracy': 'sim_time', 'time_to_target_loss': 'sim_time',
            'time_to_target_at_eval': 'sim_time', 'steps_to_target_accuracy': 'steps',
            'steps_to_target_loss': 'steps'}
FIGURES = ('time_to_target_accuracy', 'time_to_target_loss', 'final_eval_accuracy', 'final_eval_loss', 'sim_time',
           'idle_fraction', 'staleness', 'bytes_communicated', 'time_to_target_at_eval', 'steps_to_target_accuracy',
           'steps_to_target_loss', 'wall_time')
TARGETS = ('time_to_target_accuracy', 'time_to_target_loss')


def check_options(seeds: int, tuning_seeds: int, confidence: float) -> None:
  """Raises ConfigError naming the flag unless 0 <= tuning_seeds < seeds and 0 < confidence < 1 (a bad
  `seeds` is --seeds' error, raised by the plan)."""
  from waitless import config_errors as errors
  if seeds >= 1:
    errors.require_int(tuning_seeds, '--tuning_seeds', 0, seeds - 1,
                       f'fewer than --seeds={seeds}, so that a seed reports')
  errors.require_number(confidence, '--confidence', 'must be a number strictly between 0 and 1 (e.g. 0.95)',
                        lambda v: 0 < v < 1)


def _interval(data: Sequence[np.ndarray], statistic, confidence: float, paired: bool = False,
              n_resamples: int = N_RESAMPLES):
  """(low, high) of the bootstrap interval of `statistic` over the last axis of `data` (resampled jointly
  across the leading axes, and across the samples if `paired`)."""
  from scipy import stats
  result = stats.bootstrap(tuple(data), statistic, axis=-1, vectorized=True, paired=paired,
                           confidence_level=confidence, n_resamples=n_resamples, method=METHOD, rng=RANDOM_STATE)
  return np.asarray(result.confidence_interval.low), np.asarray(result.confidence_interval.high)


def median_interval(values: np.ndarray, confidence: float = CONFIDENCE, axis: int = -1,
                    n_resamples: int = N_RESAMPLES):
  """(low, high) of the bootstrap interval of the median of `values` along `axis`, for every other index at
  once (the same resamples for all: e.g. each point of a curve over seeds)."""
  moved = np.moveaxis(np.asarray(values, float), axis, -1)
  return _interval([moved], np.median, confidence, n_resamples=n_resamples)


def describe(values: Sequence[Optional[float]], confidence: float = CONFIDENCE) -> dict[str, Any]:
  """Median and its interval over the seeds with a finite value (`n` of `of`; the others, e.g. diverged runs,
  are left out and counted)."""
  have = np.array([float(v) for v in values if v is not None and math.isfinite(v)])
  out = {'n': len(have), 'of': len(values), 'censored': 0, 'values': list(values),
         'median': float(np.median(have)) if len(have) else None, 'low': None, 'high': None}
  if len(have) >= 2:
    low, high = _interval([have], np.median, confidence)
    out.update(low=float(low), high=float(high))
  return out


def _known(name: str, under_two_sentinels: np.ndarray, at_budgets: float) -> dict[str, Optional[float]]:
  """`name` is a number when it is the same whatever the censored seeds' times above their budgets (two
  sentinels agree); else `name_above`, the value with every censored seed at its budget, a lower bound."""
  first, second = (float(v) for v in under_two_sentinels)
  if first == second:
    return {name: first, f'{name}_above': None}
  return {name: None, f'{name}_above': float(at_budgets)}


def describe_censored(values: Sequence[Optional[float]], budgets: Sequence[Optional[float]],
                      confidence: float = CONFIDENCE) -> dict[str, Any]:
  """Median and its interval over every seed, a seed with no value (it missed) censored at its budget.

  The statistic is computed with each censored value replaced by a sentinel above every value and budget, and
  again by twice that sentinel: where they agree, the figure does not depend on the censored times; where they
  differ, the figure is reported as `*_above`, its value with each censored seed at its budget (the median and
  the percentile interval are monotone in every seed's value, so that is a lower bound).
  """
  missed = np.array([v is None for v in values], bool)
  out = {'n': len(values), 'of': len(values), 'censored': int(missed.sum()), 'values': list(values),
         'budgets': list(budgets), 'median': None, 'median_above': None, 'low': None, 'low_above': None,
         'high': None, 'high_above': None}
  if not len(values):
    return out
  known = [float(v) for v in values if v is not None] + [float(b) for b in budgets if b is not None]
  sentinel = 2 * max(known, default=0.0) + 1
  times = np.array([0.0 if v is None else float(v) for v in values])
  floor = np.array([0.0 if b is None else float(b) for b in budgets])
  rows = np.stack([np.where(missed, sentinel, times), np.where(missed, 2 * sentinel, times),
                   np.where(missed, floor, times)])
  point = np.median(rows, axis=-1)
  out.update(_known('median', point[:2], point[2]))
  if len(values) >= 2:
    low, high = _interval([rows], np.median, confidence)
    out.update(_known('low', low[:2], low[2]))
    out.update(_known('high', high[:2], high[2]))
  return out


def _improvement_scores(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
  """Mean over seeds of [x < y] + 0.5 [x = y]."""
  return np.mean((x < y) + 0.5 * (x == y), axis=axis)


def probability_of_improvement(x: Sequence[Optional[float]], y: Sequence[Optional[float]],
                               confidence: float = CONFIDENCE) -> dict[str, Any]:
  """P(x beats y) on paired seeds (x[i] and y[i] are the same seed; None: missed, slower than any time, tied
  with another miss) and its interval, seeds resampled in pairs. None for `p` without a pair."""
  known = [float(v) for v in list(x) + list(y) if v is not None]
  sentinel = 2 * max(known, default=0.0) + 1
  a = np.array([sentinel if v is None else float(v) for v in x])
  b = np.array([sentinel if v is None else float(v) for v in y])
  out = {'n': len(a), 'wins': int((a < b).sum()), 'ties': int((a == b).sum()), 'losses': int((a > b).sum()),
         'p': float(_improvement_scores(a, b)) if len(a) else None, 'low': None, 'high': None}
  if len(a) >= 2:
    low, high = _interval([a, b], _improvement_scores, confidence, paired=True)
    out.update(low=float(low), high=float(high))
  return out


def verdict(probability: dict[str, Any]) -> str:
  """'faster' if the interval of P(beats the baseline) lies above 0.5, 'slower' if below, else 'tied'."""
  if probability.get('low') is not None and probability['low'] > 0.5:
    return 'faster'
  if probability.get('high') is not None and probability['high'] < 0.5:
    return 'slower'
  return 'tied'


def mark_against_best(probability: dict[str, Any]) -> str:
  """'tied' if the interval of P(beats the best) contains 0.5 (no interval: tied too), 'behind' if it lies
  below 0.5, 'ahead' if above."""
  return {'faster': 'ahead', 'slower': 'behind', 'tied': 'tied'}[verdict(probability)]


def split_seeds(seeds: Sequence[int], tuning_seeds: int, sweeping: bool) -> tuple[list[int], list[int]]:
  """(tuning seeds, reporting seeds): the first `tuning_seeds` of the sorted seeds tune when there is a sweep;
  without one nothing is tuned and every seed reports."""
  ordered = sorted(seeds)
  if not sweeping:
    return [], ordered
  return ordered[:tuning_seeds], ordered[tuning_seeds:]


def _time(record: dict[str, Any], key: str) -> Optional[float]:
  """A run's figure, None when it missed (a diverged run missed whatever it reached before)."""
  return None if record['status'] == 'diverged' else record.get(key)


def figures_over_seeds(records: Sequence[dict[str, Any]], confidence: float = CONFIDENCE) -> dict[str, Any]:
  """Every figure of FIGURES over the runs `records` (one per seed)."""
  out = {}
  for key in FIGURES:
    values = [_time(r, key) for r in records]
    if key in CENSORED:
      out[key] = describe_censored(values, [r.get(CENSORED[key]) for r in records], confidence)
    else:
      out[key] = describe(values, confidence)
  return out


def _order(figures: dict[str, Any]):
  """Sort key: the lowest median time to target accuracy; a median that depends on censored seeds after every
  known one (fewest censored first, then its lower bound); then the lowest median final eval loss."""
  t = figures['time_to_target_accuracy']
  loss = figures['final_eval_loss']['median']
  loss = loss if loss is not None else math.inf
  if t['median'] is not None:
    return (0, t['median'], 0, loss)
  bound = t['median_above'] if t['censored'] < t['n'] and t['median_above'] is not None else 0.0
  return (1, t['censored'], bound, loss)


def _paired(records: Sequence[dict[str, Any]], against: Sequence[dict[str, Any]], key: str,
            confidence: float) -> dict[str, Any]:
  """P(records beat against) on `key` over the seeds both have."""
  theirs = {r['seed']: r for r in against}
  pairs = [(r, theirs[r['seed']]) for r in records if r['seed'] in theirs]
  out = probability_of_improvement([_time(r, key) for r, _ in pairs], [_time(o, key) for _, o in pairs],
                                   confidence)
  out['seeds'] = [r['seed'] for r, _ in pairs]
  return out


def _speedups(group: dict[str, Any], base_figures: Optional[dict[str, Any]]) -> dict[str, Optional[float]]:
  """The baseline's median time to each target / this one's, where both are numbers."""
  out = {}
  for key in TARGETS:
    b = (base_figures or {}).get(key, {}).get('median')
    t = group['figures'][key]['median']
    out[f'speedup_{key}'] = b / t if b is not None and t else None
  out['speedup'] = out['speedup_time_to_target_accuracy']
  return out


def _derived_target_loss(read, target_accuracy: float) -> tuple[Optional[float], Optional[str]]:
  """A loss level every run that reached the target accuracy reached (all runs if none did): the highest of
  their lowest eval losses, and which runs it was derived from ('reached' or 'all'; None without a level)."""
  lows, successful = [], []
  for _, d in read:
    evals = [r for r in d['rows'] if r.get('eval_loss') is not None and math.isfinite(r['eval_loss'])]
    if evals and d['status'] != 'diverged':
      lows.append(min(r['eval_loss'] for r in evals))
      successful.append(crossing(evals, 'eval_accuracy', target_accuracy, True)[0] is not None)
  if any(successful):
    return max(v for v, ok in zip(lows, successful) if ok), 'reached'
  return (max(lows), 'all') if lows else (None, None)


def _choose(groups: Sequence[dict[str, Any]], seeds: Sequence[int], confidence: float) -> None:
  """Each (entry, sweep point)'s figures over `seeds` (those the choice is made on), in place."""
  for group in groups:
    records = [r for r in group['runs'] if r['seed'] in seeds]
    group['seeds'] = list(seeds)
    group['figures'] = figures_over_seeds(records, confidence)
    group['statuses'] = sorted({r['status'] for r in records})


def _reported(group: dict[str, Any], sweeping: bool, seeds: Sequence[int], confidence: float) -> dict[str, Any]:
  """An entry at its chosen point, its figures over the reporting `seeds`."""
  records = [r for r in group['runs'] if r['seed'] in seeds]
  return {'entry': group['entry'], 'sweep': dict(group['sweep']),
          'best_sweep': dict(group['sweep']) if sweeping else None, 'seeds': list(seeds), 'runs': records,
          'figures': figures_over_seeds(records, confidence), 'statuses': sorted({r['status'] for r in records})}


def _compare_entries(algorithms: list[dict[str, Any]], baseline: str, confidence: float) -> None:
  """Each entry's probability of beating the baseline and the best (the first) entry, its verdict and mark."""
  base = next((a for a in algorithms if a['entry'] == baseline), None)
  best = algorithms[0] if algorithms else None
  for a in algorithms:
    a.update(_speedups(a, base['figures'] if base else None))
    a['beats_baseline'] = {k: _paired(a['runs'], base['runs'], k, confidence) for k in TARGETS} if base else None
    a['verdict'] = verdict(a['beats_baseline']['time_to_target_accuracy']) if base and a is not base else None
    if a is best:
      a['beats_best'], a['against_best'] = None, 'best'
    else:
      a['beats_best'] = _paired(a['runs'], best['runs'], 'time_to_target_accuracy', confidence)
      a['against_best'] = mark_against_best(a['beats_best'])


def summarize(runs: Sequence[PlannedRun], target_accuracy: float, target_loss: Optional[float] = None,
              baseline: str = 'sync', tuning_seeds: int = 0, confidence: float = CONFIDENCE) -> dict[str, Any]:
  """Every run's figures; each (entry, sweep point) over the seeds that choose; each entry at its chosen point
  over the reporting seeds, with its probability of beating the baseline and the best entry, and its verdict."""
  seeds = sorted({run.seed for run in runs})
  check_options(len(seeds), tuning_seeds, confidence)
  read = [(run, read_run(run)) for run in runs]
  derived, derived_from = target_loss is None, None
  if derived:
    target_loss, derived_from = _derived_target_loss(read, target_accuracy)
  groups: dict[tuple[str, tuple], dict[str, Any]] = {}
  for run, data in read:
    group = groups.setdefault((run.entry, run.sweep), {'entry': run.entry, 'sweep': dict(run.sweep), 'runs': []})
    group['runs'].append({'entry': run.entry, 'sweep': dict(run.sweep), 'seed': run.seed, 'workdir': run.workdir,
                          'status': data['status'] or 'unfinished',
                          **run_figures(data['rows'], data['summary'], target_accuracy, target_loss)})
  entries = list(dict.fromkeys(run.entry for run in runs))
  sweeping = any(sum(g['entry'] == e for g in groups.values()) > 1 for e in entries)
  tuning, reporting = split_seeds(seeds, tuning_seeds, sweeping)
  _choose(groups.values(), tuning or reporting, confidence)
  chosen = {e: min((g for g in groups.values() if g['entry'] == e), key=lambda g: _order(g['figures']))
            for e in entries}
  algorithms = sorted((_reported(chosen[e], sweeping, reporting, confidence) for e in entries),
                      key=lambda a: _order(a['figures']))
  _compare_entries(algorithms, baseline, confidence)
  base = chosen.get(baseline)
  for group in groups.values():
    group.update(_speedups(group, base['figures'] if base else None))
  per_run = [dict(r, role='tuning' if r['seed'] in tuning else 'reporting')
             for g in groups.values() for r in g['runs']]
  order = {run.workdir: i for i, run in enumerate(runs)}
  per_run.sort(key=lambda r: order[r['workdir']])
  return {'targets': {'accuracy': target_accuracy, 'loss': target_loss, 'loss_derived': derived,
                      'loss_derived_from': derived_from},
          'time_to_target': INTERPOLATION, 'baseline': baseline if base is not None else None,
          'confidence': confidence, 'interval': INTERVAL,
          'seeds': {'all': seeds, 'tuning': tuning, 'reporting': reporting, 'sweeping': sweeping,
                    'chosen_on': 'tuning' if tuning else ('reporting' if sweeping else None)},
          'best': algorithms[0]['entry'] if algorithms else None,
          'algorithms': [{k: v for k, v in a.items() if k != 'runs'} for a in algorithms],
          'sweep': [{k: v for k, v in g.items() if k != 'runs'} for g in groups.values()],
          'runs': per_run}


def verdicts(report: dict[str, Any]) -> dict[str, str]:
  """{entry: 'faster' | 'slower' | 'tied'} against the baseline, for every entry but the baseline ({} without
  one)."""
  return {a['entry']: a['verdict'] for a in report['algorithms'] if a.get('verdict') is not None}
