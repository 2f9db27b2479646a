"""What one call of a model's training step costs on this machine: per-call overhead and per-sample seconds.

  python -m benchmarks.call_overhead --config=experiments/configs/mnist1d.py            # the quickstart CNN
  python -m benchmarks.call_overhead --config=experiments/configs/digits.py --sizes=4,16,64

Times one worker's jitted step (`experiments.harness.measure.microbatch_call`: the gradient of the loss on one
micro-batch, then the config's SGD update) at each of `--sizes` samples (default: a quarter of the config's
micro-batch, batch_size / microbatches, and the micro-batch itself: the sizes that splitting it four ways
compares; on a CPU the time per sample grows with larger sizes, past the caches, and a line through far larger
sizes hides the overhead), fits t(s) = overhead + s x per_sample (`cluster.calibration.fit_overhead`), and prints
the fit, each size's measured and fitted time, the overhead as a share of one configured micro-batch call (the
ratio that the simulated runs of docs/results/nonblocking.md and lap_sgd.md carry over to their 10 ms steps), and
the `--config.stragglers.*` flags that put the calibration into a run.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags
import jax
from ml_collections import config_flags

from benchmarks import cli
from waitless.cluster import calibration
from waitless.experiments.harness import measure

_CONFIG = config_flags.DEFINE_config_file('config', 'experiments/configs/mnist1d.py', 'The workload.')
_SIZES = flags.DEFINE_list('sizes', [], 'Micro-batch sizes to time (default: a quarter of the configured one, '
                           'and the configured one).')
_REPEATS = flags.DEFINE_integer('repeats', 30, 'Timed calls per size (the median is kept).')


def main(argv):
  cli.no_positionals(argv)
  config = _CONFIG.value
  unit = config.batch_size // config.microbatches
  sizes = [int(s) for s in _SIZES.value] or [max(1, unit // 4), unit]
  seconds = measure.time_sizes(lambda s: measure.microbatch_call(config, s), sizes, warmup=3, repeats=_REPEATS.value,
                               carry=True)
  fit = calibration.fit_overhead(sizes, seconds)
  print(f'{config.model.name} on {jax.default_backend()} ({jax.devices()[0].device_kind}), one worker, '
        f'median of {_REPEATS.value} calls per size')
  for size, t in zip(sizes, seconds):
    print(f'  {size:>5} samples: {1e6 * t:9.1f} us measured, {1e6 * fit.seconds(size):9.1f} us fitted')
  print(f'overhead {1e6 * fit.overhead_s:.1f} us per call, {1e6 * fit.per_sample_s:.3f} us per sample'
        + (' (least squares gave a negative overhead: clamped to 0)' if fit.clamped else ''))
  share = fit.overhead_s / fit.seconds(unit)
  print(f'overhead share of one configured micro-batch call ({unit} samples): {share:.2f}')
  stragglers = calibration.calibrated(config.stragglers, fit.seconds(unit), overhead_s=fit.overhead_s)
  print(f'--config.stragglers.overhead_s={stragglers.overhead_s:.6g} '
        f'--config.stragglers.base_s={stragglers.base_s:.6g}  (kind={stragglers.kind})')


if __name__ == '__main__':
  cli.run(main)
