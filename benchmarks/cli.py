"""What every benchmark program does with its command line and signals (issue 59): flags checked before any work
(unknown positional arguments, counts, output paths), a user error one line `error: ...` with exit status 2, and
Ctrl-C or SIGTERM one line that stops the benchmark's child processes (exit 130 or 143).

  from benchmarks import cli
  ...
  def main(argv):
    cli.no_positionals(argv)
    sizes = cli.int_list(_WORKERS.value, '--workers', minimum=1)
  if __name__ == '__main__':
    cli.run(main)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Callable, NoReturn, Sequence

from absl import app
import numpy as np

from waitless import config_errors as errors
from waitless.experiments.harness.preemption import Preempted

_CHILDREN: list[subprocess.Popen] = []


def refuse(message: str) -> NoReturn:
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def no_positionals(argv: Sequence[str], allowed: int = 0) -> list[str]:
  """The positional arguments after the program's name (at most `allowed`); more is a ConfigError naming them."""
  extra = list(argv[1:])
  errors.require(len(extra) <= allowed, 'arguments', ' '.join(extra),
                 'this benchmark takes ' + ('no positional arguments' if not allowed else f'at most {allowed}')
                 + ' (flags are --name=value)')
  return extra


def int_list(values: Sequence[str], flag: str, minimum: int = 1) -> list[int]:
  """A list flag's values as integers >= `minimum`; a ConfigError naming the flag for any other."""
  shown = ','.join(values)
  try:
    numbers = [int(v) for v in values]
  except ValueError:
    raise errors.ConfigError(flag, shown, f'must be integers >= {minimum}') from None
  errors.require(bool(numbers) and all(n >= minimum for n in numbers), flag, shown, f'must be integers >= {minimum}')
  return numbers


def spread(values, form: str = '.3g', scale: float = 1.0) -> str:
  """'median [min, max]' of `values` times `scale` (None left out; 'not reached' when none is left): how a
  benchmark prints repeated measurements."""
  values = [v * scale for v in values if v is not None]
  if not values:
    return 'not reached'
  return f'{np.median(values):{form}} [{min(values):{form}}, {max(values):{form}}]'


def load_or_run(from_json: str, run: Callable[[], list], out: str, loaded: Callable[[list], list] = lambda r: r):
  """A benchmark's results: those of earlier --out files (`from_json`, comma-separated: their lists joined,
  passed through `loaded`), or `run()`'s; written to `out` when given (atomically)."""
  from waitless.experiments.harness import atomic_files
  if from_json:
    results = []
    for path in from_json.split(','):
      with open(path) as f:
        results += json.load(f)
    results = loaded(results)
  else:
    results = run()
  if out:
    atomic_files.write_json(out, results, indent=1)
  return results


def output_directory(path: str, flag: str) -> None:
  """`path` can hold the benchmark's output files: an existing writable directory, or one that can be made in an
  existing writable directory (made here, before any work)."""
  if os.path.isdir(path):
    errors.require(os.access(path, os.W_OK | os.X_OK), flag, path, 'is not a writable directory')
    return
  errors.require(not os.path.exists(path), flag, path, 'exists and is not a directory')
  parent = os.path.dirname(os.path.abspath(path))
  errors.require(os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK), flag, path,
                 f'cannot be made: {parent} is not a writable directory')
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise errors.ConfigError(flag, path, f'cannot be made ({e.strerror})') from None


def output_file(path: str, flag: str, make_directory: bool = False) -> None:
  """`path` can be written at the end of the run: not a directory, in an existing writable directory (made here
  with `make_directory`). Checked before any work, so that a typo does not cost the benchmark's minutes."""
  errors.require(not os.path.isdir(path), flag, path, 'is a directory: name the file to write')
  directory = os.path.dirname(os.path.abspath(path))
  if make_directory and not os.path.exists(directory):
    try:
      output_directory(directory, flag)
    except errors.ConfigError as e:
      raise errors.ConfigError(flag, path, f'its directory {directory} {e.allowed}') from None
  errors.require(os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK), flag, path,
                 f'its directory {directory} does not exist or is not writable')


def track(process: subprocess.Popen) -> subprocess.Popen:
  """A child process that Ctrl-C or SIGTERM stops with the benchmark."""
  _CHILDREN.append(process)
  return process


def stop_children() -> None:
  """Terminates the tracked children that still run (killed after 10 s) and waits for them."""
  for process in _CHILDREN:
    if process.poll() is None:
      process.terminate()
  for process in _CHILDREN:
    try:
      process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      process.kill()


class _Terminated(Exception):
  pass


def _on_sigterm(signum, frame):
  del signum, frame
  raise _Terminated()


def run(main: Callable[[list[str]], None]) -> None:
  """`app.run(main)`, with a user error (`config_errors.ConfigError`) one line and exit 2, and Ctrl-C or SIGTERM one
  line, the tracked children stopped, exit 130 or 143."""

  def guarded(argv):
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
      main(argv)
    except errors.ConfigError as e:
      refuse(str(e))
    except (KeyboardInterrupt, _Terminated, Preempted) as e:
      # A training run inside the benchmark takes the signals over while it runs: it checkpoints and raises
      # Preempted (first signal) or Interrupted (second); either way the benchmark stops as for its own signal.
      signal.signal(signal.SIGINT, signal.SIG_IGN)
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
      stop_children()
      terminated = isinstance(e, _Terminated) or getattr(e, 'signal_name', None) == 'SIGTERM'
      name = 'SIGTERM' if terminated else 'Ctrl-C'
      print(f'interrupted ({name}): stopped{" with its child processes" if _CHILDREN else ""}; nothing more is '
            'printed', file=sys.stderr)
      sys.exit(143 if terminated else 130)

  app.run(guarded)
