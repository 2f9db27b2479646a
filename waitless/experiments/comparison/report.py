"""A comparison's report: comparison.md (the table), comparison.json (the figures), comparison_intervals.png (the
time to target per entry) and comparison.png (the curves), and what `experiments.compare` prints (`terminal`).

The figures and their definitions (medians with bootstrap intervals, censoring, probability of improvement,
verdicts, tuning seeds) are `experiments.comparison.statistics`'; the table states them in its notes; the pictures
are `experiments.comparison.plots`'.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

from waitless.experiments.harness import atomic_files
from waitless.experiments.comparison import plots
from waitless.experiments.comparison import statistics
from waitless.experiments.comparison.plan import PlannedRun
from waitless.experiments.comparison.plan import sweep_label

log = logging.getLogger('waitless')

MARKDOWN = 'comparison.md'
INTERVALS_PNG = 'comparison_intervals.png'
CURVES_PNG = 'comparison.png'


def _number(figure: dict[str, Any], name: str, fmt: str, scale: float = 1.0) -> str:
  """One statistic of a figure: a number, '> x' where it depends on censored seeds, '-' where there is none."""
  if figure.get(name) is not None:
    return fmt.format(figure[name] * scale)
  if figure.get(f'{name}_above') is not None:
    return '> ' + fmt.format(figure[f'{name}_above'] * scale)
  return '-'


def _cell(figure: dict[str, Any], fmt: str = '{:.3g}', scale: float = 1.0, interval: bool = True) -> str:
  """'median [low, high]', with '(k/N missed)' for censored seeds and '(n/N)' for seeds left out."""
  if not figure['of']:
    return '-'
  if figure['censored'] == figure['n']:
    return 'not reached'
  if figure['median'] is None and figure.get('median_above') is None:
    return '-'
  text = _number(figure, 'median', fmt, scale)
  if interval and figure['n'] > 1:
    text += f' [{_number(figure, "low", fmt, scale)}, {_number(figure, "high", fmt, scale)}]'
  if figure['censored']:
    text += f' ({figure["censored"]}/{figure["n"]} missed)'
  if figure['n'] < figure['of']:
    text += f' ({figure["n"]}/{figure["of"]})'
  return text


def _bytes(figure: dict[str, Any]) -> str:
  median = figure['median']
  if median is None:
    return '-'
  unit, scale = next(((u, s) for u, s in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)) if median >= s), ('B', 1.0))
  return _cell(figure, '{:.3g}', 1 / scale, interval=False) + f' {unit}'


def _probability(p: Optional[dict[str, Any]]) -> str:
  """'0.80 [0.40, 1.00]'."""
  if not p or p['p'] is None:
    return '-'
  return f'{p["p"]:.2f}' + (f' [{p["low"]:.2f}, {p["high"]:.2f}]' if p['low'] is not None else '')


def _label(group: dict[str, Any], label: str) -> str:
  failed = [s for s in group['statuses'] if s in ('diverged', 'stalled', 'unfinished')]
  return label + (f' ({", ".join(failed)})' if failed else '')


def _figures(group: dict[str, Any]) -> list[str]:
  """The cells every table has, after the times to target."""
  f = group['figures']
  speedup = f'{group["speedup"]:.2f}x' if group['speedup'] is not None else '-'
  return [_cell(f['final_eval_accuracy'], '{:.4f}'), _cell(f['final_eval_loss'], '{:.4f}'),
          _cell(f['sim_time'], interval=False), _cell(f['idle_fraction'], '{:.2f}', interval=False),
          _cell(f['staleness'], '{:.2f}', interval=False), _bytes(f['bytes_communicated']), speedup]


def _row(algorithm: dict[str, Any], label: str, baseline: Optional[str]) -> list[str]:
  """A row of the main table: an entry at its chosen point over the reporting seeds."""
  f = algorithm['figures']
  beats = (algorithm['beats_baseline'] or {}).get('time_to_target_accuracy')
  versus = 'baseline' if algorithm['entry'] == baseline else (algorithm['verdict'] or '-')
  return [_label(algorithm, label), _cell(f['time_to_target_accuracy']),
          _probability(beats) if algorithm['entry'] != baseline else '-', versus, algorithm['against_best'],
          _cell(f['time_to_target_loss']), *_figures(algorithm)]


def _sweep_row(group: dict[str, Any], label: str) -> list[str]:
  f = group['figures']
  return [_label(group, label), _cell(f['time_to_target_accuracy']), _cell(f['time_to_target_loss']),
          *_figures(group)]


def seeds_note(report: dict[str, Any]) -> str:
  """Which seeds chose each entry's sweep point and which are reported."""
  s = report['seeds']
  reporting = f'{len(s["reporting"])} reporting seed(s) ({plots.seeds_text(s["reporting"])})'
  if s['tuning']:
    return (f'Tuning: {plots.seeds_text(s["tuning"])} chose each entry\'s sweep point; every figure of this table '
            f'is over the other {reporting}.')
  if s['sweeping']:
    return (f'Figures over {reporting}. Each entry\'s sweep point was chosen on these same seeds (no '
            '--tuning_seeds): that selection is optimistic, the chosen point\'s figures favour it.')
  return f'Figures over {reporting} (no sweep: nothing was chosen).'


