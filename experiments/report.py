"""A comparison's report: comparison.md (the table), comparison.json (the figures), comparison.png (the curves)."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Optional, Sequence

from experiments.compare_plan import PlannedRun
from experiments.compare_plan import sweep_label
from experiments.statistics import summarize

log = logging.getLogger('waitless')


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

