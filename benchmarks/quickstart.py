"""The main command end to end: wall time, peak memory and where each program's time goes.

  python -m benchmarks.quickstart [--workdir=DIR] [--same_table_as=runs/quickstart/comparison.md]

Runs the quickstart's comparison (`launch/quickstart.flags`, the flags `bash launch/quickstart.sh` passes) in a
fresh process on a fresh workdir with a cold compilation cache, as a user's first run after the install, and
prints:
  - the wall time of the whole command (imports, planning, every program, the report) and its peak resident
    memory (the process's maximum RSS);
  - per program (one algorithm's replicas): its wall time, the part spent tracing and compiling (JAX's own
    compile events, cache loads included), the part in the simulated clock (`Clock.next_block`), and the rest:
    the training blocks on the devices, evaluation, checkpoints and metrics (dispatched asynchronously, so not
    separable from one another without slowing them), and the process's peak resident memory when it ended (the
    program that raised it is where the whole command's peak comes from).
`--same_table_as=FILE` also checks that the table of comparison.md is the one in FILE, digit for digit (a
speed change must not move a result).
Run it on a quiet machine: the figures are wall-clock seconds.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGFILE = os.path.join(ROOT, 'launch', 'quickstart.flags')
COMPILE_EVENTS = ('/jax/core/compile/jaxpr_trace_duration', '/jax/core/compile/jaxpr_to_mlir_module_duration',
                  '/jax/core/compile/backend_compile_duration', '/jax/compilation_cache/cache_retrieval_time_sec')


def _child(workdir: str, report: str) -> None:
  """Runs the quickstart's compare in this process with timers on its programs, writing them to `report`."""
  import jax
  from absl import app
  from waitless.cluster import clock as clock_lib
  from waitless.experiments import compare
  from waitless.experiments import shared_flags
  from waitless.experiments.harness import train

  totals = collections.Counter()

  def on_duration(event, seconds, **_):
    if event in COMPILE_EVENTS:
      totals['compile'] += seconds
  jax.monitoring.register_event_duration_secs_listener(on_duration)

  def timed(owner, name, key):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
      begin = time.perf_counter()
      try:
        return original(*args, **kwargs)
      finally:
        totals[key] += time.perf_counter() - begin
    setattr(owner, name, wrapper)
    return original

  programs = []
  train_group = train.train_group

  def program(configs, workdirs, *args, **kwargs):
    before, begin = dict(totals), time.perf_counter()
    try:
      return train_group(configs, workdirs, *args, **kwargs)
    finally:
      wall = time.perf_counter() - begin
      spent = {k: totals[k] - before.get(k, 0.0) for k in ('compile', 'clock')}
      programs.append({'algorithm': configs[0].algorithm.name, 'runs': len(configs),
                       'steps': max(c.num_steps for c in configs), 'wall_s': wall, **spent,
                       'rest': wall - sum(spent.values()),
                       'peak_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
  train.train_group = program
  timed(clock_lib.Clock, 'next_block', 'clock')
  sys.argv = ['compare', f'--flagfile={FLAGFILE}', f'--workdir={workdir}']
  try:
    app.run(compare.main, flags_parser=shared_flags.parse_flags)  # as `python -m waitless.experiments.compare`
  except SystemExit as e:
    if e.code not in (0, None):
      raise
  finally:
    with open(report, 'w') as f:
      json.dump(programs, f)


def _table(path: str) -> list[str]:
  with open(path) as f:
    lines = f.read().splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith('| algorithm'))
  end = next((i for i in range(start, len(lines)) if not lines[i].startswith('|')), len(lines))
  return lines[start:end]


def main(argv: list[str]) -> int:
  options = dict(a[2:].split('=', 1) for a in argv if a.startswith('--') and '=' in a)
  workdir = options.get('workdir') or tempfile.mkdtemp(prefix='quickstart_bench_')
  report = os.path.join(workdir, 'program_times.json')
  os.makedirs(workdir, exist_ok=True)
  begin = time.perf_counter()
  done = subprocess.run([sys.executable, '-m', 'benchmarks.quickstart', '--child', f'--workdir={workdir}',
                         f'--report={report}'], cwd=ROOT, check=False)
  wall = time.perf_counter() - begin
  peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
  if done.returncode != 0:
    print(f'the quickstart exited {done.returncode}', file=sys.stderr)
    return done.returncode
  with open(report) as f:
    programs = json.load(f)
  print(f'\nload average before the end: {os.getloadavg()[0]:.1f}; cpu count {os.cpu_count()}')
  print('\n| program | runs | steps | wall (s) | trace + compile (s) | clock (s) | devices, eval, files (s) | '
        'peak memory after (MB) |')
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |')
  for p in programs:
    print(f'| {p["algorithm"]} | {p["runs"]} | {p["steps"]} | {p["wall_s"]:.1f} | {p["compile"]:.1f} | '
          f'{p["clock"]:.1f} | {p["rest"]:.1f} | {p.get("peak_mb", float("nan")):.0f} |')
  inside = sum(p['wall_s'] for p in programs)
  print(f'| all {len(programs)} programs | {sum(p["runs"] for p in programs)} | | {inside:.1f} | '
        f'{sum(p["compile"] for p in programs):.1f} | {sum(p["clock"] for p in programs):.1f} | '
        f'{sum(p["rest"] for p in programs):.1f} | |')
  print(f'\nthe whole command: {wall:.1f} s ({wall / 60:.2f} min; outside the programs: imports, planning, the '
        f'report: {wall - inside:.1f} s); peak resident memory {peak_mb:.0f} MB')
  if 'same_table_as' in options:
    same = _table(os.path.join(workdir, 'comparison.md')) == _table(options['same_table_as'])
    print(f'table digit for digit as in {options["same_table_as"]}: {"yes" if same else "NO"}')
    return 0 if same else 1
  print(f'table: {os.path.join(workdir, "comparison.md")}')
  return 0


if __name__ == '__main__':
  if '--child' in sys.argv:
    args = dict(a[2:].split('=', 1) for a in sys.argv if a.startswith('--') and '=' in a)
    _child(args['workdir'], args['report'])
  else:
    sys.exit(main(sys.argv[1:]))
