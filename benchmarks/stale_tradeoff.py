"""Error-runtime trade-off of the parameter-server family on digits: loss against simulated time.

  python -m benchmarks.stale_tradeoff --workdir=/tmp/stale_tradeoff            # the default set, ~2 min on 2 cores
  python -m benchmarks.stale_tradeoff --variants='async;ksync,k=8' --budget_s=300

Runs every variant of `experiments/configs/digits_stale.py` (softmax regression, P = 8, X ~ Exp(1)) for the
same simulated time budget, in this process, one after another (the same seed, so the same data order and
compute-time draws wherever the rules ask for the same work). `num_steps` of each run comes from the closed
form of its mean time per server update (ALGORITHMS.md section 5) with a margin; rows after the budget are
ignored. Prints a markdown table (and writes it to WORKDIR/stale_tradeoff.md):

  updates       server updates within the budget
  s/update      measured mean simulated seconds per update (closed form in brackets)
  staleness     mean staleness of the applied gradients (server versions)
  t(loss<=L)    first simulated time at which the test loss of the server model is <= L (- if never)
  floor         mean test loss over the last quarter of the budget (the error floor of a constant step)
  final acc     test accuracy at the end of the budget

Each row's command reproduces that run alone with `python -m waitless.experiments.main`.
"""

from __future__ import annotations

import math
import os
import sys

from absl import flags
from benchmarks import cli
from absl import logging as absl_logging

_WORKDIR = flags.DEFINE_string('workdir', '/tmp/stale_tradeoff', 'One sub-directory per variant is written here.')
_BUDGET = flags.DEFINE_float('budget_s', 1000.0, 'Simulated seconds every variant runs for.')
_EVALS = flags.DEFINE_integer('evals', 80, 'Evaluations of the server model per run (spread over the budget).')
_TARGETS = flags.DEFINE_list('targets', ['0.2', '0.15', '0.13'], 'Test-loss levels L of the t(loss<=L) columns.')
_AT = flags.DEFINE_list('at_s', ['100', '250'], 'Simulated times T of the loss@T columns.')
_VARIANTS = flags.DEFINE_string(
    'variants',
    'async;kbatch_async,k=4;kasync,k=4;ksync,k=1;ksync,k=2;ksync,k=4;ksync,k=8;kbatch_sync,k=4;'
    'adasync,base=ksync,k0=1;adasync,base=ksync,k0=2',
    'Semicolon-separated config arguments of digits_stale.py.')
_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'Runs per variant, one per seed; the table shows means.')
_EXTRA = flags.DEFINE_string('extra', '', 'key=value pairs appended to every variant (e.g. seed=1).')

CONFIG_FILE = 'experiments/configs/digits_stale.py'


def harmonic(n: int) -> float:
  return sum(1.0 / i for i in range(1, n + 1))


def mean_update_time(config) -> float:
  """Closed form of the mean simulated seconds per server update (X ~ Exp(rate), ideal network)."""
  a, p, mu = config.algorithm, config.workers, config.stragglers.rate
  name = a.name
  if name == 'adasync':  # K starts at K0; the fastest K it runs with bounds the updates in the budget
    name, k = a.base, a.k0
  else:
    k = a.get('k', 1)
  if name in ('ksync', 'kasync'):
    return (harmonic(p) - harmonic(p - k)) / mu
  if name in ('kbatch_sync', 'kbatch_async', 'async'):
    return k / (p * mu)
  if name == 'sync':
    return harmonic(p) / mu
  raise ValueError(f'no closed form for {name}')


def _slug(arg: str) -> str:
  return arg.replace(',', '_').replace('=', '')


def configure(arg: str, budget_s: float, evals: int):
  """The digits_stale config of `arg`, with num_steps / eval_every sized for the simulated budget."""
  from waitless.experiments.configs import digits_stale
  config = digits_stale.get_config(arg)
  per_update = mean_update_time(config)
  every = max(1, round(budget_s / evals / per_update))
  steps = every * math.ceil(1.3 * budget_s / per_update / every)  # margin: the draws vary around the mean
  sizes = f'num_steps={steps},eval_every={every},log_every={every},steps_per_call={min(every, 50)},' \
          f'checkpoint_every={steps}'
  full = f'{arg},{sizes}'
  return digits_stale.get_config(full), full, per_update


def summarize(rows, budget_s: float, targets: list[float], at_s: list[float]) -> dict:
  rows = [r for r in rows if r['sim_time'] <= budget_s]
  evals = [(r['sim_time'], r['eval_loss'], r['eval_accuracy']) for r in rows if 'eval_loss' in r]
  updates = rows[-1]['step'] if rows else 0
  out = {'updates': updates, 's_per_update': rows[-1]['sim_time'] / max(updates, 1) if rows else float('nan')}
  weights = [r['step'] for r in rows]
  stale = [r.get('staleness', 0.0) for r in rows]
  steps = [w - v for w, v in zip(weights, [0] + weights[:-1])]
  out['staleness'] = sum(s * n for s, n in zip(stale, steps)) / max(sum(steps), 1)
  for target in targets:
    hit = [t for t, loss, _ in evals if loss <= target]
    out[f't{target}'] = hit[0] if hit else None
  for when in at_s:
    before = [loss for t, loss, _ in evals if t <= when]
    out[f'at{when}'] = before[-1] if before else float('nan')  # the latest evaluation by then
  tail = [loss for t, loss, _ in evals if t >= 0.75 * budget_s]
  out['floor'] = sum(tail) / len(tail) if tail else float('nan')
  out['final_acc'] = evals[-1][2] if evals else float('nan')
  ks = [r['k'] for r in rows if 'k' in r]
  out['k_range'] = (min(ks), max(ks)) if ks else None
  return out


