"""The flags that `experiments.main` and `experiments.compare` share, their parser, and the host device count.

No JAX import: a program sets `--config.devices` host devices (`force_host_devices`) before JAX starts a backend.
"""

from __future__ import annotations

import os

from absl import flags

from waitless.experiments import config_paths

CONFIG = config_paths.config_flag()
flags.declare_key_flag('config')  # in `--help` of the programs that adopt this module's flags
WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for metrics, checkpoints and the summary.')
SEEDS = flags.DEFINE_integer(
    'seeds', 1, 'Runs of each config with seeds config.seed + 0 .. N-1, trained as the replicas of one compiled '
    'program (experiments.main: with N > 1 each in WORKDIR/seed<S>; experiments.compare: every entry and sweep point).')
MAX_REPLICAS = flags.DEFINE_integer(
    'max_replicas', None, 'At most this many runs in one compiled program (default: as many as fit in memory; '
    'more runs are split into several programs).')
COMPILATION_CACHE = flags.DEFINE_string(
    'compilation_cache_dir', None,
    'Keep every compiled program in this directory (at most 2 GiB) and reuse it in later runs (same results, no '
    "compilation); '' for none. Default: experiments.main $WAITLESS_COMPILATION_CACHE_DIR, else "
    '~/.cache/waitless/jax; experiments.compare WORKDIR/jax_cache.')
flags.mark_flags_as_required(['config', 'workdir'])


def force_host_devices(count: int) -> None:
  """Makes the CPU platform expose `count` devices; must run before JAX initialises its backends."""
  flag = f'--xla_force_host_platform_device_count={count}'
  existing = [f for f in os.environ.get('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
  os.environ['XLA_FLAGS'] = ' '.join(existing + [flag])


def parse_flags(argv):
  """absl's parser; a bad --config (unknown algorithm, unknown key, missing file) is one line, exit 2."""
  return config_paths.parse_flags(argv, CONFIG)
