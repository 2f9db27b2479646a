"""Start-up: a 10-step digits run of `experiments.main` against the bare imports of jax, flax, optax and orbax.

  python -m benchmarks.startup [--rounds=5]

Each round runs, one right after the other in fresh subprocesses (so that a shared machine's slower and faster
minutes hit them alike):
  (a) bare   `python -c "import jax, flax, optax, orbax.checkpoint"`;
  (b) cold   `python -m waitless.experiments.main --config=experiments/configs/digits.py:sync
             --config.num_steps=10 --workdir=<fresh>`, as a user runs it (no compilation cache);
  (c) warm   the same command with `--compilation_cache_dir=<dir>`, the cache filled by an identical run before
             it (the round's own first run with that flag, not timed).
Prints each round's seconds, the medians, the median of the rounds' ratios (b)/(a) and (c)/(a) (target <= 2x),
the load average before and after, and where one more run of (b), and one of (c), spend their time: imports
(timed by an import hook, by package), data loading, the initial state, each program's tracing, lowering and
compilation (JAX's compile log), checkpoints, the loop's remaining work (the 10 steps, evaluation, metrics), and
the rest (interpreter start and exit, flags, the backend's start). A breakdown run carries the hook and the log, so its
total is a little above the median of its kind.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags
from benchmarks import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BARE = 'import jax, flax, optax, orbax.checkpoint'
RUN_ARGS = ('--config=experiments/configs/digits.py:sync', '--config.num_steps=10')

# Run inside the breakdown's subprocess: exclusive seconds per phase (a phase's time excludes the imports and
# compilations inside it), then experiments.main as `python -m` runs it. Phases are entered by wrapping a few
# harness functions once their modules are imported.
_DRIVER = r'''
import builtins, collections, json, logging, os, re, runpy, sys, time
START = time.perf_counter()
totals = collections.Counter()
stack = [['other', START]]  # [phase, since]; time goes to the innermost phase

def push(phase):
  now = time.perf_counter()
  totals[stack[-1][0]] += now - stack[-1][1]
  stack.append([phase, now])

def pop():
  now = time.perf_counter()
  phase, since = stack.pop()
  totals[phase] += now - since
  stack[-1][1] = now

def timed(phase, fn):
  def wrapper(*args, **kwargs):
    push(phase)
    try:
      return fn(*args, **kwargs)
    finally:
      pop()
  return wrapper

TARGETS = {  # module: [(owner attribute or None, function name, phase)]
    'waitless.data.registry': [(None, 'make_dataset', 'data load')],
    'waitless.experiments.harness.setup': [(None, 'init_state', 'initial state')],
    'waitless.experiments.harness.loop': [('Loop', 'run', 'loop: 10 steps, evaluation, metrics')],
    'waitless.experiments.harness.checkpointing': [('Checkpointer', 'save', 'checkpoints'),
                                                   ('Checkpointer', 'close', 'checkpoints')],
}
real_import = builtins.__import__

def hooked_import(name, globals=None, locals=None, fromlist=(), level=0):
  package = name.split('.')[0] if level == 0 else (globals or {}).get('__package__', '?').split('.')[0]
  push('import ' + package)
  try:
    module = real_import(name, globals, locals, fromlist, level)
  finally:
    pop()
  if not any(phase.startswith('import ') for phase, _ in stack):  # the modules it imported are complete
    for target in [m for m in TARGETS if m in sys.modules]:
      for owner, attr, phase in TARGETS.pop(target):
        holder = getattr(sys.modules[target], owner) if owner else sys.modules[target]
        setattr(holder, attr, timed(phase, getattr(holder, attr)))
  return module

builtins.__import__ = hooked_import
FINISHED = re.compile(r'Finished (tracing|jaxpr to MLIR module conversion|XLA compilation) (?:of )?'
                      r'(?:jit\()?([^ )]+?)\)? (?:for jit )?in ([0-9.e-]+) sec')

class CompileLog(logging.Handler):
  def emit(self, record):
    match = FINISHED.search(record.getMessage())
    if match:
      kind = {'tracing': 'trace', 'XLA compilation': 'compile'}.get(match[1], 'lower')
      seconds = float(match[3])
      totals[f'{kind} {match[2]} (in {stack[-1][0]})'] += seconds
      totals[stack[-1][0]] -= seconds  # a part of the phase it ran in

def report():
  pop_all = time.perf_counter()
  totals[stack[-1][0]] += pop_all - stack[-1][1]
  with open(os.environ['STARTUP_BREAKDOWN'], 'w') as f:
    json.dump({'total_in_process': pop_all - START, 'phases': dict(totals)}, f)

os.environ['JAX_LOG_COMPILES'] = '1'
dispatch_log = logging.getLogger('jax._src.dispatch')
dispatch_log.addHandler(CompileLog())
dispatch_log.setLevel(logging.DEBUG)
sys.argv = ['waitless.experiments.main'] + sys.argv[1:]
try:
  runpy.run_module('waitless.experiments.main', run_name='__main__', alter_sys=True)
except SystemExit as e:
  if e.code not in (0, None):
    raise
finally:
  report()
'''


def _load() -> str:
  return ' '.join(f'{x:.2f}' for x in os.getloadavg())


def _timed(argv, env=None) -> float:
  """Seconds of one subprocess (it must succeed)."""
  begin = time.perf_counter()
  result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
  seconds = time.perf_counter() - begin
  if result.returncode:
    raise RuntimeError(f'{argv} exited {result.returncode}: {result.stderr[-2000:]}')
  return seconds


def _env() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k != 'JAX_LOG_COMPILES'}
  env['WAITLESS_COMPILATION_CACHE_DIR'] = ''  # cold: not the user's cache (experiments.main's default)
  env['PYTHONPATH'] = os.pathsep.join(p for p in (ROOT, env.get('PYTHONPATH')) if p)
  return env


def _run_argv(workdir: str, *extra: str) -> list[str]:
  return [sys.executable, '-m', 'waitless.experiments.main', *RUN_ARGS, f'--workdir={workdir}', *extra]


def paired_rounds(rounds: int) -> dict[str, list[float]]:
  """Seconds of (a), (b) and (c) per round, each in fresh subprocesses."""
  env = _env()
  times: dict[str, list[float]] = {'bare': [], 'cold': [], 'warm': []}
  for _ in range(rounds):
    with tempfile.TemporaryDirectory() as tmp:
      cache = os.path.join(tmp, 'cache')
      times['bare'].append(_timed([sys.executable, '-c', BARE], env))
      times['cold'].append(_timed(_run_argv(os.path.join(tmp, 'cold')), env))
      _timed(_run_argv(os.path.join(tmp, 'fill'), f'--compilation_cache_dir={cache}'), env)
      times['warm'].append(_timed(_run_argv(os.path.join(tmp, 'warm'), f'--compilation_cache_dir={cache}'), env))
  return times


def breakdown(warm: bool) -> tuple[float, dict[str, float]]:
  """(wall seconds, {phase: exclusive seconds}) of one more run of (b), or with `warm` of (c) (its cache filled
  first by the same command), under the driver above."""
  with tempfile.TemporaryDirectory() as tmp:
    env = _env()
    env['STARTUP_BREAKDOWN'] = os.path.join(tmp, 'breakdown.json')
    cache = [f'--compilation_cache_dir={os.path.join(tmp, "cache")}'] if warm else []
    if warm:
      _timed(_run_argv(os.path.join(tmp, 'fill'), *cache), env)
    seconds = _timed([sys.executable, '-c', _DRIVER, *RUN_ARGS, f'--workdir={os.path.join(tmp, "w")}', *cache], env)
    with open(env['STARTUP_BREAKDOWN']) as f:
      measured = json.load(f)
  phases = dict(measured['phases'])
  phases['interpreter start and exit (outside the driver)'] = seconds - measured['total_in_process']
  return seconds, phases


def _grouped(phases: dict[str, float], bare_packages: set[str]) -> list[tuple[str, float]]:
  """The breakdown's lines: imports by kind (top 3 other packages named), each compiled program, the phases."""
  groups: dict[str, float] = {}
  others: dict[str, float] = {}
  for name, seconds in phases.items():
    if name.startswith('import '):
      package = name.split()[1]
      if package == 'waitless':
        key = 'imports: waitless modules'
      elif package in bare_packages:
        key = 'imports: jax, flax, optax, orbax and what they import'
      else:
        others[package] = others.get(package, 0.0) + seconds
        continue
      groups[key] = groups.get(key, 0.0) + seconds
    else:
      groups[re.sub(r'^(trace|lower) ', r'\1 ', name)] = seconds
  top = sorted(others.items(), key=lambda kv: -kv[1])
  named = ', '.join(f'{p} {s:.2f}' for p, s in top[:3])
  groups[f'imports: other packages ({named or "none"})'] = sum(others.values())
  return sorted(groups.items(), key=lambda kv: -kv[1])


