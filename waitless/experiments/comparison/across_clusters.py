"""Which verdicts depend on the cluster: the same comparisons run on several cluster profiles, side by side.

  python -m waitless.experiments.comparison.across_clusters runs/reproduce_dgx_h100 runs/reproduce_commodity_10gbe

Each argument is a directory of comparisons (`launch/reproduce.sh DIR` with `PROFILE=NAME`: one `TABLE/comparison.json`
per table). For every table present in all of them and every entry, prints the entry's verdict against the
table's baseline and its speed-up (ratio of median times to target accuracy) under each, and marks the rows whose
verdict differs between clusters. Reads the files `experiments.compare` wrote; trains nothing.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def load(directory: str) -> dict[str, dict[str, Any]]:
  """table name -> its comparison.json, for every TABLE/comparison.json under `directory`."""
  tables = {}
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name, 'comparison.json')
    if os.path.isfile(path):
      with open(path) as f:
        tables[name] = json.load(f)
  return tables


def profile_of(report: dict[str, Any]) -> str:
  """The cluster profile a comparison's title names ('no profile' when none)."""
  title = report.get('title', '')
  marker = 'cluster profile '
  if marker not in title or 'no cluster profile' in title:  # compare's title: 'no cluster profile (configured ...)'
    return 'no profile'
  return title.split(marker, 1)[1].split(',')[0].strip()


def _cell(entry: dict[str, Any] | None) -> str:
  if entry is None:
    return 'absent'
  if entry.get('verdict') in (None, 'baseline'):
    return 'baseline'
  speedup = entry.get('speedup')
  return f'{entry["verdict"]}' + (f' ({speedup:.2f}x)' if speedup else '')


def rows(reports: list[dict[str, dict[str, Any]]]) -> list[tuple[str, str, list[str], bool]]:
  """(table, entry, a cell per cluster, whether the verdicts differ) for the tables every directory holds."""
  out = []
  common = sorted(set.intersection(*(set(r) for r in reports)))
  for table in common:
    entries = []
    for report in reports:
      for a in report[table]['algorithms']:
        if a['entry'] not in entries:
          entries.append(a['entry'])
    for entry in entries:
      found = [next((a for a in r[table]['algorithms'] if a['entry'] == entry), None) for r in reports]
      cells = [_cell(a) for a in found]
      verdicts = {c.split(' ')[0] for c in cells}
      out.append((table, entry, cells, len(verdicts) > 1))
  return out


def markdown(directories: list[str]) -> str:
  reports = [load(d) for d in directories]
  for d, r in zip(directories, reports):
    if not r:
      raise SystemExit(f'error: {d} holds no TABLE/comparison.json')
  names = [profile_of(next(iter(r.values()))) for r in reports]
  lines = ['| table | entry | ' + ' | '.join(names) + ' | depends on the cluster |',
           '| --- | --- | ' + ' | '.join('---' for _ in names) + ' | --- |']
  for table, entry, cells, differs in rows(reports):
    baseline = reports[0][table].get('baseline', '')
    lines.append(f'| {table} (vs {baseline}) | {entry} | ' + ' | '.join(cells) + f' | {"**yes**" if differs else ""} |')
  return '\n'.join(lines)


def main(argv: list[str]) -> int:
  if len(argv) < 2:
    print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
    print('error: give two or more directories of comparisons (launch/reproduce.sh DIR, each with its PROFILE)',
          file=sys.stderr)
    return 2
  print(markdown(argv))
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