def _notes(report: dict[str, Any], loss_target: str) -> list[str]:
  t = report['targets']
  level = f'{report["confidence"]:.0%}'
  base = report['baseline'] or '(no baseline)'
  loss_note = {
      'reached': ' (derived: the highest of the lowest eval losses of the runs that reached the target accuracy, '
                 'a level each of them reached)',
      'all': ' (derived: no run reached the target accuracy, so it is the highest of the lowest eval losses of all '
             'the runs that did not diverge, a level each of them reached)',
  }.get(t.get('loss_derived_from'), ' (derived: no run has an eval loss)' if t['loss_derived'] else '')
  return [
      seeds_note(report), '',
      f'Times: median over seeds [{level} interval: {report["interval"]}]. A seed that misses a target is '
      f'censored at its budget (its simulated time), not dropped: it counts as slower than every seed that '
      f'reached it; (k/N missed): k of the N seeds missed. "> x": the median or interval end depends on censored '
      f'seeds, and exceeds x (its value with each censored seed at its budget); not reached: no seed reached it. '
      f'Simulated seconds, to target by {report["time_to_target"]}. Target loss {loss_target}{loss_note}.', '',
      f'P(beats {base}): probability of improvement (Agarwal et al. 2021) on paired seeds (a seed is the same '
      f'straggler trace, data order and initial parameters for every entry): the share of seeds on which this '
      f'entry reached the target accuracy before {base} did on the same seed, a tie (both missed) counting '
      f'half [{level} interval, seeds resampled in pairs]. vs {base}: faster if that interval lies above 0.5, '
      f'slower if below, else tied. vs best: the same probability against the first row (the lowest median time '
      f'to target accuracy): tied if its interval contains 0.5 (the seeds cannot order the two), behind if it '
      f'lies below 0.5, ahead if above (ahead on paired seeds despite a higher median). With one seed there is '
      f'no interval: tied. A percentile bootstrap is no wider than the seeds\' own spread: with few seeds, an '
      f'entry that wins on every seed gets [1.00, 1.00].', '',
      f'Final acc and loss: median [{level} interval]; sim time, idle, staleness, bytes: medians. idle: mean over '
      f'iterations of the share of worker time spent waiting in the iteration (not weighted by its length: a '
      f'waiting iteration is longer); staleness: mean staleness of applied contributions (iterations); bytes: all '
      f'workers together; speed-up: median time to target accuracy of {base} / this one\'s. Rows from the fastest '
      f'to target accuracy (then the lowest final loss).', '']


def _columns(report: dict[str, Any], loss_target: str) -> tuple[list[str], list[str]]:
  """The time-to-target column and the columns after the verdicts."""
  times = [f'time to acc >= {report["targets"]["accuracy"]:g} (s)']
  rest = [f'time to loss <= {loss_target} (s)', 'final acc', 'final loss', 'sim time (s)', 'idle', 'staleness',
          'bytes', 'speed-up']
  return times, rest


def _main_table(report: dict[str, Any], loss_target: str) -> list[str]:
  """The verdict table: one row per entry at its chosen point, fastest first."""
  base = report['baseline'] or '(no baseline)'
  times, rest = _columns(report, loss_target)
  header = ['algorithm', *times, f'P(beats {base})', f'vs {base}', 'vs best', *rest]
  rows = [_row(a, a['entry'] + (f' @ {sweep_label(a["best_sweep"].items())}' if a['best_sweep'] else ''),
               report['baseline']) for a in report['algorithms']]
  return _table(header, rows)


