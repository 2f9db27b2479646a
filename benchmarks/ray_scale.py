"""Many learners on one machine: the Ray runtime's time per update, updates per second and peak memory at P = 4
to 256 learners.

  python -m benchmarks.ray_scale [--models=digits,mnist1d --workers=4,16,64,256
      --algorithms=async,kasync+k=4,kbatch_sync+k=4 --plans=64:16,64:8 --out=ray_scale.json --figure=ray_scale.png]

For each model, learner count P and algorithm, one real run of `--updates` server updates on a local Ray
(`driver.train_and_evaluate`; the plan's default placement: on this machine's CPUs, a few learner processes of
P / processes learners each, and the server a process of its own), and for each `--plans=P:N` one more run of the
first algorithm at P with `ray.learners_per_process=N` (another placement: N learners in each of P / N
processes). Per run:
  ms per update, updates/s   measured training seconds over updates (summary.json; compilation left out);
  peak RSS (GB)              of the server actor's process and of the largest learner process: every process that
                             Ray titles `ray::ServerActor...` or `ray::LearnerActor...` and that started during the
                             run, sampled every `SAMPLE_S` with psutil;
  plan                       learner processes x learners each, as the run planned them;
  final accuracy             the server model's at the end (the rows measure throughput and memory: the step
                             sizes are not tuned for every P).
Models: `digits` (the digits MLP, SGD momentum 0.9 at learning rate 0.005) and `mnist1d` (the MNIST-1D CNN, SGD
without momentum at 0.02), batch 16 per learner, and at P >= 128 `SMALL_BATCH` (the training sets cannot give
256 learners 16 examples each). Prints one table (a row per run) and writes the rows to `--out`; `--figure` draws
updates per second and peak memory against P.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags
from absl import logging

from benchmarks import cli
from waitless.experiments.configs import digits
from waitless.experiments.configs import mnist1d
from waitless.experiments.harness import atomic_files
from waitless.experiments.harness import tasks
from waitless.experiments.harness.ray_runtime import driver
from waitless.experiments.harness.ray_runtime import ray_config

FLAGS = flags.FLAGS
MODELS = {'digits': (digits, 0.005, 0.9), 'mnist1d': (mnist1d, 0.02, 0.0)}  # config module, learning rate, momentum
SMALL_BATCH = {'digits': 4, 'mnist1d': 8}
SAMPLE_S = 0.2
ROLES = {'ray::ServerActor': 'server', 'ray::LearnerActor': 'learner'}


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The flags, defined when the script runs, not on import (`testbed_predictions.define_flags`: a test process
  imports several benchmarks)."""
  where = {'flag_values': flag_values}
  flags.DEFINE_list('models', list(MODELS), 'digits, mnist1d.', **where)
  flags.DEFINE_list('workers', ['4', '16', '64', '256'], 'Learner counts P.', **where)
  flags.DEFINE_list('algorithms', ['async', 'kasync+k=4', 'kbatch_sync+k=4'],
                    'Algorithms; +FIELD=VALUE adds a field (kasync+k=4).', **where)
  flags.DEFINE_list('plans', ['64:16', '64:8'], 'P:N: one more run of the first algorithm at P with N learners per '
                    'process ("" for none).', **where)
  flags.DEFINE_integer('updates', 600, 'Server updates per run.', **where)
  flags.DEFINE_string('out', '', 'JSON file of the rows ("" for none).', **where)
  flags.DEFINE_string('figure', '', 'PNG of updates/s and peak memory against P ("" for none).', **where)
  flags.DEFINE_string('from_json', '', 'Print the table (and draw --figure) from earlier --out files (comma-'
                      'separated) instead of running.', **where)


