"""The GPU section: virtual workers on one GPU, every algorithm against sync, bfloat16 against float32.

  python -m benchmarks.gpu [--quick] [--model=resnet20] [--workers=8] [--batch=32] [--force]

All on ONE device (`config.devices=1`, the workers vmapped on it), ResNet-20 by default
(`experiments/configs/cifar10.py`), on CIFAR-shaped random images (`tfds.testing.mock_data`: no data set files
and no network needed). Each figure is timed on the jitted block step of 8 iterations per call
(`benchmarks/timing.py`), configs of a table timed in turn, one call each per round; a ratio is the median over
rounds of the two configs' quotient in the same round.
  6.1  sync with P = `workers` virtual workers x batch b against sync with 1 worker x batch P b on the same
       device: seconds per iteration, images/s, and steps/s / the single worker's (the same images per step).
  6.2  every registered algorithm with P workers x batch b: seconds per iteration / sync's (K-of-P arguments as
       the suite's, `args`; a K larger than P is cut to P // 2).
  6.3  sync with P workers, `model.dtype=bfloat16` (parameters stay float32) against float32.
The section's first line records what ran where (device kind, backend, jax version, model, P, b). Without a GPU
(`jax.default_backend() != 'gpu'`) the command prints one line and exits 0, unless `--force` (then it runs on
whatever backend there is: the CPU smoke test of the code path, `--quick --model=resnet_test`). `--quick`:
3 rounds, 4 iterations per call, algorithms sync, local_sgd, wagma and ksync only.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from waitless.cluster import registry
from benchmarks import cli
from benchmarks import timing
from waitless.experiments.configs import cifar10

QUICK_ALGORITHMS = ('sync', 'local_sgd', 'wagma', 'ksync')
_K_FIELDS = ('k', 'k0')  # K-of-P arguments: at most `workers`
_NUM_STEPS = 10_000      # the run's length (learning-rate schedule): larger than any warm-up; nothing runs that long


def _mock_cifar(examples: int):
  """CIFAR-shaped random examples from the cifar10 tfds builder, without data files."""
  import tensorflow as tf
  import tensorflow_datasets as tfds
  try:  # a GPU build of TensorFlow would otherwise take the GPU's memory from JAX (tensorflow-cpu: a no-op)
    tf.config.set_visible_devices([], 'GPU')
  except (RuntimeError, ValueError):  # TensorFlow already initialised: leave it as it is
    pass
  return tfds.testing.mock_data(num_examples=examples)


def _config(arg: str, model: str, workers: int, batch: int, dtype: str = 'float32'):
  """The cifar10 config of `arg` with `workers` workers x `batch` on one device, quick to build."""
  config = cifar10.get_config(arg)
  config.model.name = model
  config.model.dtype = dtype
  config.workers, config.devices, config.batch_size = workers, 1, batch
  config.num_steps, config.num_epochs = _NUM_STEPS, None
  config.dataset.shuffle_buffer = 16  # mock data: nothing to shuffle for
  for field in _K_FIELDS:
    if field in config.algorithm and config.algorithm[field] > workers:
      config.algorithm[field] = max(1, workers // 2)
  return config


def _label(name: str, config, defaults) -> str:
  """`name`, with the K-of-P fields that differ from the algorithm's defaults (`ksync k=6`)."""
  changed = [f'{f}={config.algorithm[f]}' for f in _K_FIELDS if f in config.algorithm and config.algorithm[f] !=
             defaults.get(f)]
  return ' '.join([name] + changed)


def _ms(seconds: float) -> str:
  return f'{1e3 * seconds:.2f}'