def markdown(report: dict[str, Any], title: str) -> str:
  """The table of `summarize`'s report."""
  t = report['targets']
  loss_target = f'{t["loss"]:.4g}' if t['loss'] is not None else '-'
  base = report['baseline'] or '(no baseline)'
  times, rest = _columns(report, loss_target)
  lines = [f'# {title}', '', *_notes(report, loss_target), *_main_table(report, loss_target)]
  if report['seeds']['sweeping']:
    chosen_on = report['seeds']['tuning'] or report['seeds']['reporting']
    which = 'tuning' if report['seeds']['tuning'] else 'reporting'
    lines += ['', '## Every sweep point', '',
              f'Over the {which} {plots.seeds_text(chosen_on)}: the figures each entry\'s point was chosen on (the '
              'lowest median time to target accuracy, censored seeds included, then the lowest median final loss); '
              f'speed-up against {base} at its chosen point on the same seeds.', '']
    lines += _table(['algorithm', *times, *rest], [_sweep_row(g, f'{g["entry"]} @ {sweep_label(g["sweep"].items())}')
                                                    for g in report['sweep']])
  lines += ['', '## Runs', '', '| run | status | time to acc (s) | at eval (summary.json) | final acc | final loss '
            '| sim time (s) | workdir |', '| --- | --- | --- | --- | --- | --- | --- | --- |']
  fmt = lambda v, f='{:.4g}': '-' if v is None else f.format(v)
  for r in report['runs']:
    point = f' @ {sweep_label(r["sweep"].items())}' if r['sweep'] else ''
    role = ' (tuning)' if r['role'] == 'tuning' else ''
    lines.append(f'| {r["entry"]}{point} seed {r["seed"]}{role} | {r["status"]} '
                 f'| {fmt(r["time_to_target_accuracy"])} | {fmt(r["time_to_target_at_eval"])} '
                 f'| {fmt(r["final_eval_accuracy"], "{:.4f}")} | {fmt(r["final_eval_loss"], "{:.4f}")} '
                 f'| {fmt(r["sim_time"])} | `{r["workdir"]}` |')
  return '\n'.join(lines) + '\n'


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
  return ['| ' + ' | '.join(header) + ' |', '|' + ' --- |' * len(header)] + ['| ' + ' | '.join(r) + ' |' for r in rows]


def _with_runs(report):
  """The report's sweep groups with their runs on the reporting seeds (grouped again from `runs`)."""
  out = []
  reporting = set(report['seeds']['reporting'])
  for g in report['sweep']:
    runs = [r for r in report['runs'] if r['entry'] == g['entry'] and r['sweep'] == g['sweep']
            and r['seed'] in reporting]
    out.append(dict(g, runs=runs))
  return out


def write_report(runs: Sequence[PlannedRun], root: str, title: str, target_accuracy: float,
                 target_loss: Optional[float] = None, baseline: str = 'sync',
                 skipped: Optional[dict[str, str]] = None, tuning_seeds: int = 0,
                 confidence: float = statistics.CONFIDENCE) -> dict[str, Any]:
  """Writes comparison.md / .json / .png in `root`; returns the report (what comparison.json holds)."""
  report = statistics.summarize(runs, target_accuracy, target_loss, baseline, tuning_seeds, confidence)
  report['title'] = title
  report['skipped'] = dict(skipped or {})
  text = markdown(report, title)
  if skipped:
    text += '\n## Not run\n\n' + ''.join(f'- {e}: {why}\n' for e, why in skipped.items())
  os.makedirs(root, exist_ok=True)
  atomic_files.write_text(os.path.join(root, MARKDOWN), text)
  atomic_files.write_json(os.path.join(root, 'comparison.json'), report, indent=1)
  groups = {(g['entry'], tuple(sorted(g['sweep'].items()))): g for g in _with_runs(report)}
  runs_of = lambda a: groups[(a['entry'], tuple(sorted(a['sweep'].items())))]['runs']
  report['intervals_png'] = plots.intervals(report, os.path.join(root, INTERVALS_PNG), title)
  report['png'] = plots.curves(report, runs_of, os.path.join(root, CURVES_PNG), title)
  return report


def terminal(report: dict[str, Any], root: str) -> str:
  """What `experiments.compare` prints at its end: the title, the seeds, the verdict table, the entries not run,
  and the paths of the files (the notes, every sweep point and the list of runs are in comparison.md)."""
  t = report['targets']
  lines = [f'# {report["title"]}', '', seeds_note(report), '',
           *_main_table(report, f'{t["loss"]:.4g}' if t['loss'] is not None else '-'), '']
  lines += [f'not run: {entry}: {why}' for entry, why in report['skipped'].items()]
  files = [(MARKDOWN, f'the table, its notes{", every sweep point" if report["seeds"]["sweeping"] else ""} and '
                      f'the {len(report["runs"])} runs'),
           ('comparison.json', 'every figure, interval and verdict'),
           (INTERVALS_PNG, 'time to target per entry, with intervals and verdicts'),
           (CURVES_PNG, 'loss and accuracy curves')]
  written = {INTERVALS_PNG: report.get('intervals_png'), CURVES_PNG: report.get('png')}
  lines += [f'{what}: {os.path.join(root, name)}' for name, what in files if written.get(name, True)]
  return '\n'.join(lines)

