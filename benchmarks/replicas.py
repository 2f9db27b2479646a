"""Many runs, one program: R replicas against one run alone, end to end and in memory.

  python -m benchmarks.replicas [--quick] [--only=sync,async] [--sim_time=4]

For one algorithm of each family, on the quickstart's workload (MNIST-1D, the paper's CNN, 8 workers on 8 CPU
devices, the heterogeneous cluster), `python -m waitless.experiments.compare` as a user runs it, in a fresh process with
no compilation cache: 10 runs (5 seeds x the quickstart's two step sizes, lr 0.2 with momentum 0.9 and lr 0.1
without) trained as the replicas of one program, against 1 run alone (seed 0, lr 0.2, momentum 0.9), each for the
same simulated seconds. The ratio is their wall times (imports, planning, compiling, training, evaluating,
writing the report: everything); the target is <= 2.5x, against 10x for ten runs one after another. Beside it, the
ratio of their CPU seconds (user + system, every thread of the process): on a machine that other work shares, the
wall times move with its load, the CPU seconds much less.

Memory: the compiled block step's arguments and temporaries for 10 replicas, divided by 10, against one run's
(target <= 1.0x: a replica needs no more than the run alone).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One algorithm per family of state and schedule.
FAMILIES = {
    'sync': 'synchronous all-reduce',
    'ksync': 'parameter server, fresh views',
    'async': 'parameter server, stale views',
    'adasync': 'parameter server, K from the loss',
    'nonblocking': 'micro-batches',
    'local_sgd': 'local SGD',
    'diloco': 'local SGD with an outer step',
    'dasgd': 'delayed averaging',
    'dpsgd': 'gossip',
    'wagma': 'group averaging',
    'lap_sgd': 'node threads',
}
WORKLOAD = 'experiments/configs/mnist1d.py:{name},stragglers=heterogeneous'
SWEEP = 'optimizer.learning_rate:optimizer.momentum=0.2:0.9,0.1:0.0'
SEEDS = 5


def _compare(name: str, workdir: str, sim_time: float, replicas: bool) -> tuple[float, float]:
  """(wall seconds, CPU seconds) of one `experiments.compare` process: 5 seeds x 2 step sizes, or the run alone."""
  args = [sys.executable, '-m', 'waitless.experiments.compare', f'--config={WORKLOAD.format(name=name)}',
          f'--algorithms={name}', f'--workdir={workdir}', f'--sim_time={sim_time:g}', '--max_steps=4500',
          '--compilation_cache_dir=']
  if replicas:
    args += [f'--seeds={SEEDS}', f'--sweep={SWEEP}']
  begin, cpu = time.perf_counter(), _children_cpu()
  done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False)
  seconds, cpu = time.perf_counter() - begin, _children_cpu() - cpu
  if done.returncode != 0:
    raise RuntimeError(f'{name}: experiments.compare exited {done.returncode}: {done.stderr[-2000:]}')
  return seconds, cpu


def _children_cpu() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def end_to_end(name: str, sim_time: float) -> tuple[tuple[float, float], tuple[float, float]]:
  """((wall, CPU) seconds for the run alone, (wall, CPU) seconds for 10 replicas), each in a fresh process and
  workdir."""
  with tempfile.TemporaryDirectory() as root:
    alone = _compare(name, os.path.join(root, 'alone'), sim_time, replicas=False)
    together = _compare(name, os.path.join(root, 'replicas'), sim_time, replicas=True)
  return alone, together


def memory_per_replica(name: str, count: int = 2 * SEEDS) -> tuple[float, float]:
  """(bytes of one run's compiled block step, bytes per replica of `count` replicas'), arguments + temporaries."""
# JAX after the device count is set
  import numpy as np
  from waitless.experiments.configs import mnist1d
  from waitless.experiments.harness import block_step as block_step_lib
  from waitless.experiments.harness import inputs as inputs_lib
  from waitless.experiments.harness import setup
  configs = []
  for i in range(count):
    config = mnist1d.get_config(f'{name},stragglers=heterogeneous')
    config.seed, config.optimizer.learning_rate = i // 2, (0.2, 0.1)[i % 2]
    config.optimizer.momentum = (0.9, 0.0)[i % 2]
    configs.append(config)
  sizes = []
  for group_configs in ([configs[0]], configs):
    group = setup.build_group(group_configs)
    state = setup.init_state(group)
    _, model_bytes = setup.param_count_and_bytes(state.params)
    clocks = [setup.clock_for(run, model_bytes) for run in group.runs]
    blocks = [clock.next_block(group.lead.config.steps_per_call) for clock in clocks]
    zeros = [np.zeros(c.workers, np.int64) for c in group_configs]
    if group.batched:
      inputs, _ = inputs_lib.stacked_inputs(group, blocks, zeros, 0)
    else:
      inputs, _ = inputs_lib.block_inputs(group.lead, blocks[0], zeros[0], 0)
    memory = block_step_lib.BlockStep(group).lower(state, *inputs).compile().memory_analysis()
    sizes.append((memory.argument_size_in_bytes + memory.temp_size_in_bytes) / group.size)
  return sizes[0], sizes[1]


def section_replicas(out, quick: bool, only=None, sim_time: float | None = None) -> None:
  names = [n for n in FAMILIES if only is None or n in only]
  if quick and only is None:
    names = ['sync', 'local_sgd']
  sim_time = sim_time or (1.0 if quick else 4.0)
  print(f'## 7. Replicas: {2 * SEEDS} runs in one program against one run alone (MNIST-1D quickstart entry, '
        f'{sim_time:g} simulated s)\n', file=out)
  print(f'`experiments.compare` end to end in a fresh process without a compilation cache: {SEEDS} seeds x 2 step '
        'sizes as replicas of one program, against the run alone (target <= 2.5x; ten runs one after another '
        'would be about 10x). Memory: the compiled block step\'s arguments + temporaries per replica / the run '
        'alone\'s (target <= 1.0x).\n', file=out)
  print('| algorithm | family | alone (s) | 10 replicas (s) | ratio | CPU ratio | memory per replica / alone |',
        file=out)
  print('| --- | --- | ---: | ---: | ---: | ---: | ---: |', file=out, flush=True)
  for name in names:
    (alone, alone_cpu), (together, together_cpu) = end_to_end(name, sim_time)
    solo_bytes, replica_bytes = memory_per_replica(name)
    print(f'| {name} | {FAMILIES[name]} | {alone:.1f} | {together:.1f} | {together / alone:.2f}x | '
          f'{together_cpu / alone_cpu:.2f}x | {replica_bytes / solo_bytes:.2f}x |', file=out, flush=True)
  print('', file=out)


def main() -> None:
  import argparse
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true')
  parser.add_argument('--only', default=None, help='comma-separated algorithms (default: one per family)')
  parser.add_argument('--sim_time', type=float, default=None)
  args = parser.parse_args()
  os.environ['XLA_FLAGS'] = ' '.join(
      [f for f in os.environ.get('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
      + ['--xla_force_host_platform_device_count=8'])
  section_replicas(sys.stdout, args.quick, args.only.split(',') if args.only else None, args.sim_time)


if __name__ == '__main__':
  main()