def config_for(model: str, algorithm: str, workers: int, updates: int, per_process=None):
  module, lr, momentum = MODELS[model]
  config = module.get_config(f'{algorithm.replace("+", ",")},runtime=ray,workers={workers}')
  if workers >= 128:
    config.batch_size = SMALL_BATCH[model]
  config.optimizer.learning_rate, config.optimizer.momentum = lr, momentum
  config.num_steps = updates
  config.eval_every, config.log_every, config.checkpoint_every = updates, max(1, updates // 10), 10**9
  config.progress_every_s = 1e9
  if per_process is not None:
    config.ray.learners_per_process = per_process
  return config


class PeakMemory:
  """Samples, in a thread, the resident memory of the Ray actor processes that start while it runs (`ROLES`): the
  peak of the server's and of the largest learner process's."""

  def __init__(self):
    import psutil
    self._psutil = psutil
    self._before = set(psutil.pids())
    self.peak = {role: 0 for role in ROLES.values()}
    self.processes = {role: set() for role in ROLES.values()}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _sample(self) -> None:
    for proc in self._psutil.process_iter(['pid', 'cmdline', 'memory_info']):
      if proc.info['pid'] in self._before or not proc.info['cmdline'] or proc.info['memory_info'] is None:
        continue
      title = proc.info['cmdline'][0]
      for prefix, role in ROLES.items():
        if title.startswith(prefix):
          self.peak[role] = max(self.peak[role], proc.info['memory_info'].rss)
          self.processes[role].add(proc.info['pid'])

  def _run(self) -> None:
    while not self._stop.is_set():
      self._sample()
      self._stop.wait(SAMPLE_S)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def measure(config) -> dict:
  """One run: its throughput, its plan and the peak memory of its server and learner processes."""
  with tempfile.TemporaryDirectory() as workdir, PeakMemory() as memory:
    summary = driver.train_and_evaluate(config, workdir)
  placement = driver.check_local_machine(config, float(tasks.model_bytes(ray_config.server_config(config))))
  return {'update_s': summary['measured_time'] / summary['steps'],
          'updates_per_s': summary['steps'] / summary['measured_time'],
          'server_gb': memory.peak['server'] / 1e9, 'learner_gb': memory.peak['learner'] / 1e9,
          'learner_processes_seen': len(memory.processes['learner']),
          'processes': placement.processes, 'per_process': placement.per_process,
          'final_accuracy': summary['final_eval_accuracy']}


def parse_plans(values) -> list[tuple[int, int]]:
  plans = []
  for value in values:
    p, _, n = value.partition(':')
    if not (p.isdigit() and n.isdigit() and int(p) >= 1 and int(n) >= 1):
      cli.refuse(f'--plans={",".join(values)} is not allowed: each must be P:N, learners and learners per process '
                 'as integers >= 1 (64:16)')
    plans.append((int(p), int(n)))
  return plans


def run_all() -> list[dict]:
  import ray
  sizes = cli.int_list(FLAGS.workers, '--workers', minimum=1)
  plans = parse_plans([v for v in FLAGS.plans if v])
  runs = [(model, algorithm, p, None) for model in FLAGS.models for p in sizes for algorithm in FLAGS.algorithms]
  runs += [(model, FLAGS.algorithms[0], p, n) for model in FLAGS.models for p, n in plans]
  for model, algorithm, p, n in runs:  # every config checked before the first run
    config_for(model, algorithm, p, FLAGS.updates, n)
  driver.start_local(num_cpus=2)
  try:
    return [run_one(*run) for run in runs]
  finally:
    ray.shutdown()


def run_one(model: str, algorithm: str, workers: int, per_process) -> dict:
  """One run's row, said in one line as it ends."""
  begin = time.time()
  row = {'model': model, 'algorithm': algorithm, 'workers': workers, 'learners_per_process': per_process,
         **measure(config_for(model, algorithm, workers, FLAGS.updates, per_process))}
  print(f'{model} P={workers} {algorithm} ({row["processes"]} x {row["per_process"]}): {row["update_s"] * 1e3:.2f} '
        f'ms per update, server {row["server_gb"]:.2f} GB, learner process {row["learner_gb"]:.2f} GB '
        f'({time.time() - begin:.0f} s)', flush=True)
  return row


def print_table(rows: list[dict]) -> None:
  print('| model | P | algorithm | plan (processes x learners) | ms per update | updates/s | peak RSS, server (GB) | '
        'peak RSS, a learner process (GB) | final accuracy |')
  print('| --- | --- | --- | --- | --- | --- | --- | --- | --- |')
  for r in rows:
    plan = f'{r["processes"]} x {r["per_process"]}' + ('' if r['learners_per_process'] is None else ' (set)')
    print(f'| {r["model"]} | {r["workers"]} | {r["algorithm"].replace("+", ", ")} | {plan} | '
          f'{r["update_s"] * 1e3:.2f} | {r["updates_per_s"]:.0f} | {r["server_gb"]:.2f} | {r["learner_gb"]:.2f} | '
          f'{r["final_accuracy"]:.3f} |')


def draw(rows: list[dict], path: str) -> None:
  """Per model: updates per second against P per algorithm (the default plan), and the peak memory of the server
  and of a learner process."""
  import matplotlib
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt
  models = list(dict.fromkeys(r['model'] for r in rows))
  fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 7), squeeze=False)
  for col, model in enumerate(models):
    default = [r for r in rows if r['model'] == model and r['learners_per_process'] is None]
    for algorithm in dict.fromkeys(r['algorithm'] for r in default):
      mine = sorted((r for r in default if r['algorithm'] == algorithm), key=lambda r: r['workers'])
      ps = [r['workers'] for r in mine]
      line, = axes[0, col].plot(ps, [r['updates_per_s'] for r in mine], 'o-', label=algorithm.replace('+', ', '))
      for role, style in (('server', '--'), ('learner', ':')):
        axes[1, col].plot(ps, [r[f'{role}_gb'] for r in mine], 'o' + style, color=line.get_color(),
                          label=f'{algorithm.replace("+", ", ")}: {role if role == "server" else "a learner process"}')
    for r in rows:
      if r['model'] == model and r['learners_per_process'] is not None:
        axes[0, col].plot([r['workers']], [r['updates_per_s']], 'k^')
        axes[0, col].annotate(f'{r["processes"]} x {r["per_process"]}', (r['workers'], r['updates_per_s']),
                              fontsize=7, xytext=(4, 4), textcoords='offset points')
    for row, label in ((0, 'updates per second'), (1, 'peak resident memory (GB)')):
      ax = axes[row, col]
      ax.set_xscale('log', base=2)
      ax.set_xlabel('learners P')
      ax.set_ylabel(label)
      ax.set_title(f'{model}: {label}')
      ax.legend(fontsize=7)
    axes[0, col].set_yscale('log')  # K-batch-sync's tens of updates per second beside async's hundreds
    axes[1, col].set_ylim(bottom=0)
  fig.tight_layout()
  atomic_files.save_figure(fig, path, dpi=110)
  plt.close(fig)


def main(argv):
  cli.no_positionals(argv)
  for flag, path in (('--out', FLAGS.out), ('--figure', FLAGS.figure)):
    if path:
      cli.output_file(path, flag)
  for name in FLAGS.models:
    if name not in MODELS:
      cli.refuse(f'--models={",".join(FLAGS.models)} is not allowed: {name} is not one of {", ".join(MODELS)}')
  if FLAGS.updates < 1:
    cli.refuse(f'--updates={FLAGS.updates} is not allowed: must be >= 1')
  logging.set_verbosity(logging.ERROR)
  rows = cli.load_or_run(FLAGS.from_json, run_all, FLAGS.out)
  print_table(rows)
  if FLAGS.figure:
    draw(rows, FLAGS.figure)


if __name__ == '__main__':
  define_flags()
  cli.run(main)
