"""The seed papers' scale experiments on the simulated clock: what their claims look like at 4 to 1,024 workers.

  python -m benchmarks.paper_scale wagma     # WAGMA-SGD's ResNet-50 throughput on Piz Daint, P = 4 .. 256
  python -m benchmarks.paper_scale horovod   # sync on the profile against published Horovod runs on Piz Daint
  python -m benchmarks.paper_scale dasgd     # DaSGD's scale-up, P = 8 .. 1,024, on two cluster profiles
  python -m benchmarks.paper_scale stale     # slow and stale gradients: runtime per iteration against P
  python -m benchmarks.paper_scale validate  # the collective model against held-out published tables, every cell
  python -m benchmarks.paper_scale all --figures=docs/results/figures

Only the clock runs (`experiments.simulate`): the model is sized from its shapes (no data set, nothing trained),
and every figure is a mean over `--sim_iterations` simulated iterations, for each of `--seeds` seeds (the straggler
draws), with the seeds' range. Throughput is P x (per-worker batch) / (mean seconds per iteration). Nothing here
is fitted to a paper: the profiles' figures come from hardware specifications and published measurements
(waitless/cluster/profiles/*.json, each with its source). docs/results/scale.md holds the tables and reads them.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Callable, Sequence

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags
import numpy as np

from benchmarks import cli
from benchmarks import scale_validation
from waitless import config_errors as errors
from waitless.experiments import simulate
from waitless.experiments.configs import imagenet
from waitless.experiments.configs import synthetic

_ITERATIONS = flags.DEFINE_integer('sim_iterations', 400, 'Simulated iterations per cell (a multiple of every period).')
_SEEDS = flags.DEFINE_integer('seeds', 3, 'Seeds per cell (the straggler draws); the tables show the mean and range.')
_FIGURES = flags.DEFINE_string('figures', '', 'Directory for the PNG figures ("" for none).')


def _mean_over_seeds(make_config: Callable[[int], object], iterations: int, seeds: int) -> tuple[float, float, float]:
  """(mean, min, max) over seeds of the mean seconds per iteration of `make_config(seed)`'s clock."""
  times = []
  for seed in range(seeds):
    config = make_config(seed)
    times.append(simulate.simulate(config, iterations)['mean_iteration_time'])
  return float(np.mean(times)), float(np.min(times)), float(np.max(times))


# ---- WAGMA-SGD: ResNet-50 on ImageNet, Piz Daint, two random ranks delayed 320 ms per step ----

WAGMA_SIZES = (4, 16, 64, 256)