def _bare_packages() -> set[str]:
  out = subprocess.run([sys.executable, '-c', BARE + '; import sys; print(" ".join(sys.modules))'],
                       capture_output=True, text=True, check=True, env=_env())
  return {m.split('.')[0] for m in out.stdout.split()}


def table(times: dict[str, list[float]]) -> list[str]:
  """A markdown table of the rounds and their medians, and the line of the ratios."""
  ratio = lambda k: statistics.median(x / a for x, a in zip(times[k], times['bare']))
  lines = ['| round | (a) bare (s) | (b) cold (s) | (c) warm (s) | (b)/(a) | (c)/(a) |',
           '| --- | ---: | ---: | ---: | ---: | ---: |']
  for i, (a, b, c) in enumerate(zip(times['bare'], times['cold'], times['warm'])):
    lines.append(f'| {i + 1} | {a:.2f} | {b:.2f} | {c:.2f} | {b / a:.2f}x | {c / a:.2f}x |')
  med = {k: statistics.median(v) for k, v in times.items()}
  lines.append(f'| median | {med["bare"]:.2f} | {med["cold"]:.2f} | {med["warm"]:.2f} | {ratio("cold"):.2f}x '
               f'| {ratio("warm"):.2f}x |')
  lines.append(f'\n(b)/(a): **{ratio("cold"):.2f}x**, (c)/(a): **{ratio("warm"):.2f}x**, the medians of '
               f'{len(times["bare"])} rounds\' ratios (target <= 2x)')
  return lines


