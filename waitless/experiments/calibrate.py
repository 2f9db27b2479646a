r"""Measures the machine at hand and writes a cluster profile (`cluster/profiles.py`) for a config's model.

  python -m waitless.experiments.calibrate --config=experiments/configs/digits.py:sync,microbatches=4 \
      --processes=2 --out=this_machine.json
  python -m waitless.experiments.simulate --config=experiments/configs/digits.py:sync \
      --config.cluster.profile=this_machine.json

The measurements are `experiments/harness/measure.py`'s, the fits `cluster/calibration.py`'s; this program runs them
and writes the profile (docs/examples/this_machine.json is one). Each measurement is taken in several rounds
(`--rounds`; the harness's runs interleaved: every round runs each of them once, so that a change of the machine's
load moves them alike) and each figure is `calibration.figure` of its rounds: the median after the outliers are
dropped (`calibration.robust`), `spread` the kept rounds' scaled MAD, `rounds` every round's value, `dropped` the
outliers' indices and, for the harness's figures, `load` the load average when each round started:
  compute       one worker's micro-batch call of the config's model (`measure.microbatch_call`, what
                `benchmarks.call_overhead` times) at several sizes s, fitted as t(s) = c + s x per_sample_s
                (`calibration.fit_overhead`): per_sample_s; c, the cost of a separately dispatched call, is
                kept as `dispatch_overhead_s`
  harness       1-process `experiments.main` runs on measured time (`stragglers.kind=measured`, sync, one worker)
                at m = 1 and m = M micro-batches of the config's batch B: overhead_s = (T(M) - T(1)) / (M - 1),
                the per-micro-batch cost inside the harness's step (`calibration.fit_harness`)
  collectives   `--processes` real processes joined by `jax.distributed` over loopback, one CPU device each
                (`harness/collective_timing.py`, as `launch/multiprocess_cpu.sh` runs the harness): the
                bandwidths beta of the all-reduce (ring form) and of a ring shift (`calibration.fit_network`).
                The latencies alpha: what the harness pays for the model's collectives
                (`measure.harness_collectives`: sync, D-PSGD and never-averaging local SGD on `--processes`
                processes, nobody slowed), less the bandwidth term, per message (the micro-benchmark's latency,
                which a real step need not pay alone, is kept as `microbenchmark_latency_s`). host_s, the host's
                work per iteration that the device does not hide: the never-averaging local SGD's time per
                iteration less its micro-batch (overhead_s + B x per_sample_s), clamped at 0, as the processes pay
                it (on a shared machine each of several processes pays more than one process alone; the
                collectives' differences cancel that cost)
Run by the shaped test bed (`python -m waitless.experiments.testbed --cpus=... --rate_mbit=R -- calibrate ...`) it
runs on host 0 and starts process i of each measurement on host i (its cgroup and namespace), so that its compute,
host and collective figures are those of the bed's runs, the shaped link measured, nothing assumed; the collectives'
timing adapts its repetitions to each size's cost and leaves out sizes past `max_call_s` (a few minutes in all).
Several process counts (`--process_counts=2,3,4`: each >= 2, distinct, on the test bed none above its hosts, all
checked before any measurement) measure the collectives at each count and write the network in the structured form
(version 2, `structured_network`): the gloo stack's latency and bandwidth fitted on every count's all-reduce
(`calibration.fit_stack`), the point-to-point figures of the flat fit at `--processes` (one of the counts), every
figure's source naming what it was measured from; with three or more counts `network.holdout` records
`calibration.holdout_error` (fitted on all counts but the largest, the largest predicted: each size's relative error
and their mean absolute value), printed in one line. A fit the noise defeats ends in one line, status 1.
Without it the collectives are measured at `--processes` alone and the profile is version 1, as before; `--processes`
stays the count of the harness's runs either way.
On the bed it also measures the compute in one process on every host at once, each at its own quota
(`harness/host_compute.py`: the sustained rate of back-to-back calls over many of the quota's periods), and
records it per quota as the model's `per_cpu` ({"0.8": figure, "0.4": ...}); a quota need not slow compute in
proportion to its cores (the hosts share the machine's caches and memory), so the prediction takes a slow host's
factor from these (`profiles.quota_factors`). `--host_compute_only` adds them to an existing profile (e.g. from a
bed with a slow host: the quotas' figures measured on one bed, at once).
`--ray_p2p_only` adds `network.ray_p2p` to an existing profile, the point-to-point link the parameter-server
family's time rules charge for `runtime=ray` (`cluster.factory.effective`), where gloo's ring shift is not what
moves the bytes: its bandwidth from a push and its reply through Ray as the Ray runtime's learner and server make
them (`ray_runtime/transfer.py`: on the bed a learner on every host but host 0 pushing at once to a server on host
0, as a run's learners do, else on a local Ray), fitted to t = 2 alpha + 2 M / beta; its latency, on the bed, from
the Ray runtime itself (async SGD, a learner per host: a learner's cycle less its compute, per transfer, less the
bandwidth term), as the collectives' latencies come from the harness.
`--ray_learner_only` adds `network.ray_p2p.learner_s` to a profile that has `ray_p2p`: the part of a learner's
cycle through Ray (a push and its reply, beyond the job's compute) that is CPU work on the learner's own host, at
the quota the latency was measured at (the fastest of `per_cpu`). Run on a bed whose learner hosts all have
another measured quota q (e.g. --cpus=0.8,0.4,0.4): the Ray runtime's async run as `--ray_p2p_only`'s, a
learner's cycle less its job's compute at q (f x the profile's job, f = per_cpu[q] / per_cpu[fastest]) is the
transfers' time at q, T_q; the profile's 2 (latency + M / bandwidth) is T_1; learner_s = (T_q - T_1) / (f - 1),
the work that slows with the learner's quota as its compute does (the server's share is what stays).
`cluster.factory.effective` charges it as the learner's compute (per job, at its host's factor) and takes it out
of the transfers.
`--allreduce_only` refits an existing profile's all-reduce latency and bandwidth from the harness's all-reduce of
the whole model and of a fragment of it (`calibration.fit_allreduce_sizes`).
Ctrl-C, SIGINT or SIGTERM stop every process it started and end in one line, status 130.
An existing `--out` keeps its other models' compute entries (the new model's is replaced), so one profile can
hold several workloads. Bad input exits with status 2 and one line.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import signal
import sys
import tempfile
from typing import Mapping, Sequence

from absl import app
from absl import flags
import numpy as np

from waitless import config_errors as errors
from waitless.cluster import calibration
from waitless.cluster import network as network_lib
from waitless.cluster import profiles
from waitless.cluster import stacks
from waitless.experiments import config_paths
from waitless.experiments.harness import atomic_files
from waitless.experiments.harness import measure
from waitless.experiments.harness import tasks
from waitless.experiments.harness.testbed import placement

_CONFIG = config_paths.config_flag()
flags.declare_key_flag('config')
_PROCESSES = flags.DEFINE_integer('processes', 2, 'Processes of the collectives\' mesh (>= 2).')
_PROCESS_COUNTS = flags.DEFINE_list('process_counts', [], 'Process counts at which the collectives are measured, '
                                    'e.g. 2,3,4 (each >= 2, distinct): two or more fit the structured (version 2) '
                                    'network, three or more also record its hold-out; empty: --processes alone.')
_OUT = flags.DEFINE_string('out', None, 'The profile JSON to write.')
_NAME = flags.DEFINE_string('name', 'this_machine', 'The profile\'s name.')
_ROUNDS = flags.DEFINE_integer('rounds', 4, 'Rounds of each measurement (the spread of its fitted figures; '
                               'outliers are dropped from 3 rounds on).')
_REPEATS = flags.DEFINE_integer('repeats', 20, 'Timed calls per size of the compute measurement (median kept).')
_HARNESS_STEPS = flags.DEFINE_integer('harness_steps', 120, 'Iterations of each 1-process harness run.')
_HARNESS_M = flags.DEFINE_integer('harness_microbatches', 4, 'M, the larger micro-batch count of the harness runs '
                                  '(must divide batch_size).')
_HOST_COMPUTE = flags.DEFINE_bool('host_compute', True, 'On the test bed: also measure the compute on every host at '
                                  'its own quota (compute[model].per_cpu; the slow host\'s factor is their ratio).')
_HOST_COMPUTE_ONLY = flags.DEFINE_bool('host_compute_only', False, 'On the test bed: measure only the hosts\' compute '
                                       'and add it (per_cpu) to the existing --out profile, e.g. on a bed with a '
                                       'slow host to measure its quota.')
_RAY_P2P_ONLY = flags.DEFINE_bool('ray_p2p_only', False, 'Measure only a push and its reply through Ray (the Ray '
                                   'runtime\'s transfers) and add network.ray_p2p to the existing profile --out.')
_RAY_LEARNER_ONLY = flags.DEFINE_bool('ray_learner_only', False, 'On a bed whose learner hosts have a slower '
                                       'measured quota than the one network.ray_p2p was measured at: measure the Ray '
                                       'runtime\'s async run there and add network.ray_p2p.learner_s (the learner '
                                       'host\'s share of a cycle\'s transfers) to the existing profile --out.')
_RAY_SIZES = flags.DEFINE_list('ray_sizes', ['4096', '65536', '1048576', '4194304'],
                               'Bytes of the pushes (and replies) --ray_p2p_only times.')
_RAY_REPEATS = flags.DEFINE_integer('ray_repeats', 10, 'Timed push-and-reply calls per size and round (median).')
_ALLREDUCE_ONLY = flags.DEFINE_bool('allreduce_only', False, 'Measure only the harness\'s all-reduce of the whole '
                                     'model and of a fragment (streaming DiLoCo\'s, M / 2) on --processes processes '
                                     'and refit the existing profile --out\'s all-reduce latency and bandwidth from '
                                     'the two.')
_COLLECTIVE_SIZES = flags.DEFINE_list('collective_sizes', ['4096', '65536', '1048576', '16777216', '67108864'],
                                      'Bytes per collective.')

SOURCE = 'measured by experiments.calibrate'


def per_cpu_figures(fits_by_host: Sequence[np.ndarray], cpus: Sequence[float], size: int) -> dict:
  """compute[model].per_cpu: {"CORES": figure of per_sample_s} for each distinct quota of the bed's hosts, the
  rounds of every host at that quota pooled (`fits_by_host`: `measure.host_compute_fits`' rows, host i at
  `cpus[i]` cores)."""
  errors.require(len(fits_by_host) == len(cpus), 'cpus', list(cpus), f'one quota per host ({len(fits_by_host)})')
  out = {}
  for q in sorted(set(cpus), reverse=True):
    hosts = [i for i, c in enumerate(cpus) if c == q]
    rounds = np.concatenate([np.asarray(fits_by_host[i])[:, 0] for i in hosts])
    out[f'{q:g}'] = calibration.figure(
        rounds, f'{SOURCE}: one worker\'s micro-batch call of {size} samples back to back (the sustained rate over '
        f'many of the quota\'s periods) in a process on the test bed\'s host(s) {hosts} of {q:g} CPU (cgroup '
        'quota), every host measuring at once; seconds per sample, the rounds of those hosts pooled')
  return out


def host_compute(config, config_arg: str, flags_: list[str], rounds: int) -> dict:
  """`per_cpu_figures` of the bed this program runs on (`measure.host_compute_fits`, one process per host)."""
  bed = placement.current()
  errors.require(bed is not None, '--host_compute_only', True,
                 'needs the test bed (python -m waitless.experiments.testbed --cpus=... -- calibrate ...): a host\'s '
                 'quota is what it measures')
  previous = signal.signal(signal.SIGTERM, _interrupted)
  try:
    with tempfile.TemporaryDirectory(prefix='calibrate_hosts_') as tmp:
      fits = measure.host_compute_fits(config_arg, flags_, bed.spec.hosts, rounds, tmp)
  except KeyboardInterrupt:
    print('calibrate: interrupted; its processes are stopped and no profile was written', file=sys.stderr)
    sys.exit(130)
  finally:
    signal.signal(signal.SIGTERM, previous)
  return per_cpu_figures(fits, bed.spec.cpus, config.batch_size)


def add_host_compute(config, config_arg: str, flags_: list[str], out: str, rounds: int) -> dict:
  """`--host_compute_only`: the bed's `host_compute` merged into the existing profile `out` (its model's
  per_cpu: the quotas measured now replace theirs, the others are kept); returns the profile."""
  check_out(out)
  errors.require(os.path.isfile(out), '--out', out, 'must be an existing profile (--host_compute_only adds to it)')
  errors.require_int(rounds, '--rounds', 1)
  key = profiles.model_key(config)
  doc = profiles.read(out)
  errors.require(key in doc.get('compute', {}), '--out', out, f'has no compute entry for {key}: calibrate it first')
  per_cpu = host_compute(config, config_arg, flags_, rounds)
  doc['compute'][key]['per_cpu'] = {**doc['compute'][key].get('per_cpu', {}), **per_cpu}
  profiles.parse(doc, out)
  atomic_files.write_text(out, json.dumps(doc, indent=1) + '\n')
  return doc


def ray_p2p_figures(rows: Sequence[Sequence[float]], sizes: Sequence[int], where: str,
                    update_s: Sequence[float] = (), learners: int = 1, job_s: float = 0.0, nbytes: float = 0.0,
                    loads=None, model: str = '') -> dict:
  """network.ray_p2p: the bandwidth of a push and its reply through Ray (per round, the medians at `sizes` fitted to
  t = 2 alpha + 2 M / beta: `calibration.fit_alpha_beta`, two messages of M bytes), and the latency as the Ray
  runtime pays it: per round, its async run's cycle of a learner (`learners` x `update_s`, each update one push)
  less one job's compute `job_s`, per transfer (a push and a reply), less the bandwidth term of the model's
  `nbytes` (as `calibration.fit_network` takes the collectives' latencies from the harness); the echo's own
  latency kept as `microbenchmark_latency_s`. Without `update_s`, the echo's latency."""
  fits = np.array([calibration.fit_alpha_beta([2] * len(sizes), [2 * s for s in sizes], row) for row in rows])
  echo = (f'{SOURCE}: a push of M bytes and its reply of M bytes through Ray (an actor calling a threaded actor on '
          f'the server\'s node, as the Ray runtime\'s learner and server), {where}, sizes {list(sizes)} bytes, the '
          'median of the calls per size; t = 2 alpha + 2 M / beta, relative least squares; one direction\'s figures')
  bandwidth = calibration.figure(8.0 / fits[:, 1] / 1e9, echo)
  if not len(update_s):
    return {'latency_s': calibration.figure(fits[:, 0], echo), 'bandwidth_gbps': bandwidth}
  per_byte = 8.0 / (bandwidth['value'] * 1e9)  # seconds
  latency = [max((learners * u - job_s) / 2 - nbytes * per_byte, 0.0) for u in update_s]
  runtime = (f'{SOURCE}: the Ray runtime\'s async SGD with {learners} learner(s), {where}, the {model} model '
             f'({nbytes:.0f} bytes): a learner\'s cycle ({learners} x the seconds per update, '
             f'{[round(u, 5) for u in update_s]}) less one job\'s compute ({job_s:.4g} s, the profile\'s), per '
             'transfer (a push and its reply), less the bandwidth term of the echo')
  return {'latency_s': calibration.figure(latency, runtime, loads), 'bandwidth_gbps': bandwidth,
          'microbenchmark_latency_s': calibration.figure(fits[:, 0], echo)}


def ray_p2p(config, config_arg: str, flags_: list[str], doc: dict, sizes: Sequence[int], rounds: int, repeats: int,
            steps: int) -> dict:
  """`ray_p2p_figures` measured on the bed this program runs on (the server on host 0, a learner on every other),
  else on a local Ray: per round the echo, then the runtime's async run."""
  from waitless.experiments.harness.ray_runtime import transfer
  bed = placement.current()
  if bed is not None:
    errors.require(bed.spec.hosts >= 2, '--ray_p2p_only', True, 'needs a bed of 2 hosts or more')
  pushers = 1 if bed is None else bed.spec.hosts - 1  # a learner on every host but the server's, as a run's
  key, nbytes = profiles.model_key(config), tasks.model_bytes(config)
  compute = doc['compute'].get(key)
  errors.require(compute is not None, '--out', '(the profile)', f'has no compute entry for {key}: calibrate it first')
  job_s = compute['overhead_s']['value'] + config.batch_size * compute['per_sample_s']['value']  # one micro-batch
  cluster = transfer.local_cluster() if bed is None else transfer.bed_cluster(bed, placement.popen)

  def one_round(address, workdir):
    row = transfer.push_reply_rows(sizes, 1, repeats, pushers)
    return row, (None if address is None else
                 transfer.runtime_update_s(config_arg, flags_, pushers, steps, workdir, address))

  each, loads = _ray_rounds(cluster, rounds, one_round)
  rows = [row for rows_, _ in each for row in rows_]
  update_s = [u for _, u in each if u is not None]
  where = ('on this machine (a local Ray)' if bed is None else
           f'from each of hosts 1-{pushers} to host 0 at once over {placement.links()}')
  return ray_p2p_figures(rows, sizes, where, update_s, pushers, job_s, nbytes, loads, key)


def _ray_rounds(cluster, rounds: int, one_round) -> tuple[list, list[float]]:
  """`one_round(address, workdir)` once per round on the Ray cluster `cluster` (a context manager that yields its
  address) and the load average as each round starts; Ctrl-C or SIGTERM ends in one line, status 130."""
  previous = signal.signal(signal.SIGTERM, _interrupted)
  each, loads = [], []
  try:
    with cluster as address, tempfile.TemporaryDirectory(prefix='calibrate_ray_') as tmp:
      for r in range(rounds):
        loads.append(os.getloadavg()[0])
        each.append(one_round(address, os.path.join(tmp, str(r))))
  except KeyboardInterrupt:
    print('calibrate: interrupted; its processes are stopped and no profile was written', file=sys.stderr)
    sys.exit(130)
  finally:
    signal.signal(signal.SIGTERM, previous)
  return each, loads


def add_ray_p2p(config, config_arg: str, flags_: list[str], out: str, sizes: Sequence[int], rounds: int,
                repeats: int, steps: int) -> dict:
  """`--ray_p2p_only`: `ray_p2p` written into the existing profile `out` as its network's `ray_p2p`."""
  check_out(out)
  errors.require(os.path.isfile(out), '--out', out, 'must be an existing profile (--ray_p2p_only adds to it)')
  errors.require_int(rounds, '--rounds', 1)
  errors.require_int(repeats, '--ray_repeats', 1)
  errors.require(len(set(sizes)) >= 2, '--ray_sizes', list(sizes), 'needs two distinct sizes or more')
  doc = profiles.read(out)
  doc['network']['ray_p2p'] = ray_p2p(config, config_arg, flags_, doc, sizes, rounds, repeats, steps)
  profiles.parse(doc, out)
  atomic_files.write_text(out, json.dumps(doc, indent=1) + '\n')
  return doc


def ray_learner_figure(update_s: Sequence[float], learners: int, job_s: float, factor: float, transfer_s: float,
                       loads=None, model: str = '', where: str = '', quota: float = 0.0, base: float = 0.0) -> dict:
  """network.ray_p2p.learner_s: per round, the transfers' time of a learner's cycle at the slower quota (`learners` x
  `update_s` less the job's compute there, `factor` x `job_s`) less their time at the base quota (`transfer_s`, the
  profile's push and reply: 2 (latency + M / bandwidth)), over `factor` - 1: the seconds per cycle, at the base
  quota, of the work that slows with the learner host's quota (its own CPU's part of a push and its reply)."""
  errors.require(factor > 1.0, '--ray_learner_only', factor, 'needs the learner hosts on a slower measured quota than '
                 'the fastest of per_cpu (their compute factor must be > 1)')
  values = [(learners * u - factor * job_s - transfer_s) / (factor - 1.0) for u in update_s]
  source = (f'{SOURCE}: the Ray runtime\'s async SGD with {learners} learner(s) on hosts of {quota:g} CPU, {where}, '
            f'the {model} model: a learner\'s cycle ({learners} x the seconds per update, '
            f'{[round(u, 5) for u in update_s]}) less its job\'s compute there ({factor:.4g} x {job_s:.4g} s, the '
            f'factor of per_cpu {quota:g} against {base:g}), less the push and reply at {base:g} CPU '
            f'({transfer_s:.5g} s, the profile\'s ray_p2p), over the factor less 1: the learner host\'s share of its '
            'transfers, at the base quota')
  return calibration.figure(values, source, loads)


def add_ray_learner(config, config_arg: str, flags_: list[str], out: str, rounds: int, steps: int) -> dict:
  """`--ray_learner_only`: `ray_learner_figure` measured on the bed this program runs on, written into the existing
  profile `out` as `network.ray_p2p.learner_s`."""
  from waitless.experiments.harness.ray_runtime import transfer
  check_out(out)
  errors.require(os.path.isfile(out), '--out', out, 'must be an existing profile (--ray_learner_only adds to it)')
  errors.require_int(rounds, '--rounds', 1)
  bed = placement.current()
  errors.require(bed is not None and bed.spec.hosts >= 2, '--ray_learner_only', True,
                 'needs the test bed of 2 hosts or more (the learners\' quota is what it measures)')
  doc = profiles.read(out)
  errors.require('ray_p2p' in doc['network'], '--out', out, 'has no network.ray_p2p: run --ray_p2p_only first')
  key, nbytes = profiles.model_key(config), tasks.model_bytes(config)
  compute = doc['compute'].get(key)
  errors.require(compute is not None, '--out', out, f'has no compute entry for {key}: calibrate it first')
  quotas = set(bed.spec.cpus[1:])
  errors.require(len(quotas) == 1, '--cpus', list(bed.spec.cpus), 'the learner hosts (1..) need one quota')
  quota = quotas.pop()
  per_cpu = profiles.parse(doc, out).compute_for(key).per_cpu
  measured = dict(per_cpu)
  errors.require(quota in measured, '--cpus', quota, f'is not a quota of {key}\'s per_cpu: --host_compute_only first')
  base = max(measured)  # the fastest quota: the one ray_p2p was measured at, the bed's own
  factor = measured[quota] / measured[base]
  job_s = compute['overhead_s']['value'] + config.batch_size * compute['per_sample_s']['value']
  link = doc['network']['ray_p2p']
  transfer_s = 2 * (link['latency_s']['value'] + nbytes * 8.0 / (link['bandwidth_gbps']['value'] * 1e9))
  learners = bed.spec.hosts - 1
  update_s, loads = _ray_rounds(
      transfer.bed_cluster(bed, placement.popen), rounds,
      lambda address, workdir: transfer.runtime_update_s(config_arg, flags_, learners, steps, workdir, address))
  where = f'pushing from each of hosts 1-{learners} to host 0 at once over {placement.links()}'
  link['learner_s'] = ray_learner_figure(update_s, learners, job_s, factor, transfer_s, loads, key, where, quota,
                                         base)
  profiles.parse(doc, out)
  atomic_files.write_text(out, json.dumps(doc, indent=1) + '\n')
  return doc


def add_allreduce_sizes(config, config_arg: str, flags_: list[str], out: str, processes: int, rounds: int,
                        steps: int) -> dict:
  """`--allreduce_only`: per round the harness's all-reduce of the whole model and of one fragment
  (`measure.harness_allreduce_sizes`), fitted to the ring (`calibration.fit_allreduce_sizes`), written as the
  existing profile `out`'s `network.allreduce` latency and bandwidth (the figures they replace kept beside as
  `previous_latency_s` and `previous_bandwidth_gbps`); returns the profile."""
  check_out(out)
  errors.require(os.path.isfile(out), '--out', out, 'must be an existing profile (--allreduce_only refits it)')
  errors.require_int(rounds, '--rounds', 1)
  check_processes(processes)
  doc = profiles.read(out)
  errors.require('allreduce' in doc.get('network', {}) and doc.get('version') == 1, '--out', out,
                 'must be a version 1 profile with network.allreduce')
  nbytes, key = tasks.model_bytes(config), profiles.model_key(config)
  previous = signal.signal(signal.SIGTERM, _interrupted)
  loads, times = [], []
  try:
    with tempfile.TemporaryDirectory(prefix='calibrate_allreduce_') as tmp:
      for r in range(rounds):
        loads.append(os.getloadavg()[0])
        times.append(measure.harness_allreduce_sizes(config_arg, flags_, processes, steps, os.path.join(tmp, str(r))))
  except KeyboardInterrupt:
    print('calibrate: interrupted; its processes are stopped and no profile was written', file=sys.stderr)
    sys.exit(130)
  finally:
    signal.signal(signal.SIGTERM, previous)
  try:
    fits = np.array([calibration.fit_allreduce_sizes(w, f, nbytes, measure.FRAGMENTS, processes) for w, f in times])
  except ValueError as e:
    print(f'calibrate: {e}', file=sys.stderr)
    sys.exit(1)
  source = (f'{SOURCE}: {processes} processes of the harness on measured time over {placement.links()}, one worker '
            f'each, nobody slowed, the {key} model: sync (an all-reduce of {nbytes:.0f} bytes) and streaming DiLoCo '
            f'with {measure.FRAGMENTS} fragments, H = {measure.FRAGMENTS}, d = 0 (one of '
            f'{nbytes / measure.FRAGMENTS:.0f} bytes every step), each less local SGD that never averages; the ring '
            f'form through the two sizes (calibration.fit_allreduce_sizes); the harness\'s seconds per round (whole, '
            f'fragment): '
            f'{[[round(w, 5), round(f, 5)] for w, f in times]}')
  allreduce = doc['network']['allreduce']
  allreduce['previous_latency_s'] = allreduce['latency_s']
  allreduce['previous_bandwidth_gbps'] = allreduce['bandwidth_gbps']
  allreduce['latency_s'] = calibration.figure(fits[:, 0], source, loads)
  allreduce['bandwidth_gbps'] = calibration.figure(fits[:, 1], source, loads)
  profiles.parse(doc, out)
  atomic_files.write_text(out, json.dumps(doc, indent=1) + '\n')
  return doc


def network_figures(rows: dict, rounds: int, processes: int, harness: measure.HarnessRounds, nbytes: float,
                    model: str) -> dict:
  """The profile's `network` section: `calibration.fit_network`'s rounds as figures with their sources.

  The bandwidths are the collectives micro-benchmark's (`rows`); the latencies the harness's (`harness`: what its
  all-reduce and point-to-point exchange of the model's `nbytes` cost per iteration) less the bandwidth term; the
  micro-benchmark's own latencies are kept as `microbenchmark_latency_s`, and its rows as `measurements`.
  """
  harness_s = [(t.allreduce_s, t.p2p_s) for t in harness.collectives]
  fit = calibration.fit_network(rows, rounds, processes, harness_s, nbytes)
  harness_where = (f'{SOURCE}: {processes} processes of the harness on measured time, one worker each, nobody '
                   f'slowed, the {model} model ({nbytes:.0f} bytes): sync, D-PSGD and local SGD that never averages; '
                   f'the collective\'s time per iteration less the bandwidth term of the micro-benchmark, per message')
  where = (f'{SOURCE}: {processes} processes x 1 CPU device, jax.distributed over {placement.links()} (gloo), sizes '
           f'{sorted({row[2] for row in rows["allreduce"]})} bytes'
           + (f', {fit.dropped} of {sum(map(len, rows.values()))} timings below the noise dropped' if fit.dropped
              else ''))
  ring = where + '; psum, relative least squares on the ring form (calibration.fit_alpha_beta)'
  shift = where + '; a ring shift (ppermute), t = alpha + M / beta, relative least squares'
  figure = calibration.figure
  return {
      'allreduce': {'form': 'ring', 'latency_s': figure(fit.allreduce_latency_s, harness_where, harness.loads),
                    'bandwidth_gbps': figure(fit.allreduce[:, 1], ring),
                    'microbenchmark_latency_s': figure(fit.allreduce[:, 0], ring)},
      'p2p': {'latency_s': figure(fit.p2p_latency_s, harness_where, harness.loads),
              'bandwidth_gbps': figure(fit.p2p[:, 1], shift), 'microbenchmark_latency_s': figure(fit.p2p[:, 0], shift)},
      'measurements': rows,
  }


STACK_LIBRARY = 'gloo'  # JAX's CPU collectives


def own_count(rows_by_count: Mapping[int, dict]) -> dict[int, dict]:
  """Each count's rows with only its own mesh's all-reduces: `collective_timing` on N processes also times the
  sub-meshes 2..N-1 (their processes beside N - n idle ones); each count is taken from the run of that many."""
  return {n: {**rows, 'allreduce': [row for row in rows['allreduce'] if int(row[1]) == n]}
          for n, rows in rows_by_count.items()}


def median_rows(rows_by_count: Mapping[int, dict]) -> list[list[float]]:
  """[[n, bytes, seconds], ...]: each count's and size's all-reduce (its own mesh's, `own_count`), the median of
  its rounds' positive times."""
  times = {}
  for n, rows in own_count(rows_by_count).items():
    for _, _, nbytes, seconds in rows['allreduce']:
      if seconds > 0:
        times.setdefault((int(n), float(nbytes)), []).append(seconds)
  return [[n, m, float(np.median(t))] for (n, m), t in sorted(times.items())]


def structured_network(rows_by_count: Mapping[int, dict], rounds: int, processes: int, harness: measure.HarnessRounds,
                       nbytes: float, model: str) -> dict:
  """The profile's `network` section in the structured form (version 2, `stacks.Stack` of the gloo library), from
  the collectives measured at two or more process counts (`rows_by_count`: {n: `collective_rows`' rows}).

  `inter`: the latency and bandwidth of `calibration.fit_stack` on every count's all-reduce (each count's and size's
  median over the rounds, `median_rows`); `p2p`: the point-to-point figures of the flat fit (`network_figures` on
  the run on `processes`, one of the counts, as version 1 writes them: its latency the harness's). With three or
  more counts `holdout` records `calibration.holdout_error`: fitted on every count but the largest, the largest
  predicted (its count, each size's relative error predicted / measured - 1, their mean absolute value).
  """
  counts = sorted(rows_by_count)
  flat = network_figures(own_count(rows_by_count)[processes], rounds, processes, harness, nbytes, model)
  link = network_lib.AlphaBeta(latency_s=flat['allreduce']['microbenchmark_latency_s']['value'],
                               bandwidth_gbps=flat['allreduce']['bandwidth_gbps']['value'])
  p2p = network_lib.AlphaBeta(latency_s=flat['p2p']['latency_s']['value'],
                              bandwidth_gbps=flat['p2p']['bandwidth_gbps']['value'])
  skeleton = stacks.Stack(library=STACK_LIBRARY, gpus_per_node=1, inter=link, p2p_link=p2p)
  rows = median_rows(rows_by_count)
  fit = calibration.fit_stack(skeleton, rows)
  sizes = sorted({int(row[1]) for row in rows})
  where = (f'{SOURCE}: all-reduces (psum) at {counts} processes x 1 CPU device, jax.distributed over '
           f'{placement.links()} ({STACK_LIBRARY}), sizes {sizes} bytes, the median of {rounds} round(s) each; '
           f'calibration.fit_stack through the {STACK_LIBRARY} stack\'s ring (relative least squares), max |error| '
           f'{float(np.max(np.abs(fit.relative_errors))):.3g} over the rows fitted')
  network = {
      'library': STACK_LIBRARY,
      'gpus_per_node': {'value': 1, 'source': f'{SOURCE}: one CPU device per process, each process a node (its own '
                        'host on the test bed)'},
      'inter': {'latency_s': {'value': fit.latency_s, 'source': where},
                'bandwidth_gbps': {'value': fit.bandwidth_gbps, 'source': where}},
      'p2p': flat['p2p'],
      'fit': {'rows': rows, 'relative_errors': fit.relative_errors.tolist()},
  }
  if len(counts) >= 3:
    _, errors_ = calibration.holdout_error(skeleton, rows)
    held = counts[-1]
    network['holdout'] = {
        'held_out': held, 'fitted_on': counts[:-1],
        'relative_errors': {str(int(row[1])): float(e) for row, e in zip([r for r in rows if r[0] == held], errors_)},
        'mean_abs_error': float(np.mean(np.abs(errors_))),
        'source': f'{SOURCE}: calibration.holdout_error, fitted on {counts[:-1]} processes, {held} predicted; '
                  'predicted / measured - 1 per size'}
  network['measurements'] = {str(n): rows_by_count[n] for n in counts}
  return network


def holdout_line(network: Mapping) -> str | None:
  """One line of the hold-out a structured network records, None without one."""
  holdout = network.get('holdout')
  if holdout is None:
    return None
  errors_ = ', '.join(f'{size} B {100 * e:+.1f}%' for size, e in holdout['relative_errors'].items())
  return (f'calibrate: hold-out: fitted on {holdout["fitted_on"]} processes, {holdout["held_out"]} predicted within '
          f'{100 * holdout["mean_abs_error"]:.1f}% on average ({errors_})')


def calibrate(config, config_arg: str, flags_: list[str], processes: int, out: str, name: str, rounds: int,
              repeats: int, harness_steps: int, harness_m: int, collective_sizes: list[int],
              process_counts: Sequence[int] = (), hosts_compute: bool = True) -> dict:
  """Measures the machine, fits the figures and writes the profile to `out`; returns it.

  `config_arg`: the `--config` argument (its path and pairs, which every harness run repeats); `flags_`: the
  `--config.FIELD=VALUE` flags the program was given. The other arguments are the flags of the same names
  (`process_counts`: empty measures the collectives at `processes` alone and writes version 1; two or more counts
  measure them at each and write the structured network, `structured_network`; `hosts_compute`: on the test bed,
  also `host_compute`, each host's compute at its own quota, as the model's `per_cpu`).
  """
  errors.require_int(processes, '--processes', 2, why='the collectives need a mesh of 2 or more real processes '
                     '(one CPU device each, started here over loopback)')
  check_processes(processes)
  counts = check_process_counts(process_counts)
  errors.require(not counts or processes in counts, '--processes', processes,
                 f'must be one of --process_counts={",".join(map(str, counts))}: the harness runs on --processes '
                 'processes, and the point-to-point figures are those of that count\'s collectives')
  check_out(out)  # before the measurements: a path that cannot be written is news now, not minutes later
  check_collective_sizes(collective_sizes, max([processes, *counts]))
  errors.require_int(rounds, '--rounds', 1)
  errors.require_int(repeats, '--repeats', 1)
  errors.require_int(harness_steps, '--harness_steps', 20)
  errors.require_int(harness_m, '--harness_microbatches', 2, why='the harness is timed at m = 1 and m = M')
  errors.require(config.batch_size % harness_m == 0, '--harness_microbatches', harness_m,
                 f'must divide batch_size={config.batch_size}')
  key = profiles.model_key(config)
  doc = profiles.read(out) if os.path.isfile(out) else {}
  compute_fits, sizes, harness, rows = _measure(config, config_arg, flags_, processes, rounds, repeats, harness_steps,
                                                harness_m, collective_sizes, counts or [processes])
  batch = config.batch_size
  overheads, hosts = calibration.fit_harness(harness.single_s, harness_m,
                                             [t.no_collective_s for t in harness.collectives], batch,
                                             float(np.median(compute_fits[:, 0])))
  figure = calibration.figure
  harness_where = (f'{SOURCE}: 1-process sync runs of the harness on measured time, m = 1 and m = {harness_m}, '
                   f'batch {batch}, {harness_steps} steps')
  per_cpu = (host_compute(config, config_arg, flags_, rounds)
             if hosts_compute and placement.current() is not None else {})
  compute = dict(doc.get('compute', {}))
  compute[key] = {
      'per_sample_s': figure(compute_fits[:, 0], f'{SOURCE}: one worker\'s micro-batch call at {sizes} samples, '
                             'least squares t(s) = c + s x per_sample_s'),
      'overhead_s': figure(overheads, harness_where + ': (T(M) - T(1)) / (M - 1)', harness.loads),
      'dispatch_overhead_s': figure(compute_fits[:, 1], f'{SOURCE}: c of the call fit (a separately dispatched call; '
                                    'informational)'),
      **({'per_cpu': per_cpu} if per_cpu else {}),
  }
  try:  # a fit the noise defeats (times that do not grow with the size) is one line, not a traceback
    network = (structured_network(rows, rounds, processes, harness, tasks.model_bytes(config), key) if counts
               else network_figures(rows[processes], rounds, processes, harness, tasks.model_bytes(config), key))
  except ValueError as e:
    raise SystemExit(f'calibrate: the collectives\' fit failed: {e}') from e
  profile = {
      'version': profiles.STRUCTURED if counts else profiles.VERSION, 'name': name,
      'description': (f'{platform.node() or "this machine"}: {os.cpu_count()} CPU cores, '
                      f'{platform.processor() or platform.machine()}, calibrated '
                      f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC with {config_arg}'
                      + placement.bed_description()),
      'compute': compute,
      'network': network,
      'host_s': figure(hosts, f'{SOURCE}: {processes}-process local SGD of the harness that never averages, m = 1, '
                       f'batch {batch}, {harness_steps} steps, per iteration, minus overhead_s and B x per_sample_s',
                       harness.loads),
  }
  profiles.parse(profile, out)  # what it writes, it can read
  atomic_files.write_text(out, json.dumps(profile, indent=1) + '\n')  # a kill leaves the old profile or the new
  return profile


def check_out(out) -> None:
  """Raises ConfigError naming --out unless it names a file this program can write: its directory exists and is
  writable, and it is not a directory (an existing profile is read and extended)."""
  errors.require(bool(out), '--out', out, 'the profile JSON to write')
  directory = os.path.dirname(os.path.abspath(out))
  errors.require(not os.path.isdir(out), '--out', out, 'is a directory: name the profile JSON to write')
  errors.require(os.path.isdir(directory), '--out', out, f'its directory {directory} does not exist')
  errors.require(os.access(directory, os.W_OK | os.X_OK), '--out', out, f'its directory {directory} is not writable')
  if os.path.exists(out):
    try:
      profiles.read(out)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
      raise errors.ConfigError('--out', out, f'exists and is not a profile this program can extend ({e})') from e


def parse_ints(values: Sequence[str], flag: str, what: str) -> list[int]:
  """A list flag's values as integers; ConfigError naming `flag` for one that is not (`what`: what they count)."""
  try:
    return [int(v) for v in values]
  except ValueError:
    raise errors.ConfigError(flag, ','.join(values), f'must be integers ({what})') from None


def parse_process_counts(values: Sequence[str]) -> list[int]:
  return parse_ints(values, '--process_counts', 'process counts of the collectives, e.g. 2,3,4')


def check_process_counts(counts: Sequence[int]) -> list[int]:
  """The counts sorted: none, or two or more distinct integers >= 2 that fit in this machine's memory and, on the
  shaped test bed (process i on host i), none above its hosts. ConfigError naming --process_counts otherwise."""
  counts = list(counts)
  if not counts:
    return []
  shown = ','.join(map(str, counts))
  errors.require(all(errors.is_int(n) and n >= 2 for n in counts), '--process_counts', shown,
                 'must be integers >= 2 (the collectives need a mesh of 2 or more real processes)')
  errors.require(len(set(counts)) == len(counts), '--process_counts', shown, 'must be distinct')
  errors.require(len(counts) >= 2, '--process_counts', shown,
                 'must hold two or more counts (the structured fit needs them; one: use --processes)')
  hosts = placement.hosts()
  errors.require(hosts is None or max(counts) <= hosts, '--process_counts', shown,
                 f'the test bed has {hosts} hosts, one process each: no count above {hosts}')
  try:
    check_processes(max(counts))
  except errors.ConfigError as e:
    raise errors.ConfigError('--process_counts', shown, e.allowed) from None
  return sorted(counts)


PROCESS_RESIDENT_BYTES = 400e6  # a JAX process of the harness or the collectives' mesh (Python, JAX, its program)


def check_processes(processes: int) -> None:
  """--processes JAX processes must fit in this machine's memory (each about `PROCESS_RESIDENT_BYTES`)."""
  from waitless import machine
  available = machine.available_memory_bytes()
  need = processes * PROCESS_RESIDENT_BYTES
  errors.require(available is None or need <= 0.8 * available, '--processes', processes,
                 f'{processes} JAX processes need about {machine.gigabytes(need)}, more than this machine has '
                 f'({machine.gigabytes(available or 0)} available, {machine.cpu_count()} CPUs)')


def parse_collective_sizes(values: list[str]) -> list[int]:
  return parse_ints(values, '--collective_sizes', 'bytes per collective')


def check_collective_sizes(sizes: list[int], processes: int) -> None:
  """Two or more distinct sizes >= 4 bytes (the fit of latency and bandwidth needs two volumes), each small enough
  that `processes` processes hold a few buffers of it in this machine's memory."""
  from waitless import machine
  shown = ','.join(map(str, sizes))
  errors.require(all(errors.is_int(s) and s >= 4 for s in sizes), '--collective_sizes', shown,
                 'must be integers >= 4 (bytes per collective)')
  errors.require(len(set(sizes)) >= 2, '--collective_sizes', shown,
                 'must hold two or more distinct sizes: the latency and the bandwidth are fitted from them')
  available = machine.available_memory_bytes()
  need = 4 * processes * max(sizes)  # each process: its buffer, the result and the transfers'
  errors.require(available is None or need <= 0.5 * available, '--collective_sizes', shown,
                 f'the largest needs about {machine.gigabytes(need)} over {processes} processes, more than half the '
                 f'{machine.gigabytes(available or 0)} available')


def _interrupted(signum, frame):
  del signum, frame
  raise KeyboardInterrupt


def _measure(config, config_arg, flags_, processes, rounds, repeats, harness_steps, harness_m, collective_sizes,
             counts):
  """The measurements (`measure.compute_fits`, `harness_rounds`, `collective_rows` at each of `counts`: the rows by
  count). Ctrl-C, SIGINT or SIGTERM stop
  them in one line, status 130, once every process they started is gone (`measure.run_processes`)."""
  previous = signal.signal(signal.SIGTERM, _interrupted)
  try:
    compute_fits, sizes = measure.compute_fits(config, rounds, repeats)
    with tempfile.TemporaryDirectory(prefix='calibrate_') as tmp:
      harness = measure.harness_rounds(config_arg, flags_, processes, rounds, harness_steps, harness_m, tmp)
      rows = {n: measure.collective_rows(n, collective_sizes, rounds, os.path.join(tmp, f'collectives_n{n}'))
              for n in counts}
  except KeyboardInterrupt:
    print('calibrate: interrupted; its processes are stopped and no profile was written', file=sys.stderr)
    sys.exit(130)
  finally:
    signal.signal(signal.SIGTERM, previous)
  return compute_fits, sizes, harness, rows


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if _CONFIG.value is None:
    raise app.UsageError('--config is required, e.g. --config=experiments/configs/digits.py:sync')
  config_arg = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('--config='))
  overrides = [a for a in sys.argv if a.startswith('--config.') and not a.startswith('--config.cluster.')]
  try:
    if _RAY_P2P_ONLY.value:
      sizes = parse_ints(_RAY_SIZES.value, '--ray_sizes', 'bytes')
      doc = add_ray_p2p(_CONFIG.value, config_arg, overrides, _OUT.value, sizes, _ROUNDS.value, _RAY_REPEATS.value,
                        _HARNESS_STEPS.value)
      print(json.dumps({k: v['value'] for k, v in doc['network']['ray_p2p'].items()}, indent=1))
      return
    if _RAY_LEARNER_ONLY.value:
      doc = add_ray_learner(_CONFIG.value, config_arg, overrides, _OUT.value, _ROUNDS.value, _HARNESS_STEPS.value)
      print(json.dumps({k: v['value'] for k, v in doc['network']['ray_p2p'].items()}, indent=1))
      return
    if _ALLREDUCE_ONLY.value:
      doc = add_allreduce_sizes(_CONFIG.value, config_arg, overrides, _OUT.value, _PROCESSES.value, _ROUNDS.value,
                                _HARNESS_STEPS.value)
      print(json.dumps({k: v['value'] for k, v in doc['network']['allreduce'].items() if isinstance(v, dict)},
                       indent=1))
      return
    if _HOST_COMPUTE_ONLY.value:
      doc = add_host_compute(_CONFIG.value, config_arg, overrides, _OUT.value, _ROUNDS.value)
      print(json.dumps(doc['compute'][profiles.model_key(_CONFIG.value)]['per_cpu'], indent=1))
      return
    profile = calibrate(_CONFIG.value, config_arg, overrides, _PROCESSES.value, _OUT.value, _NAME.value, _ROUNDS.value,
                        _REPEATS.value, _HARNESS_STEPS.value, _HARNESS_M.value,
                        parse_collective_sizes(_COLLECTIVE_SIZES.value),
                        parse_process_counts(_PROCESS_COUNTS.value), _HOST_COMPUTE.value)
  except errors.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  summary = {k: v for k, v in profile.items() if k != 'network'}
  summary['network'] = {k: v for k, v in profile['network'].items() if k != 'measurements'}
  print(json.dumps(summary, indent=1))
  line = holdout_line(profile['network'])
  if line:
    print(line)


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: config_paths.parse_flags(argv, _CONFIG))  # a bad --config: one line
