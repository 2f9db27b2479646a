"""The benchmark suite: ratios measured side by side in one process, written to runs/benchmarks.md.

  python -m benchmarks.run [--quick] [--sections=algorithms,harness,simulator,memory,scaling,gpu,replicas,startup]

Sections (every registered algorithm is included automatically):
  1. algorithms  device time per iteration of each algorithm / sync's, digits MLP, 8 workers, with one worker
                 per device (8 devices), four per device (2 devices) and all eight on one device; target <= 1.10x
                 except inherent extra work, which the table names; and the gradients the emulator computes per
                 gradient the simulated cluster pushes (1.0, or the extra named).
  2. harness     the training loop's steady-state steps/s / a hand-written jitted shard_map loop (>= 0.95x).
  3. simulator   seconds to simulate 100,000 iterations of 64 workers per algorithm's time rule (< 2 s), and
                 its share of a jitted digits training step.
  4. memory      bytes per worker of the compiled block step (arguments + temporaries) / sync's.
  5. scaling     device time per iteration as P grows from 8 to 1024 virtual workers on one CPU device (linear
                 least-squares model), per algorithm, and the growth exponent of a log-log fit.
  7. replicas    10 runs (5 seeds x 2 step sizes) as replicas of one program against one run alone, end to end
                 as `experiments.compare` runs them, one algorithm per family (<= 2.5x), and the memory per
                 replica (`benchmarks/replicas.py`).
  6. gpu         only where a GPU is present (`benchmarks/gpu.py`): ResNet-20 on CIFAR-shaped data, 8 virtual
                 workers on one GPU against one worker with batch 8b, every algorithm against sync on it,
                 bfloat16 against float32. Without a GPU the section says so in one line.
  8. startup     a 10-step digits run of `experiments.main` in a fresh process against the bare imports of jax,
                 flax, optax and orbax, cold and with a warm compilation cache (<= 2x; `benchmarks/startup.py`).
Each figure is a median of repeated timings; run it on a quiet machine. `--quick` shrinks every section
(fewer repeats and iterations) for a smoke test.
"""

from __future__ import annotations

