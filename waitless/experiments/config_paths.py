"""`--config=FILE[:ARG]` from anywhere: a config file named by its path inside the package.

The configs live in `waitless/experiments/configs/`. A checkout's root holds that path as it is; an installed
package does not, so a FILE that does not exist is looked up inside the installed package, both as
`waitless/experiments/configs/NAME.py` and as `experiments/configs/NAME.py` (the name the docs' commands use).
"""

from __future__ import annotations

import os
import re
import sys

from absl import flags
from ml_collections import config_flags

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../waitless


def config_flag() -> flags.FlagHolder:
  """The `--config` flag, defined by whichever program's module is imported first in the process (main, compare
  and simulate share it; the tests import several of them)."""
  if 'config' in flags.FLAGS:
    return flags.FlagHolder(flags.FLAGS, flags.FLAGS['config'])
  return config_flags.DEFINE_config_file('config', None, 'Config file and argument, e.g. '
                                         'experiments/configs/digits.py:sync', lock_config=True)


def resolve(path: str) -> str:
  """`path` if it exists, else the package's file of that relative name, else `path` unchanged (config_flags
  then reports it missing)."""
  if not path or os.path.exists(path) or os.path.isabs(path):  # '' is no file (not the package's directory)
    return path
  for base in (os.path.dirname(_PACKAGE), _PACKAGE):
    candidate = os.path.join(base, path)
    if os.path.exists(candidate):
      return candidate
  return path


def resolve_argv(argv: list[str], flag: str = 'config') -> list[str]:
  """`argv` with its `--flagfile=F` expanded (absl's own reading) and the file of each `--FLAG=FILE[:ARG]` (or
  `--FLAG FILE[:ARG]`) resolved by `resolve`."""
  out, prefix = list(flags.FLAGS.read_flags_from_files(list(argv), force_gnu=False)), f'--{flag}='
  for i, word in enumerate(out):
    if word.startswith(prefix):
      out[i] = prefix + _resolve_value(word[len(prefix):])
    elif word == f'--{flag}' and i + 1 < len(out):
      out[i + 1] = _resolve_value(out[i + 1])
  return out


def _resolve_value(value: str) -> str:
  path, colon, arg = value.partition(':')
  return resolve(path) + colon + arg


def _check_config_file(argv: list[str], flag: str = 'config') -> None:
  """Raises ValueError (one line naming the flag) for a `--config=` whose file part is empty or a directory:
  config_flags would say 'Configuration is not available ... Is a directory'."""
  prefix = f'--{flag}='
  for i, word in enumerate(argv):
    value = word[len(prefix):] if word.startswith(prefix) else (
        argv[i + 1] if word == f'--{flag}' and i + 1 < len(argv) else None)
    if value is None:
      continue
    path = value.partition(':')[0]
    if not path or os.path.isdir(path):
      raise ValueError(f'--{flag}={value!r} is not allowed: '
                       + ('name a config file' if not path else f'{path} is a directory, not a config file')
                       + ', e.g. --config=experiments/configs/digits.py:sync')


def _one_line(message: str) -> str:
  """The last line of a (possibly traceback-laden) message, without its exception class prefix."""
  lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
  match = re.match(r'^[\w.]*(?:Error|Exception): (.*)$', lines[-1]) if lines else None
  return match.group(1) if match else (lines[-1] if lines else message)


def parse_flags(argv: list[str], config: flags.FlagHolder) -> list[str]:
  """absl's parser for a program with a `--config` flag (`config`): a bad one (unknown algorithm, unknown key, a
  value of the wrong type, a missing file) is one line, exit 2."""
  try:
    argv = resolve_argv(argv)
    _check_config_file(argv)
    argv = flags.FLAGS(argv)
    if config.value is not None:
      config.value.get('workers')  # config_flags defers load errors to the first access
  except Exception as e:
    print(f'error: {_one_line(str(e))}', file=sys.stderr)
    sys.exit(2)
  if len(argv) > 1:  # e.g. the rest of a config argument cut by a line break: never run without it
    print(f'error: unexpected argument(s) {" ".join(argv[1:])!r}: only flags are accepted (a line break inside '
          '--config=FILE:ARG?)', file=sys.stderr)
    sys.exit(2)
  return argv
