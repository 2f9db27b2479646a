"""A comparison's figures: every run's from its own metrics.jsonl and summary.json, then over seeds.

Times to target are interpolated linearly between the two evaluations around the crossing (`crossing`), so
they are not quantised by `eval_every`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Sequence

from experiments.compare_plan import PlannedRun
from experiments.compare_runs import SUMMARY_FILE
from experiments.compare_runs import run_status

INTERPOLATION = 'linear interpolation between the two evaluations around the crossing'


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