def _mean(values):
  return sum(values) / len(values)


def combine(per_seed: list[dict], targets: list[float], at_s: list[float]) -> dict:
  """Mean over seeds; t(loss<=L) is the mean over the seeds that reached L, with how many did."""
  keys = ['updates', 's_per_update', 'staleness', 'floor', 'final_acc'] + [f'at{when}' for when in at_s]
  out = {key: _mean([s[key] for s in per_seed]) for key in keys}
  floors = [s['floor'] for s in per_seed]
  out['floor_std'] = math.sqrt(_mean([(f - out['floor']) ** 2 for f in floors]))
  for t in targets:
    hits = [s[f't{t}'] for s in per_seed if s[f't{t}'] is not None]
    out[f't{t}'] = (_mean(hits) if hits else None, len(hits), len(per_seed))
  ranges = [s['k_range'] for s in per_seed if s['k_range']]
  out['k_range'] = (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else None
  return out


def table(results, budget_s: float, targets: list[float], at_s: list[float], seeds: int) -> str:
  head = ['variant', 'updates', 's/update (closed form)', 'staleness', 'K']
  head += [f'loss@{when:g}s' for when in at_s]
  head += [f't(loss<={t:g}) s' for t in targets] + ['floor (std)', 'final acc']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for arg, per_update, s in results:
    def fmt_t(v):
      mean, hit, n = v
      if not hit:
        return '-'
      return f'{mean:.0f}' if hit == n else f'{mean:.0f} ({hit}/{n})'
    k = '' if not s['k_range'] else (f'{s["k_range"][0]:.0f}' if s['k_range'][0] == s['k_range'][1]
                                     else f'{s["k_range"][0]:.0f}..{s["k_range"][1]:.0f}')
    cells = [f'`{arg}`', f'{s["updates"]:.0f}', f'{s["s_per_update"]:.3f} ({per_update:.3f})',
             f'{s["staleness"]:.2f}', k] + [f'{s[f"at{when}"]:.3f}' for when in at_s]
    cells += [fmt_t(s[f't{t}']) for t in targets]
    cells += [f'{s["floor"]:.3f} ({s["floor_std"]:.3f})', f'{s["final_acc"]:.3f}']
    lines.append('| ' + ' | '.join(cells) + ' |')
  lines.append('')
  lines.append(f'Budget {budget_s:g} simulated seconds per run; mean over {seeds} seed(s) (`seed=` sets the model '
               'init, data order and compute-time draws); loss = test cross-entropy of the server model; '
               'loss@T = test loss of the latest evaluation at or before simulated time T; '
               't(loss<=L) = mean first simulated time at or below L over the seeds that reached it (how many, '
               'if not all); floor = mean test loss over the last quarter of the budget (std over seeds); K = '
               'range of the per-window mean K.')
  return '\n'.join(lines)


def main(argv):
  cli.no_positionals(argv)
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every checkpoint file at INFO
  from waitless.experiments.harness import metrics_io
  from waitless.experiments.harness import train
  budget, evals = _BUDGET.value, _EVALS.value
  targets = [float(t) for t in _TARGETS.value]
  at_s = [float(t) for t in _AT.value]
  seeds = [int(s) for s in _SEEDS.value]
  results, commands = [], []
  for arg in [v.strip() for v in _VARIANTS.value.split(';') if v.strip()]:
    arg = f'{arg},{_EXTRA.value}' if _EXTRA.value else arg
    per_seed = []
    for seed in seeds:
      config, full, per_update = configure(f'{arg},seed={seed}', budget, evals)
      workdir = os.path.join(_WORKDIR.value, _slug(arg), f'seed{seed}')
      if not os.path.exists(os.path.join(workdir, 'summary.json')):
        train.train_and_evaluate(config, workdir)
      per_seed.append(summarize(metrics_io.read_rows(workdir), budget, targets, at_s))
      commands.append(f'python -m waitless.experiments.main --config={CONFIG_FILE}:{full} --workdir={workdir}')
    results.append((arg, per_update, combine(per_seed, targets, at_s)))
    print(f'{arg}: {results[-1][2]}', file=sys.stderr)
  text = table(results, budget, targets, at_s, len(seeds))
  text += '\n\nCommands (one run each; `python -m benchmarks.stale_tradeoff` runs them all):\n```\n'
  text += '\n'.join(commands) + '\n```\n'
  print(text)
  with open(os.path.join(_WORKDIR.value, 'stale_tradeoff.md'), 'w') as f:
    f.write(text)


if __name__ == '__main__':
  # Before JAX initialises: one CPU device per learner (as experiments.main does for the config's devices).
  os.environ['XLA_FLAGS'] = ' '.join(
      [f for f in os.environ.get('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
      + ['--xla_force_host_platform_device_count=8'])
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  cli.run(main)
