r"""Measures the machine at hand and writes a cluster profile (`cluster/profiles.py`) for a config's model.

  python -m waitless.experiments.calibrate --config=experiments/configs/digits.py:sync,microbatches=4 \
      --processes=2 --out=this_machine.json
  python -m waitless.experiments.simulate --config=experiments/configs/digits.py:sync \
      --config.cluster.profile=this_machine.json

Three measurements, each fitted several times (`--rounds`; the harness's runs interleaved: every round runs
each of them once, so that a change of the machine's load moves them alike). A figure is the median of its
rounds after the outliers are dropped (a round further than 3 scaled median absolute deviations from the
median: another user's job landed on it, `cluster.profile_figures.robust`); `spread` is the kept rounds'
scaled MAD, `rounds` every round's value, `dropped` the outliers' indices and, for the harness's figures,
`load` the load average when each round started:
  compute       one worker's micro-batch call of the config's model (`harness.call_timing.make_call`, what
                `benchmarks.call_overhead` times) at several sizes s, fitted as t(s) = c + s x per_sample_s
                (`calibration.fit_overhead`): per_sample_s; c, the cost of a separately dispatched call, is
                kept as `dispatch_overhead_s`
  harness       1-process `experiments.main` runs on measured time (`stragglers.kind=measured`, sync, one worker)
                at m = 1 and m = M micro-batches of the config's batch B: an iteration takes
                T(m) = host_s + m x overhead_s + B x per_sample_s, so overhead_s = (T(M) - T(1)) / (M - 1), the
                per-micro-batch cost inside the harness's step (clamped at 0)
  collectives   `--processes` real processes joined by `jax.distributed` over loopback, one CPU device each
                (`harness.collective_timing`, as `launch/multiprocess_cpu.sh` runs the harness): all-reduce at
                several sizes and participant counts, fitted to the ring t = 2(n-1) alpha + 2 (n-1)/n M / beta,
                and a ring shift, t = alpha + M / beta (both by relative least squares,
                `calibration.fit_alpha_beta`): the bandwidths beta. The latencies alpha: what the harness pays
                for the model's collectives (`harness_collectives`: sync, D-PSGD and never-averaging local SGD
                on `--processes` processes, nobody slowed), less the bandwidth term, per message (the
                micro-benchmark's latency, which a real step need not pay alone, is kept as
                `microbenchmark_latency_s`). host_s, the host's work per iteration that the device does not
                hide: the never-averaging local SGD's time per iteration less its micro-batch (overhead_s + B x
                per_sample_s), clamped at 0, as the processes pay it (on a shared machine more than one process
                alone pays: 0.12 ms alone, about 2 ms each of 2 on a quiet 2-core machine, a cost the
                collectives' differences cancel)
An existing `--out` keeps its other models' compute entries (the new model's is replaced), so one profile can
hold several workloads. Bad input exits with status 2 and one line.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from typing import NamedTuple

from absl import app
from absl import flags
import numpy as np

from waitless import config_errors as errors
from waitless.cluster import profile_figures as pf
from waitless.experiments import config_paths

_CONFIG = config_paths.config_flag()
flags.declare_key_flag('config')
_PROCESSES = flags.DEFINE_integer('processes', 2, 'Processes of the collectives\' mesh (>= 2).')
_OUT = flags.DEFINE_string('out', None, 'The profile JSON to write.')
_NAME = flags.DEFINE_string('name', 'this_machine', 'The profile\'s name.')
_ROUNDS = flags.DEFINE_integer('rounds', 4, 'Rounds of each measurement (the spread of its fitted figures; '
                               'outliers are dropped from 3 rounds on).')
_REPEATS = flags.DEFINE_integer('repeats', 20, 'Timed calls per size of the compute measurement (median kept).')
_HARNESS_STEPS = flags.DEFINE_integer('harness_steps', 120, 'Iterations of each 1-process harness run.')
_HARNESS_M = flags.DEFINE_integer('harness_microbatches', 4, 'M, the larger micro-batch count of the harness runs '
                                  '(must divide batch_size).')
_COLLECTIVE_SIZES = flags.DEFINE_list('collective_sizes', ['4096', '65536', '1048576', '16777216', '67108864'],
                                      'Bytes per collective.')

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure_compute(config, rounds: int, repeats: int) -> tuple[np.ndarray, list]:
  """(per-round (per_sample_s, dispatch overhead), sizes) of the config's micro-batch call."""
  from waitless.cluster import calibration
  from waitless.experiments.harness import call_timing
  unit = config.batch_size // config.microbatches
  sizes = sorted({max(1, unit // 4), unit, 4 * unit, 16 * unit})  # far apart: a small model's noise
  calls = {s: call_timing.make_call(config, s) for s in sizes}
  fits = []
  for _ in range(rounds):
    for attempt in range(3):  # a round whose times do not grow with the size (a noisy moment) is timed again
      seconds = calibration.time_sizes(lambda s: calls[s], sizes, warmup=3, repeats=repeats, carry=True)
      try:
        fit = calibration.fit_overhead(sizes, seconds)
        break
      except ValueError as e:
        if attempt == 2:
          raise SystemExit(f'calibrate: {e}') from e
    fits.append((fit.per_sample_s, fit.overhead_s))
  return np.asarray(fits), sizes


def harness_seconds_per_iteration(config_arg: str, flags_: list[str], algorithm: str, microbatches: int, steps: int,
                                  workdir: str, processes: int = 1) -> float:
  """Median measured seconds per iteration of a run of the harness (rows after the first) on `processes` local
  processes, one worker and one CPU device each (`launch/multiprocess_cpu.sh` for more than one); `algorithm`:
  its name and pairs; `flags_`: the `--config.FIELD=VALUE` flags calibrate was given."""
  path, _, arg = config_arg.partition(':')
  pairs = ','.join([algorithm] + [p for p in arg.split(',')[1:] if p] + [
      'stragglers.kind=measured', f'workers={processes}', f'devices={processes}', f'microbatches={microbatches}',
      f'num_steps={steps}', f'eval_every={steps}', 'log_every=10', f'checkpoint_every={steps}', 'cluster.profile=""'])
  program = ([sys.executable, '-m', 'waitless.experiments.main'] if processes == 1 else
             ['bash', os.path.join(ROOT, 'launch', 'multiprocess_cpu.sh'), str(processes)])
  done = subprocess.run(program + [f'--config={path}:{pairs}', f'--workdir={workdir}', *flags_], cwd=ROOT,
                        capture_output=True, text=True, check=False)
  if done.returncode:
    raise SystemExit(f'the harness run failed (status {done.returncode}): {done.stderr[-2000:]}')
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  steps_ = np.array([r['step'] for r in rows], np.float64)
  times = np.array([r['sim_time'] for r in rows], np.float64)
  return float(np.median(np.diff(times) / np.diff(steps_)))


class HarnessTimes(NamedTuple):
  """What one round of `harness_collectives` measured, in seconds per iteration."""
  allreduce_s: float       # the all-reduce: sync less the never-averaging local SGD
  p2p_s: float             # one point-to-point exchange: D-PSGD less it, per ring neighbour
  no_collective_s: float   # the never-averaging local SGD itself: an iteration without any collective


def harness_collectives(config_arg: str, flags_: list[str], processes: int, steps: int,
                        workdir: str) -> HarnessTimes:
  """The `HarnessTimes` of the config's model as the harness pays them on `processes` processes: sync, D-PSGD
  (ring_neighbours exchanges) and local SGD that never averages within the run, one micro-batch, nobody slowed,
  run one after another (a round: a change of load between rounds moves its three runs alike); a collective's
  time is its run's time per iteration minus local SGD's, and local SGD's is what an iteration costs there
  without any collective (`calibrate` takes the host's time from it)."""
  from waitless.cluster.rules import ring
  seconds = {name: harness_seconds_per_iteration(config_arg, flags_, name, 1, steps, os.path.join(workdir, slug),
                                                 processes)
             for name, slug in (('sync', 'sync'), (f'local_sgd,local_steps={steps}', 'local'), ('dpsgd', 'dpsgd'))}
  local = seconds[f'local_sgd,local_steps={steps}']
  return HarnessTimes(seconds['sync'] - local, (seconds['dpsgd'] - local) / ring.ring_neighbours(processes),
                      local)


def measure_collectives(processes: int, sizes: list[int], rounds: int, tmp: str) -> dict:
  """The rows of `harness.collective_timing`, run on `processes` local processes."""
  from waitless.experiments.harness import distributed
  out = os.path.join(tmp, 'collectives.json')
  address = f'127.0.0.1:{distributed.free_port()}'
  command = [sys.executable, '-m', 'waitless.experiments.harness.collective_timing', f'--coordinator_address={address}',
             f'--num_processes={processes}', f'--out={out}', f'--sizes={",".join(map(str, sizes))}',
             f'--rounds={rounds}']
  procs = [subprocess.Popen(command + [f'--process_id={i}'], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True) for i in range(processes)]
  failed = [(p.wait(), p.stderr.read()) for p in procs]
  bad = [(rc, err) for rc, err in failed if rc]
  if bad:
    raise SystemExit(f'the collectives\' processes failed (status {bad[0][0]}): {bad[0][1][-2000:]}')
  with open(out) as f:
    return json.load(f)


def network_figures(rows: dict, rounds: int, processes: int, in_harness: list, nbytes: float, model: str,
                    loads=None) -> dict:
  """The profile's `network` section from the collectives' rows, fitted per round: the bandwidths from the
  micro-benchmark's fit; the latencies from `in_harness` (`HarnessTimes` per round: all-reduce, point-to-point, of
  the model's `nbytes` as the harness pays them, `harness_collectives`) less the bandwidth term, at least 0. The
  micro-benchmark's own latencies are kept as `microbenchmark_latency_s`; `loads`: the load average when each
  round of `in_harness` started."""
  from waitless.cluster import calibration
  allreduce, p2p = [], []
  kept = {kind: [row for row in rows[kind] if row[-1] > 0] for kind in rows}  # <= 0: below the timer's noise
  dropped = sum(len(rows[kind]) - len(kept[kind]) for kind in rows)
  for r in range(rounds):
    ar = np.array([row[1:] for row in kept['allreduce'] if row[0] == r], np.float64)
    alpha, per_byte = calibration.fit_alpha_beta(2 * (ar[:, 0] - 1), 2 * (ar[:, 0] - 1) / ar[:, 0] * ar[:, 1],
                                                 ar[:, 2])
    allreduce.append((alpha, 8.0 / per_byte / 1e9))
    pp = np.array([row[1:] for row in kept['p2p'] if row[0] == r], np.float64)
    alpha, per_byte = calibration.fit_alpha_beta(np.ones(len(pp)), pp[:, 0], pp[:, 1])
    p2p.append((alpha, 8.0 / per_byte / 1e9))
  allreduce, p2p = np.asarray(allreduce), np.asarray(p2p)
  n = processes
  volume = 2 * (n - 1) / n * nbytes * 8 / 1e9
  harness = np.asarray([(t.allreduce_s, t.p2p_s) for t in in_harness], np.float64)
  ar_latency = np.maximum(harness[:, 0] - volume / np.median(allreduce[:, 1]), 0) / (2 * (n - 1))
  p2p_latency = np.maximum(harness[:, 1] - nbytes * 8 / 1e9 / np.median(p2p[:, 1]), 0)
  harness_where = (f'measured by experiments.calibrate: {n} processes of the harness on measured time, one '
                   f'worker each, nobody slowed, the {model} model ({nbytes:.0f} bytes): sync, D-PSGD and local SGD '
                   f'that never averages; the collective\'s time per iteration less the bandwidth term of the '
                   f'micro-benchmark, per message')
  where = (f'measured by experiments.calibrate: {processes} processes x 1 CPU device, jax.distributed over '
           f'loopback (gloo), sizes {sorted({row[2] for row in rows["allreduce"]})} bytes'
           + (f', {dropped} of {sum(map(len, rows.values()))} timings below the noise dropped' if dropped else ''))
  ring = where + '; psum, relative least squares on the ring form (calibration.fit_alpha_beta)'
  shift = where + '; a ring shift (ppermute), t = alpha + M / beta, relative least squares'
  return {
      'allreduce': {'form': 'ring', 'latency_s': pf.figure(ar_latency, harness_where, loads),
                    'bandwidth_gbps': pf.figure(allreduce[:, 1], ring),
                    'microbenchmark_latency_s': pf.figure(allreduce[:, 0], ring)},
      'p2p': {'latency_s': pf.figure(p2p_latency, harness_where, loads), 'bandwidth_gbps': pf.figure(p2p[:, 1], shift),
              'microbenchmark_latency_s': pf.figure(p2p[:, 0], shift)},
      'measurements': rows,
  }


def calibrate(config, config_arg: str, flags_: list[str], processes: int, out: str, name: str, rounds: int,
              repeats: int, harness_steps: int, harness_m: int, collective_sizes: list[int]) -> dict:
  """Measures and writes the profile; returns it."""
  from waitless.cluster import profiles
  from waitless.experiments.harness import tasks
  errors.require_int(processes, '--processes', 2, why='the collectives need a mesh of 2 or more real processes '
                     '(one CPU device each, started here over loopback)')
  errors.require(bool(out), '--out', out, 'the profile JSON to write')
  errors.require_int(rounds, '--rounds', 1)
  errors.require_int(repeats, '--repeats', 1)
  errors.require_int(harness_steps, '--harness_steps', 20)
  errors.require_int(harness_m, '--harness_microbatches', 2, why='the harness is timed at m = 1 and m = M')
  errors.require(config.batch_size % harness_m == 0, '--harness_microbatches', harness_m,
                 f'must divide batch_size={config.batch_size}')
  key = profiles.model_key(config)
  doc = profiles.read(out) if os.path.isfile(out) else {}
  compute_fits, sizes = measure_compute(config, rounds, repeats)
  per_sample = float(np.median(compute_fits[:, 0]))
  batch = config.batch_size
  overheads, hosts, in_harness, loads = [], [], [], []
  with tempfile.TemporaryDirectory(prefix='calibrate_') as tmp:
    for r in range(rounds):
      loads.append(os.getloadavg()[0])
      in_harness.append(harness_collectives(config_arg, flags_, processes, harness_steps,
                                            os.path.join(tmp, f'collectives_{r}')))
      t1 = harness_seconds_per_iteration(config_arg, flags_, 'sync', 1, harness_steps, os.path.join(tmp, f'm1_{r}'))
      tm = harness_seconds_per_iteration(config_arg, flags_, 'sync', harness_m, harness_steps,
                                         os.path.join(tmp, f'mM_{r}'))
      overhead = max((tm - t1) / (harness_m - 1), 0.0)
      overheads.append(overhead)
      # The host's time as the processes pay it: N processes of the harness on one machine pay more per
      # iteration than one (2 ms more on a quiet 2-core machine) without any collective, and the collectives'
      # differences cancel that base cost: it is taken from the never-averaging local SGD of the round.
      hosts.append(max(in_harness[-1].no_collective_s - overhead - batch * per_sample, 0.0))
    rows = measure_collectives(processes, collective_sizes, rounds, tmp)
  harness_where = (f'measured by experiments.calibrate: 1-process sync runs of the harness on measured time, '
                   f'm = 1 and m = {harness_m}, batch {batch}, {harness_steps} steps')
  compute = dict(doc.get('compute', {}))
  compute[key] = {
      'per_sample_s': pf.figure(compute_fits[:, 0], f'measured by experiments.calibrate: one worker\'s micro-batch '
                              f'call at {sizes} samples, least squares t(s) = c + s x per_sample_s'),
      'overhead_s': pf.figure(overheads, harness_where + ': (T(M) - T(1)) / (M - 1)', loads),
      'dispatch_overhead_s': pf.figure(compute_fits[:, 1], 'measured by experiments.calibrate: c of the call fit (a '
                                     'separately dispatched call; informational)'),
  }
  profile = {
      'version': profiles.VERSION, 'name': name,
      'description': (f'{platform.node() or "this machine"}: {os.cpu_count()} CPU cores, '
                      f'{platform.processor() or platform.machine()}, calibrated '
                      f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC with {config_arg}'),
      'compute': compute,
      'network': network_figures(rows, rounds, processes, in_harness, tasks.model_bytes(config), key, loads),
      'host_s': pf.figure(hosts, f'measured by experiments.calibrate: {processes}-process local SGD of the harness '
                          f'that never averages, m = 1, batch {batch}, {harness_steps} steps, per iteration, minus '
                          'overhead_s and B x per_sample_s', loads),
  }
  profiles.parse(profile, out)  # what it writes, it can read
  with open(out, 'w') as f:
    json.dump(profile, f, indent=1)
    f.write('\n')
  return profile


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if _CONFIG.value is None:
    raise app.UsageError('--config is required, e.g. --config=experiments/configs/digits.py:sync')
  config_arg = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('--config='))
  overrides = [a for a in sys.argv if a.startswith('--config.') and not a.startswith('--config.cluster.')]
  try:
    profile = calibrate(_CONFIG.value, config_arg, overrides, _PROCESSES.value, _OUT.value, _NAME.value, _ROUNDS.value,
                        _REPEATS.value, _HARNESS_STEPS.value, _HARNESS_M.value,
                        [int(s) for s in _COLLECTIVE_SIZES.value])
  except errors.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  summary = {k: v for k, v in profile.items() if k != 'network'}
  summary['network'] = {k: v for k, v in profile['network'].items() if k != 'measurements'}
  print(json.dumps(summary, indent=1))


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: flags.FLAGS(config_paths.resolve_argv(argv)))