def wagma_group_size(workers: int) -> int:
  """The paper's groups of sqrt(P), rounded down to a power of two: 4 -> 2, 16 -> 4, 64 -> 8, 256 -> 16."""
  return 1 << (int(math.log2(workers)) // 2)


def wagma_entries(workers: int) -> list[tuple[str, str]]:
  """(label, config argument) of each algorithm of the experiment at P workers."""
  return [
      ('sync (all-reduce)', 'sync'),
      ('WAGMA (S = sqrt P, tau = 10)', f'wagma,group_size={wagma_group_size(workers)},sync_every=10'),
      ('local SGD (H=1, as shipped)', 'local_sgd,local_steps=1'),
      ('local SGD (H=10)', 'local_sgd,local_steps=10'),
      ('D-PSGD (ring)', 'dpsgd'),
  ]


def wagma_profile(arg: str) -> str:
  """The stack each entry ran on: the authors' own algorithms as deep500 custom ops on the host, averaging with
  fflib3 (`piz_daint_wagma`: the model out of and back into the GPU each step, one message per tensor); the
  all-reduce baseline over Horovod and Cray MPICH (`piz_daint`). That every non-sync entry used the authors' host
  ops is read from their repository (test-models/tf-models-r1.11/official/utils/optimizer_*_imagenet.py)."""
  return 'piz_daint' if arg.split(',')[0] == 'sync' else 'piz_daint_wagma'


def wagma_config(arg: str, workers: int, seed: int, delays: bool = True):
  config = imagenet.get_config(f'{arg},workers={workers},devices={workers},seed={seed}')
  config.cluster.profile = wagma_profile(arg)
  config.stragglers.delay_draws = 'independent'  # the authors' two uniform draws per step, which may coincide
  if not delays:
    config.stragglers.kind, config.stragglers.delayed_workers, config.stragglers.delay_s = 'constant', 0, 0.0
  return config


def wagma_table(iterations: int, seeds: int) -> dict:
  """{label: {P: (images/s mean, min, max)}}, with 'sync, no delays' and 'ideal (P x one GPU)'."""
  table: dict[str, dict[int, tuple]] = {}
  for p in WAGMA_SIZES:
    batch = imagenet.get_config('sync').batch_size
    rows = wagma_entries(p) + [('sync, no delays', 'sync')]
    for label, arg in rows:
      delays = label != 'sync, no delays'
      mean, low, high = _mean_over_seeds(lambda s: wagma_config(arg, p, s, delays), iterations, seeds)
      table.setdefault(label, {})[p] = (p * batch / mean, p * batch / high, p * batch / low)
    one = _mean_over_seeds(lambda s: wagma_config('sync', 1, s, delays=False), 10, 1)[0]
    table.setdefault('ideal (P x one GPU)', {})[p] = (p * batch / one,) * 3
  return table


# ---- Synchronous SGD without stragglers against published Horovod runs on Piz Daint ----

# tf_cnn_benchmarks ResNet-50, batch 64 per GPU, synthetic data, Horovod over Cray MPICH without NCCL (TF 1.7,
# Horovod 0.15.1): images/s per node count, read from the vector data of eth-cscs/sarus
# doc/cookbook/tensorflow_horovod/horovod-results_old.pdf (+-2%), 1 node from horovod-results_new.pdf (+-1%).
HOROVOD_PIZ_DAINT = {1: 240.0, 2: 460.0, 4: 918.0, 8: 1831.0, 16: 3640.0, 32: 5608.0, 64: 9418.0, 128: 16051.0}
HOROVOD_BATCH = 64


def horovod_table(iterations: int) -> dict:
  """{P: (published images/s, simulated sync images/s)} at 64 images per GPU, no stragglers, on piz_daint."""
  out = {}
  for p, published in HOROVOD_PIZ_DAINT.items():
    config = imagenet.get_config(f'sync,workers={p},devices={p},batch_size={HOROVOD_BATCH}')
    config.cluster.profile = 'piz_daint'
    config.stragglers.kind, config.stragglers.delayed_workers, config.stragglers.delay_s = 'constant', 0, 0.0
    seconds = simulate.simulate(config, iterations)['mean_iteration_time']
    out[p] = (published, p * HOROVOD_BATCH / seconds)
  return out


# ---- DaSGD: throughput against P, two profiles ----

DASGD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
DASGD_PROFILES = ('piz_daint', 'commodity_10gbe')
DASGD_ENTRIES = (('sync', 'sync'), ('local SGD (H=4)', 'local_sgd,local_steps=4'),
                 ('DaSGD (tau=4, d=1)', 'dasgd,local_steps=4,delay=1'))
DASGD_BATCH = 32  # the authors' local batch


def dasgd_config(arg: str, workers: int, profile: str, seed: int):
  config = imagenet.get_config(f'{arg},workers={workers},devices={workers},batch_size={DASGD_BATCH},seed={seed}')
  config.cluster.profile = profile
  config.stragglers.kind, config.stragglers.delayed_workers, config.stragglers.delay_s = 'constant', 0, 0.0
  return config


def dasgd_table(iterations: int) -> dict:
  """{profile: {label: {P: images/s}}} (constant compute: one seed is every seed)."""
  out = {}
  for profile in DASGD_PROFILES:
    for label, arg in DASGD_ENTRIES:
      for p in DASGD_SIZES:
        seconds = simulate.simulate(dasgd_config(arg, p, profile, 0), iterations)['mean_iteration_time']
        out.setdefault(profile, {}).setdefault(label, {})[p] = p * DASGD_BATCH / seconds
  return out


# ---- Slow and stale gradients: exponential compute, ideal network ----

STALE_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
RATE = 1.0  # X ~ Exp(mu), mu = 1 per second


def harmonic(n: int) -> float:
  return float(np.sum(1.0 / np.arange(1, n + 1))) if n > 0 else 0.0


def stale_config(arg: str, workers: int, seed: int):
  config = synthetic.get_config(f'{arg},workers={workers},devices=8,seed={seed}')
  config.stragglers.kind, config.stragglers.rate = 'exponential', RATE
  return config


def stale_table(iterations: int, seeds: int) -> dict:
  """{P: {name: (simulated mean s/iteration, closed form)}} for sync, K-sync (K = P/2), K-batch-sync (K = P) and
  async (K-batch-async with K = 1)."""
  out = {}
  for p in STALE_SIZES:
    k = p // 2
    forms = {'sync': ('sync', harmonic(p) / RATE),
             'K-sync (K=P/2)': (f'ksync,k={k}', (harmonic(p) - harmonic(p - k)) / RATE),
             'K-batch-sync (K=P)': (f'kbatch_sync,k={p}', p / (p * RATE)),
             'async': ('async', 1.0 / (p * RATE))}
    row = {}
    for name, (arg, closed) in forms.items():
      n = iterations if name in ('sync', 'K-sync (K=P/2)') else iterations * 20
      row[name] = (_mean_over_seeds(lambda s: stale_config(arg, p, s), n, seeds)[0], closed)
    out[p] = row
  return out


# ---- printing ----

def _fmt(x: float) -> str:
  return f'{x:,.0f}' if x >= 100 else f'{x:.3g}'


def print_wagma(table: dict) -> None:
  print('| algorithm | ' + ' | '.join(f'P = {p}' for p in WAGMA_SIZES) + ' |')
  print('| --- |' + ' ---: |' * len(WAGMA_SIZES))
  for label, cells in table.items():
    print(f'| {label} | ' + ' | '.join(
        _fmt(cells[p][0]) + ('' if cells[p][1] == cells[p][2] else f' [{_fmt(cells[p][1])}, {_fmt(cells[p][2])}]')
        for p in WAGMA_SIZES) + ' |')


def print_horovod(table: dict) -> None:
  print('| P | published (Horovod, Cray MPICH) | simulated sync | simulated / published | published per GPU '
        '| all-reduce seconds the published rate implies |')
  print('| ---: | ---: | ---: | ---: | ---: | ---: |')
  one = table[1][0]
  for p, (published, simulated) in table.items():
    implied = HOROVOD_BATCH / (published / p) - HOROVOD_BATCH / one
    print(f'| {p} | {_fmt(published)} | {_fmt(simulated)} | {simulated / published:.2f} | {published / p:.0f} '
          f'| {max(implied, 0.0):.3f} |')


def print_dasgd(table: dict) -> None:
  for profile, rows in table.items():
    print(f'\n{profile}: images/s (and per worker, % of P = 8\'s per-worker rate)')
    print('| algorithm | ' + ' | '.join(f'P = {p}' for p in DASGD_SIZES) + ' |')
    print('| --- |' + ' ---: |' * len(DASGD_SIZES))
    for label, cells in rows.items():
      base = cells[DASGD_SIZES[0]] / DASGD_SIZES[0]
      print(f'| {label} | ' + ' | '.join(f'{_fmt(cells[p])} ({100 * cells[p] / p / base:.0f}%)'
                                         for p in DASGD_SIZES) + ' |')


def print_stale(table: dict) -> None:
  names = list(next(iter(table.values())))
  print('| P | ' + ' | '.join(f'{n}: simulated / closed form' for n in names) + ' | sync / async per iteration |')
  print('| ---: |' + ' ---: |' * (len(names) + 1))
  for p, row in table.items():
    ratio = row['sync'][0] / row['async'][0]
    print(f'| {p} | ' + ' | '.join(f'{sim:.4g} / {closed:.4g}' for sim, closed in row.values()) +
          f' | {ratio:.4g} (P H_P = {p * harmonic(p):.4g}) |')


def _figure(path: str, series: dict, xs: Sequence[int], ylabel: str, title: str, logy: bool = False,
            dashed: Sequence[str] = ()) -> None:
  import matplotlib
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  for label, ys in series.items():
    ax.plot(xs, ys, '--' if label in dashed else '-o', label=label, markersize=4)
  ax.set_xscale('log', base=2)
  if logy:
    ax.set_yscale('log')
  ax.set_xticks(list(xs), [str(x) for x in xs])
  ax.set_xlabel('workers P')
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# The periods of each experiment's algorithms (WAGMA's tau and local SGD's H = 10, DaSGD's tau = 4): a cell's
# iterations must hold whole periods, or local SGD with H = 10 over 7 iterations never averages.
PERIODS = {'wagma': (10,), 'dasgd': (4,), 'horovod': (), 'stale': (), 'validate': ()}


def check_flags(argv) -> str:
  """The experiment the positional argument names, after every flag is checked (one line naming the flag,
  exit 2, before any cell runs)."""
  cli.no_positionals(argv, allowed=1)
  what = argv[1] if len(argv) > 1 else 'all'
  errors.require(what in (*PERIODS, 'all'), 'experiment', what, 'one of wagma, horovod, dasgd, stale, validate, all')
  errors.require_int(_SEEDS.value, '--seeds', 1)
  periods = [p for name, ps in PERIODS.items() if what in (name, 'all') for p in ps]
  period = math.lcm(*periods) if periods else 1
  errors.require_int(_ITERATIONS.value, '--sim_iterations', 1)
  errors.require(_ITERATIONS.value % period == 0, '--sim_iterations', _ITERATIONS.value,
                 f'must be a multiple of {period} (every period of the {what} experiment'
                 f'{"s" if what == "all" else ""}: {", ".join(map(str, periods))})')
  if _FIGURES.value:
    cli.output_directory(_FIGURES.value, '--figures')
  return what


def main(argv):
  what = check_flags(argv)
  if what == 'validate':
    print('## The collective model against held-out published tables (benchmarks/published_tables.json)\n')
    scale_validation.print_validation(*scale_validation.validate())
    return
  figures = _FIGURES.value
  if what in ('wagma', 'all'):
    print(f'## WAGMA-SGD: ResNet-50 images/s on Piz Daint (sync on piz_daint, the others on piz_daint_wagma), 128 '
          f'images per worker, two random ranks delayed 320 ms per step (mean [range] over {_SEEDS.value} seeds, '
          f'{_ITERATIONS.value} iterations each)\n')
    table = wagma_table(_ITERATIONS.value, _SEEDS.value)
    print_wagma(table)
    if figures:
      _figure(os.path.join(figures, 'scale_wagma.png'),
              {k: [v[p][0] / p for p in WAGMA_SIZES] for k, v in table.items() if k != 'local SGD (H=1, as shipped)'},
              WAGMA_SIZES, 'images/s per GPU', 'ResNet-50 on Piz Daint (simulated), 2 ranks delayed 320 ms per step\n'
              '(sync on Horovod over MPI, the others on WAGMA\'s host ops; local SGD H = 1: the table)',
              dashed=('ideal (P x one GPU)',))
  if what in ('horovod', 'all'):
    print(f'\n## Sync SGD on piz_daint without stragglers, {HOROVOD_BATCH} images per GPU, against published Horovod '
          'runs on Piz Daint\n')
    print_horovod(horovod_table(_ITERATIONS.value))
  if what in ('dasgd', 'all'):
    print(f'\n## DaSGD: ResNet-50 images/s against P, {DASGD_BATCH} images per worker, constant compute')
    table = dasgd_table(_ITERATIONS.value)
    print_dasgd(table)
    if figures:
      series = {f'{label}, {profile}': [table[profile][label][p] / p for p in DASGD_SIZES]
                for profile in table for label in table[profile]}
      _figure(os.path.join(figures, 'scale_dasgd.png'), series, DASGD_SIZES, 'images/s per worker',
              'ResNet-50, 32 images per worker, constant compute (simulated)')
  if what in ('stale', 'all'):
    print(f'\n## Slow and stale gradients: mean seconds per iteration, X ~ Exp({RATE:g}/s), ideal network '
          f'({_SEEDS.value} seeds)\n')
    table = stale_table(_ITERATIONS.value, _SEEDS.value)
    print_stale(table)
    if figures:
      names = list(next(iter(table.values())))
      series = {n: [table[p][n][0] for p in STALE_SIZES] for n in names}
      series.update({f'{n} (closed form)': [table[p][n][1] for p in STALE_SIZES] for n in names})
      _figure(os.path.join(figures, 'scale_stale.png'), series, STALE_SIZES, 'seconds per iteration',
              'Exp(1) compute, ideal network: simulated and closed forms', logy=True,
              dashed=[f'{n} (closed form)' for n in names])


if __name__ == '__main__':
  cli.run(main)
