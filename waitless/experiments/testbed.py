r"""The shaped test bed: H hosts on this machine (network namespaces, a CPU quota each, tc-shaped links) and a run
of the project across them. Needs root; `harness/testbed/bed.py` describes the bed.

  python -m waitless.experiments.testbed --cpus=0.8,0.8 --rate_mbit=174 -- spmd \
      --config=experiments/configs/digits.py:sync,stragglers.kind=measured,workers=2,devices=2 --workdir=/tmp/tb_sync
  python -m waitless.experiments.testbed --cpus=0.8,0.8,0.8 --rate_mbit=174 -- ray \
      --config=experiments/configs/digits.py:kasync,k=1,runtime=ray,workers=2 --workdir=/tmp/tb_kasync
  python -m waitless.experiments.testbed --cpus=0.8,0.8 --rate_mbit=174 -- calibrate \
      --config=experiments/configs/digits.py:sync,microbatches=4 --processes=2 --out=bed.json
  python -m waitless.experiments.testbed --cpus=0.8,0.4 -- exec 1 python -c 'print(1)'   # one command on host 1
  python -m waitless.experiments.testbed --cpus=0.8,0.4 -- hold        # build it, print it, wait for Ctrl-C

Modes (after `--`):
  spmd ARGS       experiments.main ARGS on every host, process i on host i (jax.distributed, the coordinator on host
                  0); `ARGS` as for one process, the bed adds --coordinator_address, --num_processes, --process_id
  ray ARGS        Ray's head on host 0 (no learner slots: the driver and the server run there) and a node of
                  `--learners_per_host` slots on each other host; then experiments.main ARGS on host 0 with
                  --ray_address (a `runtime=ray` config whose `workers` the other hosts' slots hold)
  calibrate ARGS  experiments.calibrate ARGS on host 0, its processes on the hosts (process i on host i), so that it
                  measures the bed as its runs see it
  exec I CMD...   one command on host I
  hold            the bed until Ctrl-C or SIGTERM (`nsenter --net=/var/run/netns/NAME` joins a host's network)

Every namespace, link and cgroup the bed creates is removed on exit, on failure, on Ctrl-C and SIGTERM, and at the
next start after a kill -9 (the processes left in its cgroups are stopped). It never touches the machine's own
interfaces, routes or firewall. Without the privileges: one line, status 2. Status: the run's (130 if stopped).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

from absl import app
from absl import flags

from waitless import config_errors as errors
from waitless.experiments.harness.testbed import bed as bed_lib
from waitless.experiments.harness.testbed import placement
from waitless.experiments.harness.testbed import runs

_CPUS = flags.DEFINE_list('cpus', ['0.8', '0.8'], 'Per host (2-4 hosts), the cores its cgroup may use.')
_RATE = flags.DEFINE_float('rate_mbit', None, 'Every host link\'s rate per direction, Mbit/s (unset: unshaped).')
_BURST = flags.DEFINE_integer('burst_bytes', None, 'tbf\'s bucket (default: max(2 x mtu, rate x 1 ms)).')
_MTU = flags.DEFINE_integer('mtu', 9000, 'The links\' MTU (tbf\'s bucket must hold a packet).')
_WEIGHT = flags.DEFINE_integer('cpu_weight', None, 'The hosts\' cpu.shares (unset: 1024, a plain process\'s); '
                               'higher reserves their quotas on a machine with other work, at its expense.')
_LEARNERS = flags.DEFINE_integer('learners_per_host', 1, 'ray: learner slots on each host but host 0.')
_GRACE = flags.DEFINE_float('grace_s', 5.0, 'Seconds between SIGINT/SIGTERM and SIGKILL of the run\'s processes.')
_TIMEOUT = flags.DEFINE_float('timeout_s', None, 'Stop the run after this many seconds (status 124).')

MODES = ('spmd', 'ray', 'calibrate', 'exec', 'hold')


def spec_from_flags() -> bed_lib.Spec:
  try:
    cpus = tuple(float(c) for c in _CPUS.value)
  except ValueError:
    raise errors.ConfigError('--cpus', ','.join(_CPUS.value), 'one number of cores per host, e.g. 0.8,0.4') from None
  return bed_lib.Spec(cpus=cpus, rate_mbit=_RATE.value, burst_bytes=_BURST.value, mtu=_MTU.value,
                      cpu_weight=_WEIGHT.value)


def describe(bed: bed_lib.Bed) -> str:
  spec = bed.spec
  rate = f'{spec.rate_mbit:g} Mbit/s per direction (tbf, burst {spec.burst} B)' if spec.rate_mbit else 'unshaped'
  hosts = ', '.join(f'host {i} {bed_lib.address(i)} {c:g} CPU' for i, c in enumerate(spec.cpus))
  return f'[testbed] {bed.id}: {hosts}; links {rate}, mtu {spec.mtu}'


def check_mode(spec: bed_lib.Spec, mode: str, args: list[str]) -> int:
  """The mode's arguments checked before the bed is built: 0, or the exit status of a refusal (one line printed).
  A quota sum above the machine's cores is allowed (each host's quota still caps it) but said: the hosts then
  share the cores and a host need not get its quota."""
  hosts = spec.hosts
  cores = os.cpu_count() or 1
  if sum(spec.cpus) > cores:
    print(f'[testbed] warning: the quotas sum to {sum(spec.cpus):g} cores on a {cores}-core machine: a host may get '
          'less than its quota', file=sys.stderr, flush=True)
  if mode == 'exec':
    errors.require(len(args) >= 2 and args[0].isdigit() and int(args[0]) < hosts, 'exec', ' '.join(args),
                   f'give a host 0..{hosts - 1} and a command')
  if mode == 'spmd':
    validate = subprocess.run([sys.executable, '-m', 'waitless.experiments.main', *args, f'--num_processes={hosts}',
                               '--validate_only'], check=False)
    return validate.returncode
  return 0


def run_mode(bed: bed_lib.Bed, mode: str, args: list[str], stop: runs.Stop) -> int:
  """Runs `mode` with `args` on `bed` (checked by `check_mode`); returns the exit status."""
  hosts = bed.spec.hosts
  watch = dict(stop=stop, grace_s=_GRACE.value, timeout_s=_TIMEOUT.value)
  if mode == 'spmd':
    procs = [bed.popen(i, runs.spmd_argv(args, hosts, i)) for i in range(hosts)]
    return runs.watch(procs, **watch)
  if mode == 'exec':
    return runs.watch([bed.popen(int(args[0]), args[1:])], **watch)
  if mode == 'calibrate':
    env = dict(os.environ, **{placement.ENV_TESTBED: bed.id})
    return runs.watch([bed.popen(0, [sys.executable, '-m', 'waitless.experiments.calibrate', *args], env=env)], **watch)
  if mode == 'hold':
    print(f'[testbed] holding the bed: `nsenter --net={bed_lib.NETNS_DIR}/{bed.namespaces[0]} CMD` runs on host 0; '
          'Ctrl-C removes it', flush=True)
    stop.requested.wait(_TIMEOUT.value)
    return 130 if stop.requested.is_set() else 0
  # ray: the nodes run (in the foreground, `--block`) while the driver runs; the bed's cleanup stops what is left.
  # The bed's Ray is its own: token authentication off for all of it (`ray start` would otherwise take up a token
  # file another Ray left in ~/.ray, which the driver, its mode unset, does not send).
  env = dict(os.environ, RAY_AUTH_MODE='disabled')
  with tempfile.TemporaryDirectory(prefix=f'wltb{bed.id}') as tmp:
    for i in range(hosts):
      bed.popen(i, runs.ray_node_argv(hosts, i, _LEARNERS.value, os.path.join(tmp, f'h{i}')), env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    status = runs.watch([bed.popen(0, runs.ray_wait_argv(hosts), env=env)], **watch)
    if status == 0:
      status = runs.watch([bed.popen(0, runs.ray_driver_argv(args), env=env)], **watch)
    print(f'[testbed] links: {json.dumps(bed.qdisc_stats())}', flush=True)
    bed.destroy()  # the Ray daemons are in the hosts' cgroups: stopped before their temporary directory goes
    return status


def main(argv):
  if len(argv) < 2 or argv[1] not in MODES:
    print(f'error: give a mode after `--`: one of {", ".join(MODES)} (e.g. `-- spmd --config=...`)', file=sys.stderr)
    sys.exit(2)
  mode, args = argv[1], argv[2:]
  stop = runs.Stop()
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda *_: stop.requested.set())
  try:
    spec = spec_from_flags()
    refused = check_mode(spec, mode, args)
    if refused:
      sys.exit(refused)
    bed = bed_lib.Bed.create(spec)
  except (errors.ConfigError, bed_lib.Unavailable) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  try:
    print(describe(bed), flush=True)
    status = 130 if stop.requested.is_set() else run_mode(bed, mode, args, stop)
    if mode != 'ray':
      print(f'[testbed] links: {json.dumps(bed.qdisc_stats())}', flush=True)
  except errors.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    status = 2
  finally:
    bed.destroy()
  sys.exit(status)


if __name__ == '__main__':
  app.run(main)
