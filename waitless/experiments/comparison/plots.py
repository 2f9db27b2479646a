"""A comparison's pictures: the time to target per entry with its interval, and the curves.

`intervals` (comparison_intervals.png) is the picture a reader wants first, drawn as rliable's
`plot_interval_estimates` draws aggregate metrics (Agarwal et al. 2021): one row per entry, sorted as the table
(fastest first), a bar over the bootstrap interval of the median time to the target accuracy with a tick at the
median, coloured by the verdict against the baseline (faster, slower, tied; the baseline marked); beside it the
probability of beating the baseline with its interval and the 0.5 line. A median or interval end that depends on
seeds that missed the target is a lower bound: its bar ends in an arrow at that bound.

`curves` (comparison.png) keeps each entry's median eval loss and accuracy against simulated time and against
steps, shaded by the pointwise bootstrap interval of the median, in rows of at most `PER_ROW` entries (in the
table's order, the baseline repeated in every row as the reference) so that a panel stays legible.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

from waitless.experiments.comparison import statistics
from waitless.experiments.harness import atomic_files

log = logging.getLogger('waitless')

PER_ROW = 6  # entries per row of curves: beyond, ten colours and overlapping bands blur
VERDICT_COLORS = {'faster': 'tab:green', 'slower': 'tab:red', 'tied': 'tab:gray', 'baseline': 'black',
                  None: 'tab:blue'}  # None: no baseline to judge against


def _pyplot():
  try:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
  except ImportError:
    log.info('matplotlib is not installed: no plots')
    return None
  return plt


def seeds_text(seeds) -> str:
  """'seeds 0-4' or 'seeds 0, 2' or 'seed 3'."""
  if len(seeds) == 1:
    return f'seed {seeds[0]}'
  if list(seeds) == list(range(seeds[0], seeds[-1] + 1)):
    return f'seeds {seeds[0]}-{seeds[-1]}'
  return 'seeds ' + ', '.join(str(s) for s in seeds)


def label(a: dict[str, Any]) -> str:
  """An entry's name with its chosen sweep point, short."""
  short = ','.join(f'{k.rsplit(".", 1)[-1]}={v}' for k, v in (a.get('best_sweep') or {}).items())
  return a['entry'] + (f' ({short})' if short else '')


def _verdict(a: dict[str, Any], baseline: Optional[str]) -> Optional[str]:
  return 'baseline' if a['entry'] == baseline else a.get('verdict')


def _bound(figure: dict[str, Any], name: str) -> tuple[Optional[float], bool]:
  """(value, is a lower bound) of a statistic: the number, or its censored bound."""
  if figure.get(name) is not None:
    return figure[name], False
  return figure.get(f'{name}_above'), True


