"""The harness on an accelerator: its programs' accelerator paths against the CPU's, and training at scale.

  python -m benchmarks.gpu_check                     # both parts (on a machine with a GPU)
  python -m benchmarks.gpu_check --part=exactness    # or --part=scale

exactness: on the CPU the block program takes other shapes (`harness/xla_cpu.py`: busy slots in a loop, flat norms,
no round program); on an accelerator it gathers the busy slots into one vmap, measures norms leaf by leaf and runs
whole rounds with static positions. Each algorithm below trains 12 iterations in float64, 8 workers on one device,
blocks of 4 through the production loop (`tests/harness.py`), once on the default backend and once in a
subprocess on the CPU; the largest difference of the final parameters is printed (float64 rounding: < 1e-9).

scale: MNIST-1D's CNN, `--batch` examples per worker, P workers vmapped on ONE device, sync, WAGMA, local SGD,
D-PSGD and K-async: the steady-state microseconds per worker-iteration (`experiments.main`'s metrics rows, as
`benchmarks.harness_overhead` reads them) and its ratio to P = 8's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags
import numpy as np
from benchmarks import cli

_PART = flags.DEFINE_enum('part', 'all', ['all', 'exactness', 'scale'], 'What to run.')
_DUMP = flags.DEFINE_string('dump', '', 'Internal: write this backend\'s final parameters to this .npz and exit.')
_WORKERS = flags.DEFINE_list('workers', ['8', '64', '256', '1024'], 'scale: workers on the one device.')
_BATCH = flags.DEFINE_integer('batch', 3, 'scale: examples per worker (P x batch <= 4,000 MNIST-1D sequences).')
_STEPS = flags.DEFINE_integer('steps', 300, 'scale: iterations per run.')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXACTNESS = ('sync', 'local_sgd,local_steps=4', 'dasgd,local_steps=4,delay=2', 'wagma,group_size=4,sync_every=4',
             'dpsgd', 'matcha', 'kasync,k=3', 'kbatch_sync,k=6', 'nonblocking', 'lap_sgd,threads=2,delay=1')
SCALE = ('sync', 'wagma', 'local_sgd', 'dpsgd', 'kasync,k=4')


def _exactness_params(path: str) -> None:
  """This backend's final parameters of every EXACTNESS algorithm, flattened, into `path` (.npz)."""
  import jax
  jax.config.update('jax_enable_x64', True)
  from tests import harness
  out = {}
  for arg in EXACTNESS:
    config = harness.synthetic_config(arg, workers=8, devices=1, microbatches=2, **{
        'stragglers.kind': 'exponential', 'model.param_dtype': 'float64', 'model.dtype': 'float64'})
    trajectory = harness.run_iterations(config, 12, block=4, rounds=True)
    out[arg] = np.concatenate([np.ravel(x) for x in jax.tree.leaves(trajectory.params[-1])])
  np.savez(path, **out)


def exactness() -> None:
  import jax
  with tempfile.TemporaryDirectory() as tmp:
    here, cpu = os.path.join(tmp, 'here.npz'), os.path.join(tmp, 'cpu.npz')
    _exactness_params(here)
    env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
    subprocess.run([sys.executable, '-m', 'benchmarks.gpu_check', f'--dump={cpu}'], cwd=ROOT, env=env, check=True)
    a, b = np.load(here), np.load(cpu)
    print(f'exactness, float64, 12 iterations in blocks of 4, 8 workers on one {jax.devices()[0].device_kind} '
          f'({jax.default_backend()}) against the CPU:')
    for arg in EXACTNESS:
      diff = float(np.max(np.abs(a[arg] - b[arg])))
      print(f'  {arg:<36} max |difference| {diff:.2e}  {"ok" if diff < 1e-9 else "DIFFERS"}', flush=True)


def scale() -> None:
  import jax
  from benchmarks import harness_overhead
  from waitless.experiments.harness import metrics_io
  sizes = [int(p) for p in _WORKERS.value]
  print(f'\nscale: MNIST-1D CNN, {_BATCH.value} examples per worker, all workers on one '
        f'{jax.devices()[0].device_kind}; us per worker-iteration (x P={sizes[0]}\'s)')
  for arg in SCALE:
    cells, base = [], None
    for p in sizes:
      steps = _STEPS.value
      with tempfile.TemporaryDirectory() as workdir:
        config = (f'experiments/configs/mnist1d.py:{arg},stragglers=heterogeneous,workers={p},devices=1,'
                  f'batch_size={_BATCH.value},num_steps={steps},eval_every={steps},checkpoint_every={steps}')
        done = subprocess.run([sys.executable, '-m', 'waitless.experiments.main', f'--config={config}',
                               '--config.cluster.profile=commodity_10gbe', f'--workdir={workdir}',
                               '--compilation_cache_dir='], cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode:
          cells.append(f'failed ({done.stderr.strip().splitlines()[-1][:80] if done.stderr.strip() else "?"})')
          continue
        rows = metrics_io.read_rows(workdir)
      rate = harness_overhead.steady_rate([r['step'] for r in rows], [r['wall_time'] for r in rows])
      us = 1e6 / (rate * p)
      base = us if base is None else base
      cells.append(f'P={p}: {us:.2f} us ({us / base:.2f}x)')
    print(f'  {arg:<12} ' + '  '.join(cells), flush=True)


def main(argv):
  cli.no_positionals(argv)
  if _DUMP.value:
    _exactness_params(_DUMP.value)
    return
  if _PART.value in ('all', 'exactness'):
    exactness()
  if _PART.value in ('all', 'scale'):
    scale()


if __name__ == '__main__':
  cli.run(main)
