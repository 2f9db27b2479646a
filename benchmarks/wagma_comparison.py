"""WAGMA-SGD against sync and local SGD on the embedded digits data, and what staleness costs WAGMA.

  python benchmarks/wagma_comparison.py --workdir=/tmp/wagma_runs [--seeds=3] [--table=stragglers|noise|both]

Table `stragglers` (WAGMA's setting): 16 workers on 8 devices, lognormal compute (median 10 ms, sigma 0.02) and
2 random workers delayed 30 ms (3 steps) in every iteration; sync, local SGD (H = 4 and H = 10), WAGMA
(S = 4, tau = 10) and its ablations `fixed_groups=True` and `wait_avoiding=False`. Table `noise`: WAGMA and sync
under constant compute, 2 % and 20 % lognormal noise, no delays. Each cell is the mean over seeds of
`time_to_target` (simulated seconds to eval accuracy >= target, eval every 10 steps), final accuracy and, for
WAGMA, the fresh share of group contributions; the speed-up is sync's time to target over the row's.
Every run is one `python -m waitless.experiments.main` command, printed before the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

BASE = 'workers=16,devices=8,eval_every=10,target_accuracy=0.95'
STRAGGLERS = 'stragglers.kind=lognormal,stragglers.sigma=0.02,stragglers.delayed_workers=2,stragglers.delay_s=0.03'
ROWS = {
    'stragglers': [
        ('sync', 'sync', STRAGGLERS, ''),
        ('local_sgd H=4', 'local_sgd,local_steps=4', STRAGGLERS, ''),
        ('local_sgd H=10', 'local_sgd,local_steps=10', STRAGGLERS, ''),
        ('wagma S=4 tau=10', 'wagma', STRAGGLERS, ''),
        ('wagma fixed_groups', 'wagma,fixed_groups=True', STRAGGLERS, ''),
        ('wagma wait_avoiding=False', 'wagma,wait_avoiding=False', STRAGGLERS, ''),
    ],
    'noise': [
        (f'{name} {label}', alg, noise, label)
        for label, noise in (('constant', 'stragglers.kind=constant'),
                             ('2% lognormal', 'stragglers.kind=lognormal,stragglers.sigma=0.02'),
                             ('20% lognormal', 'stragglers.kind=lognormal,stragglers.sigma=0.2'))
        for name, alg in (('sync', 'sync'), ('wagma', 'wagma'))
    ],
}


def run(workdir: str, alg: str, extra: str, seed: int) -> dict:
  arg = f'{alg},{BASE},{extra},seed={seed}'
  out = os.path.join(workdir, arg.replace(',', '_').replace('=', '-').replace('.', ''))
  command = [sys.executable, '-m', 'waitless.experiments.main', f'--config=experiments/configs/digits.py:{arg}',
             f'--workdir={out}']
  print('python ' + ' '.join(command[1:]), flush=True)
  if not os.path.exists(os.path.join(out, 'summary.json')):
    subprocess.run(command, check=True, capture_output=True)
  with open(os.path.join(out, 'summary.json')) as f:
    summary = json.load(f)
  fresh = []
  with open(os.path.join(out, 'metrics.jsonl')) as f:
    for line in f:
      row = json.loads(line)
      if 'fresh_share' in row:
        fresh.append(row['fresh_share'])
  summary['fresh_share'] = float(np.mean(fresh)) if fresh else None
  return summary


def table(workdir: str, rows, seeds: int) -> str:
  results = {(name, group): [run(workdir, alg, extra, s) for s in range(seeds)] for name, alg, extra, group in rows}
  lines = ['| run | time to 95% (s, mean [per seed]) | speed-up vs sync | final accuracy | sim time of 300 steps (s) '
           '| fresh share |', '| --- | --- | --- | --- | --- | --- |']
  reference = {}
  for (name, group), summaries in results.items():
    ttt = [s['time_to_target'] for s in summaries]
    mean = float(np.mean(ttt)) if None not in ttt else None
    if name.startswith('sync'):  # the first row of its group
      reference[group] = mean
    base = reference.get(group)
    speedup = f'{base / mean:.2f}x' if base and mean else '-'
    per_seed = ', '.join('-' if t is None else f'{t:.2f}' for t in ttt)
    acc = np.mean([s['final_eval_accuracy'] for s in summaries])
    sim = np.mean([s['sim_time'] for s in summaries])
    fresh = [s['fresh_share'] for s in summaries]
    fresh = f'{np.mean(fresh):.3f}' if name.startswith('wagma') and None not in fresh else '-'
    lines.append(f'| {name} | {"-" if mean is None else f"{mean:.2f}"} [{per_seed}] | {speedup} | {acc:.4f} '
                 f'| {sim:.2f} | {fresh} |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--workdir', default='/tmp/wagma_runs')
  parser.add_argument('--seeds', type=int, default=3)
  parser.add_argument('--table', default='both', choices=('stragglers', 'noise', 'both'))
  args = parser.parse_args()
  for name in ('stragglers', 'noise') if args.table == 'both' else (args.table,):
    print(table(args.workdir, ROWS[name], args.seeds))


if __name__ == '__main__':
  main()
