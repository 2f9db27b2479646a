"""Runs on the test bed: one process per host, watched as `launch/multiprocess_cpu.sh` watches its processes.

  spmd_argv(args, hosts, i)    experiments.main's flags for host i of an SPMD run (jax.distributed, coordinator
                               on host 0's address inside the bed)
  ray_commands(hosts, ...)     Ray's head on host 0 and a node on every other host, then the driver on host 0
  watch(procs, stop)           waits for every process; one that fails stops the others (SIGTERM, then SIGKILL
                               after `grace_s`); `stop` set (a signal to the launcher) sends SIGINT first

A process of the bed and every process it starts lies in its host's cgroup, so whatever `watch` leaves running the
bed's `destroy` stops by pid. Nothing here imports JAX: the launcher starts in a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from waitless.experiments.harness.testbed import bed as bed_lib

COORDINATOR_PORT = 12355  # inside the bed's namespaces: nothing else listens there
RAY_PORT = 6379
SERVER_RESOURCE = 'waitless_server'  # ray_runtime/driver.py's: the node that has it holds the server


def spmd_argv(args: Sequence[str], hosts: int, host: int, port: int = COORDINATOR_PORT) -> list[str]:
  """experiments.main with `args` as process `host` of `hosts`, the coordinator on host 0 inside the bed."""
  return [sys.executable, '-m', 'waitless.experiments.main', *args,
          f'--coordinator_address={bed_lib.address(0)}:{port}', f'--num_processes={hosts}', f'--process_id={host}']


@dataclasses.dataclass
class Stop:
  """Set by the launcher's signal handler: the run is to stop (SIGINT to every process, SIGKILL after grace)."""
  requested: threading.Event = dataclasses.field(default_factory=threading.Event)


def watch(procs: Sequence[subprocess.Popen], stop: Stop | None = None, grace_s: float = 5.0,
          log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
          timeout_s: float | None = None) -> int:
  """Waits for `procs`; returns 0 if all succeeded, 130 if stopped, 124 past `timeout_s`, else the first failure's
  status. A failure stops the others: SIGTERM to their process groups, SIGKILL after `grace_s`."""
  stop = stop or Stop()
  status, kill_at, interrupted = 0, None, False
  begin = time.monotonic()
  running = dict(enumerate(procs))
  while running:
    if stop.requested.is_set() and not interrupted:
      interrupted = True
      log(f'[testbed] interrupted: stopping all {len(procs)} processes')
      _signal_all(running.values(), signal.SIGINT)
      kill_at = time.monotonic() + grace_s
    if timeout_s is not None and status == 0 and time.monotonic() - begin > timeout_s:
      status = 124
      log(f'[testbed] still running after {timeout_s:g} s: stopping all processes')
      _signal_all(running.values(), signal.SIGTERM)
      kill_at = time.monotonic() + grace_s
    for i, proc in list(running.items()):
      rc = proc.poll()
      if rc is None:
        continue
      del running[i]
      if rc and status == 0 and not interrupted:
        status = rc if rc > 0 else 128 - rc
        reason = f'exited with status {rc}' if rc > 0 else f'was killed by signal {-rc}'
        log(f'[testbed] process {i} (pid {proc.pid}) {reason}: stopping the other processes')
        _signal_all(running.values(), signal.SIGTERM)
        kill_at = time.monotonic() + grace_s
    if kill_at is not None and time.monotonic() >= kill_at and running:
      log(f'[testbed] {len(running)} process(es) still running after {grace_s:g}s: SIGKILL')
      _signal_all(running.values(), signal.SIGKILL)
      kill_at = None
    if running:
      time.sleep(0.2)
  return 130 if interrupted else status


def _signal_all(procs, sig: int) -> None:
  for proc in procs:
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(proc.pid, sig)


def ray_node_argv(hosts: int, host: int, cpus: int, temp_dir: str) -> list[str]:
  """`ray start` of host `host` in the foreground (`--block`: the launcher watches it): the head on host 0, with no
  CPU for learners (the driver and the server live there), a node of `cpus` learner slots on every other host."""
  ray = os.path.join(os.path.dirname(sys.executable), 'ray')
  common = ['--block', f'--node-ip-address={bed_lib.address(host)}', '--disable-usage-stats',
            '--object-store-memory=100000000', f'--temp-dir={temp_dir}']
  if host == 0:
    return [ray, 'start', '--head', f'--port={RAY_PORT}', '--num-cpus=0', '--include-dashboard=false',
            f'--resources={{"{SERVER_RESOURCE}": 1}}', *common]  # the server actor goes here (driver.py)
  return [ray, 'start', f'--address={bed_lib.address(0)}:{RAY_PORT}', f'--num-cpus={cpus}', *common]


WAIT_FOR_NODES = '''
import sys, time, ray
deadline = time.monotonic() + float(sys.argv[3])
while True:  # the head's GCS may not answer yet: a host at a fraction of a core starts it in seconds
  try:
    ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)
    break
  except (ConnectionError, RuntimeError) as e:
    if time.monotonic() > deadline:
      sys.exit('the Ray head at %s does not answer after %s s: %s' % (sys.argv[1], sys.argv[3], e))
    time.sleep(1.0)
while sum(n['Alive'] for n in ray.nodes()) < int(sys.argv[2]):
  if time.monotonic() > deadline:
    sys.exit('the Ray cluster has %d of %s nodes after %s s' % (sum(n['Alive'] for n in ray.nodes()), sys.argv[2],
                                                            sys.argv[3]))
  time.sleep(0.5)
'''


def ray_wait_argv(hosts: int, timeout_s: float = 120.0) -> list[str]:
  """A program (run on host 0) that returns once all `hosts` Ray nodes are alive, status 1 after `timeout_s`."""
  return [sys.executable, '-c', WAIT_FOR_NODES, f'{bed_lib.address(0)}:{RAY_PORT}', str(hosts), str(timeout_s)]


def ray_driver_argv(args: Sequence[str]) -> list[str]:
  """experiments.main with `args` (a `runtime=ray` config) joining the bed's Ray cluster."""
  return [sys.executable, '-m', 'waitless.experiments.main', *args, f'--ray_address={bed_lib.address(0)}:{RAY_PORT}']