def section_startup(out, quick: bool) -> None:
  """Section 8 of `benchmarks.run`: the paired rounds (no breakdown)."""
  print('## 8. Start-up: a 10-step digits run against the bare imports\n', file=out)
  print('`python -m benchmarks.startup` (also prints where the run spends its time): fresh processes, one round '
        'after another; (a) `import jax, flax, optax, orbax.checkpoint`, (b) the run as a user starts it, (c) the '
        'same with a warm `--compilation_cache_dir`.\n', file=out)
  load = _load()
  times = paired_rounds(1 if quick else 5)
  print('\n'.join(table(times)) + f'; load average {load} before, {_load()} after\n', file=out, flush=True)


def main(argv):
  cli.no_positionals(argv)
  print(f'load average before: {_load()}  ({os.cpu_count()} CPUs)')
  times = paired_rounds(_ROUNDS.value)
  load_after = _load()
  print('\n'.join(table(times)) + f'; load average after: {load_after}')
  bare_packages = _bare_packages()
  for label, warm in (('(b)', False), ('(c)', True)):
    seconds, phases = breakdown(warm)
    print(f'\nwhere {label} spends its time (one more run, {seconds:.2f} s with the import hook and compile log; '
          'exclusive seconds; a cache hit\'s load counts in its phase):')
    for name, value in _grouped(phases, bare_packages):
      if value >= 0.005:
        print(f'  {value:7.2f}  {name}')
  print(f'load average at the end: {_load()}')


if __name__ == '__main__':
  _ROUNDS = flags.DEFINE_integer('rounds', 5, 'Paired rounds of (a), (b) and (c).')
  cli.run(main)