def section_gpu(out, quick: bool, model: str = 'resnet20', workers: int = 8, batch: int = 32,
                args: Mapping[str, str] | None = None) -> None:
  """Prints section 6 (markdown) to `out`; `args`: algorithm name -> its config argument ('ksync,k=6')."""
  args = dict(args or {})
  repeats, n = (3, 4) if quick else (15, 8)
  names = [name for name in registry.names() if not quick or name in QUICK_ALGORITHMS]
  device = jax.devices()[0]
  print(f'## 6. GPU: {model} on CIFAR-shaped data, {workers} virtual workers on one device\n', file=out)
  print(f'Ran on: {device.device_kind} (backend {jax.default_backend()}, {jax.device_count()} device(s), one '
        f'used), jax {jax.__version__}; model {model}, {workers} workers x batch {batch}, CIFAR-shaped mock '
        f'data; {n} iterations per call, median of {repeats} rounds{" (--quick: smoke test)" if quick else ""}.\n',
        file=out, flush=True)

  # One timer per config; sync with P workers in float32 is shared by the three tables.
  with _mock_cifar(max(64, workers * batch)):
    single = timing.BlockTimer(_config('sync', model, 1, workers * batch), n)
    timers, labels = {}, {}
    for name in names:
      config = _config(args.get(name, name), model, workers, batch)
      labels[name] = _label(name, config, registry.get(name).defaults)
      timers[name] = timing.BlockTimer(config, n)
    bf16 = timing.BlockTimer(_config('sync', model, workers, batch, dtype='bfloat16'), n)
  images = workers * batch  # per iteration, in every config

  print(f'### 6.1 {workers} virtual workers x batch {batch} against 1 worker x batch {workers * batch} (sync)\n',
        file=out)
  print('| config | ms/iteration | images/s | steps/s / 1 worker\'s |\n| --- | ---: | ---: | ---: |', file=out)
  virtual = f'{workers} workers x {batch}'
  result = timing.round_robin({virtual: timers['sync'], 'single': single}, virtual, repeats)
  (t_virtual, _), (t_single, single_over_virtual) = result[virtual], result['single']
  print(f'| sync, {virtual} | {_ms(t_virtual)} | {images / t_virtual:.0f} | {single_over_virtual:.2f}x |', file=out)
  print(f'| sync, 1 worker x {workers * batch} | {_ms(t_single)} | {images / t_single:.0f} | 1.00x |\n', file=out,
        flush=True)

  print(f'### 6.2 Algorithms against sync ({workers} workers x batch {batch}, one device)\n', file=out)
  print('| algorithm | ms/iteration | time / sync\'s |\n| --- | ---: | ---: |', file=out)
  for name, (seconds, ratio) in timing.round_robin(timers, 'sync', repeats).items():
    print(f'| {labels[name]} | {_ms(seconds)} | {ratio:.2f}x |', file=out)
  print('', file=out, flush=True)

  print(f'### 6.3 bfloat16 against float32 (sync, {workers} workers x batch {batch}, float32 parameters)\n',
        file=out)
  print('| model.dtype | ms/iteration | images/s | time / float32\'s |\n| --- | ---: | ---: | ---: |', file=out)
  result = timing.round_robin({'float32': timers['sync'], 'bfloat16': bf16}, 'float32', repeats)
  for dtype, (seconds, ratio) in result.items():
    print(f'| {dtype} | {_ms(seconds)} | {images / seconds:.0f} | {ratio:.2f}x |', file=out)
  print('', file=out, flush=True)


def main(argv):
  from absl import flags
  from absl import logging
  from waitless import config_errors as errors
  cli.no_positionals(argv)
  logging.set_verbosity(logging.WARNING)
  values = flags.FLAGS
  errors.require_int(values.workers, '--workers', 1)
  errors.require_int(values.batch, '--batch', 1)
  if jax.default_backend() != 'gpu' and not values.force:
    print(f'No GPU present (jax backend: {jax.default_backend()}): section 6 skipped (--force runs it anyway).')
    return 0
  section_gpu(sys.stdout, quick=values.quick, model=values.model, workers=values.workers, batch=values.batch)
  return 0


if __name__ == '__main__':
  from absl import flags
  # Defined here, not at import: benchmarks/run.py imports this module and has a --quick of its own.
  flags.DEFINE_bool('quick', False, 'A smoke test: 3 rounds, 4 algorithms (not figures to report).')
  flags.DEFINE_string('model', 'resnet20', 'cifar10 model.name (resnet_test: a tiny one, for CPU).')
  flags.DEFINE_integer('workers', 8, 'Virtual workers P on the one device.')
  flags.DEFINE_integer('batch', 32, 'Per-worker batch b (the single worker takes P x b).')
  flags.DEFINE_bool('force', False, 'Run even without a GPU (on the default backend).')
  cli.run(main)