import datetime
import io
import os
import platform
import subprocess
import sys
import time

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ['XLA_FLAGS'] = ' '.join(
    [f for f in os.environ.get('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
    + ['--xla_force_host_platform_device_count=8'])

from absl import flags
from absl import logging
import jax
import numpy as np

from waitless.cluster import registry
from benchmarks import cli
from benchmarks import gpu
from benchmarks import harness_overhead
from benchmarks import replicas
from benchmarks import simulator_speed
from benchmarks import startup
from benchmarks import timing
from waitless.experiments.harness import atomic_files
from waitless.experiments.configs import digits
from waitless.experiments.configs import synthetic

_QUICK = flags.DEFINE_bool('quick', False, 'Smaller sections (a smoke test, not figures to report).')
_SECTIONS = flags.DEFINE_list('sections', ['algorithms', 'harness', 'simulator', 'memory', 'scaling', 'gpu',
                                           'replicas', 'startup'],
                              'Sections to run.')
_OUT = flags.DEFINE_string('out', os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'runs',
                                             'benchmarks.md'),
                           'Where to write the results ('' to skip); docs/results/benchmarks.md quotes them.')

# Work an algorithm does beyond sync's by design (section 1 names it next to its ratio).
_SERVER_COPY = 'a server copy beside each stale view: the server update, then the view kept, refreshed or set to W_t'
INHERENT = {
    'kbatch_sync': 'a while loop over the mini-batches each worker finished (0..K)',
    'kbatch_async': f'a while loop over the mini-batches each worker finished (0..K); {_SERVER_COPY}',
    'kasync': _SERVER_COPY,
    'async': _SERVER_COPY,
    'ringmaster': _SERVER_COPY,
    'adasync': 'with a K-batch base: a while loop over the mini-batches each worker finished',
    'wagma': 'log2 S exchanges per iteration instead of one all-reduce (and a lost-worker mask)',
    'lap_sgd': 'Q thread views per node',
    'lpp_sgd': 'Q thread views per node',
    'dpsgd': 'two neighbour exchanges per iteration',
    'matcha': 'one point-to-point exchange per active matching (the ring has two; each active with its probability)',
    'nonblocking': 'm micro-batches scanned per worker',
}
_ARGS = {'ksync': 'ksync,k=6', 'kasync': 'kasync,k=4', 'kbatch_sync': 'kbatch_sync,k=4',
         'kbatch_async': 'kbatch_async,k=4', 'adasync': 'adasync,k0=2'}


def _arg(name: str) -> str:
  return _ARGS.get(name, name)


def _digits(name: str, devices: int):
  config = digits.get_config(_arg(name))
  config.devices = devices
  return config


def section_algorithms(out, repeats):
  print('## 1. Device time per iteration against sync (digits MLP, 8 workers, 8 iterations per call)\n', file=out)
  print('Each ratio is the median over rounds of the algorithm\'s call time / sync\'s in the same round (every '
        'round times each algorithm once, in turn).\n', file=out)
  print('Gradients: the micro-batch gradients the emulator computes / those the simulated cluster pushes, over '
        '2,000 iterations of the config\'s clock (1 worker per device; 1.0: one per pushed job; above: slots '
        'scanned beyond what a worker finished, named in the last column).\n', file=out)
  print('| algorithm | 1 worker/device (us) | ratio | 4 workers/device (us) | ratio | 8 workers/1 device (us) | ratio '
        '| gradients computed / pushed | inherent extra work |', file=out)
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |', file=out)
  results = {}
  for devices in (8, 2, 1):
    timers = {name: timing.BlockTimer(_digits(name, devices)) for name in registry.names()}
    results[devices] = timing.round_robin(timers, 'sync', repeats)
    del timers
  for name in registry.names():
    (t8, r8), (t2, r2), (t1, r1) = results[8][name], results[2][name], results[1][name]
    gradients = timing.gradient_ratio(_digits(name, 8), iterations=200 if repeats < 10 else 2000)
    print(f'| {name} | {1e6 * t8:.0f} | {r8:.2f}x | {1e6 * t2:.0f} | {r2:.2f}x | {1e6 * t1:.0f} | {r1:.2f}x '
          f'| {gradients:.2f} | {INHERENT.get(name, "")} |', file=out, flush=True)
  print('', file=out)


def section_harness(out, steps, repeats):
  harness, reference, ratios = harness_overhead.paired_rates(steps, repeats)
  print('## 2. Training loop against a hand-written shard_map loop (digits MLP, 8 workers on 8 devices)\n',
        file=out)
  print('| loop | steps/s |\n| --- | ---: |', file=out)
  print(f'| hand-written jitted shard_map | {reference:.0f} |', file=out)
  print(f'| waitless harness (sync) | {harness:.0f} |', file=out)
  print(f'\nratio: **{harness_overhead.describe_ratio(ratios)}**, each round timing both loops in turn '
        '(target >= 0.95)\n', file=out, flush=True)


def section_simulator(out, iterations):
  step = simulator_speed.digits_step_seconds()
  print(f'## 3. Simulator: {iterations:,} iterations of 64 workers per time rule (exponential compute, '
        'alpha-beta network)\n', file=out)
  print('| algorithm | rule | seconds | us/iteration | share of a jitted digits step | < 2 s |', file=out)
  print('| --- | --- | ---: | ---: | ---: | :---: |', file=out)
  for name in registry.names():
    config = digits.get_config(_arg(name))
    config.workers = 64
    rule = registry.time_rule(config)
    seconds = simulator_speed.time_rule(rule, config.workers, iterations)  # its clock: the section's title
    per = seconds / iterations
    print(f'| {name} | {type(rule).__name__} | {seconds:.2f} | {1e6 * per:.1f} | {per / step:.1%} | '
          f'{"yes" if seconds < 2 * iterations / 100_000 else "no"} |', file=out, flush=True)
  print(f'\n(one jitted digits training step: {1e6 * step:.0f} us)\n', file=out)


def section_memory(out):
  print('## 4. Memory per worker of the compiled block step (digits MLP, 8 workers on 8 devices)\n', file=out)
  print('| algorithm | arguments (KB) | temporaries (KB) | total / sync |', file=out)
  print('| --- | ---: | ---: | ---: |', file=out)
  rows = {}
  for name in registry.names():
    memory = timing.BlockTimer(_digits(name, 8)).memory
    rows[name] = (memory.argument_size_in_bytes, memory.temp_size_in_bytes)
  base = sum(rows['sync'])
  for name, (arguments, temporaries) in rows.items():
    print(f'| {name} | {arguments / 1024:.1f} | {temporaries / 1024:.1f} | {(arguments + temporaries) / base:.2f}x |',
          file=out, flush=True)
  print('\n(one device holds one worker here: the compiled program\'s bytes are per worker)\n', file=out)


def section_scaling(out, sizes, repeats):
  print('## 5. Scaling: device time per iteration as P grows, one CPU device, linear least squares (d = 16)\n',
        file=out)
  print('| algorithm | ' + ' | '.join(f'P={p} (us)' for p in sizes) + ' | growth exponent |', file=out)
  print('| --- | ' + ' | '.join('---:' for _ in sizes) + ' | ---: |', file=out)
  for name in registry.names():
    times = []
    for p in sizes:
      config = synthetic.get_config(_arg(name))
      config.workers, config.devices, config.batch_size = p, 1, 8
      config.dataset.num_examples = max(config.dataset.num_examples, 16 * p)  # >= 1 batch per worker's shard
      if 'k' in config.algorithm:
        config.algorithm.k = max(1, p // 2)
      if 'k0' in config.algorithm:
        config.algorithm.k0 = max(1, p // 2)
      if 'group_size' in config.algorithm:
        config.algorithm.group_size = 4
      times.append(timing.median_seconds(timing.BlockTimer(config, n=4), repeats))
    exponent = np.polyfit(np.log(sizes), np.log(times), 1)[0]
    print(f'| {name} | ' + ' | '.join(f'{1e6 * t:.0f}' for t in times) + f' | {exponent:.2f} |', file=out,
          flush=True)
  print('', file=out)


class _Tee(io.StringIO):
  def write(self, s):
    sys.stdout.write(s)
    return super().write(s)


def main(argv):
  cli.no_positionals(argv)
  if _OUT.value:
    cli.output_file(_OUT.value, '--out', make_directory=True)
  logging.set_verbosity(logging.WARNING)
  quick = _QUICK.value
  out = _Tee()
  commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or 'unknown'
  print(f'# Benchmark results\n\n{datetime.date.today().isoformat()}, commit {commit}, '
        f'{jax.devices()[0].device_kind} ({jax.default_backend()}), {os.cpu_count()} cores, '
        f'{platform.python_implementation()} {platform.python_version()}, jax {jax.__version__}'
        f'{" (--quick: smoke test)" if quick else ""}\n', file=out)
  begin = time.time()
  sections = _SECTIONS.value
  if 'algorithms' in sections:
    section_algorithms(out, repeats=3 if quick else 15)
  if 'harness' in sections:
    section_harness(out, steps=400 if quick else 3000, repeats=2 if quick else 7)
  if 'simulator' in sections:
    section_simulator(out, iterations=2_000 if quick else 100_000)
  if 'memory' in sections:
    section_memory(out)
  if 'scaling' in sections:
    section_scaling(out, sizes=(8, 64) if quick else (8, 64, 256, 1024), repeats=3 if quick else 10)
  if 'gpu' in sections:
    if jax.default_backend() == 'gpu':
      gpu.section_gpu(out, quick, args=_ARGS)
    else:
      print(f'## 6. GPU\n\nNo GPU present (jax backend: {jax.default_backend()}): not measured.\n', file=out)
  if 'replicas' in sections:
    replicas.section_replicas(out, quick)
  if 'startup' in sections:
    startup.section_startup(out, quick)
  print(f'(whole suite: {time.time() - begin:.0f} s)', file=out)
  if _OUT.value:
    atomic_files.write_text(_OUT.value, out.getvalue())


if __name__ == '__main__':
  cli.run(main)
