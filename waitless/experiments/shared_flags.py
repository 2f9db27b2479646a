"""The flags that `experiments.main` and `experiments.compare` share, their parser, and the host device count.

No JAX import: a program sets `--config.devices` host devices (`force_host_devices`) before JAX starts a backend.
"""

from __future__ import annotations

import os
import re
import sys

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
    'compilation_cache_dir', os.environ.get('WAITLESS_COMPILATION_CACHE_DIR') or None,
    'Keep every compiled program in this directory and reuse it in later runs (same results, no compilation); '
    'default $WAITLESS_COMPILATION_CACHE_DIR, unset: off.')
flags.mark_flags_as_required(['config', 'workdir'])


def force_host_devices(count: int) -> None:
  """Makes the CPU platform expose `count` devices; must run before JAX initialises its backends."""
  flag = f'--xla_force_host_platform_device_count={count}'
  existing = [f for f in os.environ.get('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
  os.environ['XLA_FLAGS'] = ' '.join(existing + [flag])


def _one_line(message: str) -> str:
  """The last line of a (possibly traceback-laden) message, without its exception class prefix."""
  lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
  match = re.match(r'^[\w.]*(?:Error|Exception): (.*)$', lines[-1]) if lines else None
  return match.group(1) if match else (lines[-1] if lines else message)


def parse_flags(argv):
  """absl's parser; a bad --config (unknown algorithm, unknown key, missing file) is one line, exit 2."""
  try:
    argv = flags.FLAGS(config_paths.resolve_argv(argv))
    CONFIG.value.get('workers')  # config_flags defers load errors to the first access
  except Exception as e:  # pylint: disable=broad-except
    print(f'error: {_one_line(str(e))}', file=sys.stderr)
    sys.exit(2)
  if len(argv) > 1:  # e.g. the rest of a config argument cut by a line break: never run without it
    print(f'error: unexpected argument(s) {" ".join(argv[1:])!r}: only flags are accepted (a line break inside '
          '--config=FILE:ARG?)', file=sys.stderr)
    sys.exit(2)
  return argv