def intervals(report: dict[str, Any], path: str, title: str) -> Optional[str]:
  """comparison_intervals.png: the time to the target accuracy per entry and P(beats baseline), with intervals."""
  plt = _pyplot()
  if plt is None:
    return None
  algorithms, baseline = report['algorithms'], report['baseline']
  n = len(algorithms)
  fig, (times, wins) = plt.subplots(1, 2, figsize=(13, 1.2 + 0.42 * max(n, 2)), sharey=True,
                                    gridspec_kw={'width_ratios': [3, 2]})
  budget = max((r['sim_time'] for r in report['runs'] if r.get('sim_time') is not None), default=1.0)
  for y, a in enumerate(algorithms):
    color = VERDICT_COLORS[_verdict(a, baseline)]
    f = a['figures']['time_to_target_accuracy']
    median, median_censored = _bound(f, 'median')
    low, _ = _bound(f, 'low')
    high, high_censored = _bound(f, 'high')
    if f['censored'] == f['n'] or median is None:
      times.text(0.0, y, f'  not reached ({f["censored"]}/{f["n"]} missed)', va='center', color=color)
    else:
      low = median if low is None else low
      high = median if high is None else high
      times.barh(y, max(high - low, budget * 2e-3), left=low, height=0.6, color=color, alpha=0.75)
      times.vlines(median, y - 0.3, y + 0.3, color='black', lw=2)
      if high_censored or median_censored:  # a lower bound: the interval goes on beyond it
        times.annotate('', xy=(high + 0.06 * budget, y), xytext=(high, y),
                       arrowprops={'arrowstyle': '->', 'color': color, 'lw': 1.5})
      if f['censored']:
        times.text(high + 0.07 * budget, y, f'{f["censored"]}/{f["n"]} missed', va='center', fontsize=8)
    p = (a.get('beats_baseline') or {}).get('time_to_target_accuracy')
    if a['entry'] == baseline:
      wins.text(0.5, y, 'baseline', va='center', ha='center', fontsize=9)
    elif p and p.get('p') is not None:
      p_low = p['p'] if p.get('low') is None else p['low']
      p_high = p['p'] if p.get('high') is None else p['high']
      wins.barh(y, p_high - p_low, left=p_low, height=0.6, color=color, alpha=0.75)
      wins.plot([p['p']], [y], marker='o', color=color, markeredgecolor='black', ms=7)  # seen at [1.00, 1.00] too
  names = [label(a) + ('  [baseline]' if a['entry'] == baseline else '') for a in algorithms]
  times.set_yticks(range(n), names)
  for tick, a in zip(times.get_yticklabels(), algorithms):
    if a['entry'] == baseline:
      tick.set_fontweight('bold')
  times.invert_yaxis()  # fastest on top, as the table
  times.set_xlim(left=0)
  level = f'{report["confidence"]:.0%}'
  times.set_xlabel(f'median time to eval accuracy >= {report["targets"]["accuracy"]:g} '
                   f'(simulated s), {level} interval')
  wins.axvline(0.5, color='grey', ls='--', lw=1)
  wins.set_xlim(-0.03, 1.03)
  wins.set_xlabel(f'P(beats {baseline}) on paired seeds, {level} interval' if baseline
                  else 'no baseline among the entries')
  for ax in (times, wins):
    ax.grid(axis='x', alpha=0.3)
    for side in ('top', 'right'):
      ax.spines[side].set_visible(False)
  if baseline:  # without one there is no verdict to colour (matplotlib warns on handles without labels)
    handles = [plt.Rectangle((0, 0), 1, 1, color=VERDICT_COLORS[v], alpha=0.75)
               for v in ('faster', 'tied', 'slower', 'baseline')]
    fig.legend(handles, [f'faster than {baseline}', 'tied', 'slower', 'baseline'],
               loc='upper center', ncol=4, frameon=False, bbox_to_anchor=(0.5, 0.0))
  fig.suptitle(f'{title}\nover {seeds_text(report["seeds"]["reporting"])}; black tick, dot: median; arrow: a lower '
               'bound (seeds that missed the target count at their budget)', fontsize=11)
  fig.tight_layout()
  atomic_files.save_figure(fig, path, dpi=110, bbox_inches='tight')
  plt.close(fig)
  return path


def _curve(runs: list[dict[str, Any]], x: str, key: str, confidence: float):
  """(grid, median, low, high) of `key` against `x` over the runs' seeds, low and high the pointwise bootstrap
  interval of the median (None with one seed); None when no run has `key`."""
  import numpy as np
  from waitless.experiments.harness import metrics_io
  series = []
  for record in runs:
    rows = [r for r in metrics_io.read_rows(record['workdir']) if r.get(key) is not None and math.isfinite(r[key])]
    if rows:
      series.append((np.array([r[x] for r in rows], float), np.array([r[key] for r in rows], float)))
  if not series:
    return None
  end = min(s[0][-1] for s in series)  # where every seed has data
  grid = np.unique(np.concatenate([s[0][s[0] <= end] for s in series]))
  values = np.stack([np.interp(grid, xs, ys) for xs, ys in series])
  if len(series) < 2:
    return grid, values[0], None, None
  low, high = statistics.median_interval(values, confidence, axis=0, n_resamples=statistics.PLOT_RESAMPLES)
  return grid, np.median(values, axis=0), low, high


def rows_of_entries(algorithms: list[dict[str, Any]], baseline: Optional[str]) -> list[list[dict[str, Any]]]:
  """The entries in rows of at most PER_ROW (table order), the baseline added to every row it is not in."""
  base = next((a for a in algorithms if a['entry'] == baseline), None)
  others = [a for a in algorithms if a is not base]
  per_row = PER_ROW - (base is not None)
  chunks = [others[i:i + per_row] for i in range(0, len(others), per_row)] or [[]]
  if base is None:
    return chunks
  return [sorted([base, *chunk], key=algorithms.index) for chunk in chunks]


_PANELS = (('sim_time', 'eval_loss'), ('sim_time', 'eval_accuracy'), ('step', 'eval_loss'), ('step', 'eval_accuracy'))


def curves(report: dict[str, Any], runs_of, path: str, title: str) -> Optional[str]:
  """comparison.png: eval loss and accuracy against simulated time and steps, a row of panels per group of
  entries (`rows_of_entries`). `runs_of(entry record)`: the reporting seeds' run records of its chosen point."""
  plt = _pyplot()
  if plt is None:
    return None
  baseline = report['baseline']
  rows = rows_of_entries(report['algorithms'], baseline)
  fig, axes = plt.subplots(len(rows), 4, figsize=(22, 4.3 * len(rows)), squeeze=False)
  colors = plt.get_cmap('tab10')
  steps = [r['steps'] for r in report['runs'] if r.get('steps')]
  log_steps = bool(steps) and max(steps) > 5 * min(steps)  # a --sim_time budget: tens to thousands of iterations
  t = report['targets']
  for row, entries in enumerate(rows):
    for i, a in enumerate(entries):
      is_base = a['entry'] == baseline
      style = {'color': 'black' if is_base else colors(i % 10), 'lw': 2.4 if is_base else 1.8,
               'ls': '--' if is_base else '-'}
      for col, (x, key) in enumerate(_PANELS):
        curve = _curve(runs_of(a), x, key, report['confidence'])
        if curve is None:
          continue
        grid, median, low, high = curve
        ax = axes[row][col]
        ax.plot(grid, median, **style, label=label(a) + (' [baseline]' if is_base else '') if col == 0 else None)
        if low is not None:
          ax.fill_between(grid, low, high, color=style['color'], alpha=0.12, lw=0)
    for col, (x, key) in enumerate(_PANELS):
      ax = axes[row][col]
      if key == 'eval_loss':
        ax.set_yscale('log')
        ax.set_ylabel('eval loss (log scale)')
        if t['loss'] is not None:
          ax.axhline(t['loss'], color='grey', ls=':', lw=1)
      else:
        ax.set_ylabel('eval accuracy')
        ax.axhline(t['accuracy'], color='grey', ls=':', lw=1)
        ax.set_ylim(top=1.0)
      if x == 'step' and log_steps:
        ax.set_xscale('log')
      ax.set_xlabel('simulated time (s)' if x == 'sim_time' else 'steps (iterations)' + (', log scale'
                                                                                          if log_steps else ''))
      ax.grid(alpha=0.3)
    axes[row][3].legend(*axes[row][0].get_legend_handles_labels(), loc='center left', bbox_to_anchor=(1.02, 0.5),
                        fontsize=9, frameon=False, title='fastest to target first' if row == 0 else None)
  seeds = report['seeds']['reporting']
  spread = (f'median of {len(seeds)} reporting seeds ({seeds_text(seeds)}), shaded: the pointwise '
            f'{report["confidence"]:.0%} bootstrap interval of the median ({statistics.PLOT_RESAMPLES} resamples)'
            if len(seeds) > 1 else f'one reporting seed ({seeds_text(seeds)})')
  grouped = f'; {PER_ROW} entries a row at most, the baseline (black, dashed) in every row' if len(rows) > 1 else ''
  fig.suptitle(f'{title}\n{spread}; dotted: targets{grouped}', fontsize=12)
  fig.tight_layout()
  atomic_files.save_figure(fig, path, dpi=100, bbox_inches='tight')
  plt.close(fig)
  return path
