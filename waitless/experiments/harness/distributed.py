"""Multi-host runs on JAX's multi-controller runtime: one Python process per host (or per GPU), one program.

Every process runs the same `python -m waitless.experiments.main ...` command; `jax.distributed` connects them through
a coordinator (process 0) so that `jax.devices()` lists every process's devices and the worker mesh spans them
all. Each process feeds only its own workers' data (`WorkerLayout.local_worker_ids()`), process 0 alone writes
metrics and the summary, and orbax writes each process's shards of a checkpoint.

The processes are found, in this order of precedence, from:
  * flags: `--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (a missing one is detected),
  * the environment: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`,
  * JAX's cluster detection (SLURM, Open MPI, Cloud TPU pods), with `--distributed` and no other setting.
Without any of these a run is one process, exactly as before.

A process that dies (killed, out of memory, a lost host) stops the others: every process sends heartbeats to
the coordinator, and one that misses them for `heartbeat_timeout_s` makes the coordinator fail the whole job
(a survivor exits with an error naming the missing task instead of waiting forever in a collective).
Rerunning the same command resumes every process from the last checkpoint they all completed.

Example (two processes on one machine, 4 CPU devices each; `launch/multiprocess_cpu.sh` does this):

  python -m waitless.experiments.main --config=experiments/configs/digits.py:sync --workdir=/tmp/d \
      --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=0 &
  python -m waitless.experiments.main --config=experiments/configs/digits.py:sync --workdir=/tmp/d \
      --coordinator_address=127.0.0.1:12355 --num_processes=2 --process_id=1
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
from typing import Mapping

from waitless import config_errors as errors

log = logging.getLogger('waitless')

ENV_COORDINATOR = 'JAX_COORDINATOR_ADDRESS'
ENV_NUM_PROCESSES = 'JAX_NUM_PROCESSES'
ENV_PROCESS_ID = 'JAX_PROCESS_ID'
ENV_HOST_ADDRESS = 'WAITLESS_HOST_ADDRESS'  # this host's address, where the hostname's is not its own (the test bed)

DEFAULT_HEARTBEAT_TIMEOUT_S = 60
DEFAULT_INITIALIZATION_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Settings:
  """How this process joins a multi-process run; None fields are left to JAX's cluster detection."""
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S
  initialization_timeout_s: int = DEFAULT_INITIALIZATION_TIMEOUT_S

  @property
  def loopback(self) -> bool:
    """Whether the coordinator is on this machine's loopback interface (a local multi-process run)."""
    if not self.coordinator_address:
      return False
    host = self.coordinator_address.rsplit(':', 1)[0].strip('[]')
    if host == 'localhost':
      return True
    try:
      return ipaddress.ip_address(host).is_loopback
    except ValueError:
      return False


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
  raw = environ.get(name, '').strip()
  if not raw:
    return None
  try:
    return int(raw)
  except ValueError:
    raise errors.ConfigError(f'${name}', raw, 'must be an integer') from None


def settings_from(coordinator_address: str | None = None, num_processes: int | None = None,
                  process_id: int | None = None, auto: bool = False,
                  heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
                  initialization_timeout_s: int = DEFAULT_INITIALIZATION_TIMEOUT_S,
                  environ: Mapping[str, str] | None = None) -> Settings | None:
  """The multi-process settings from flags, else the environment; None for a single-process run.

  Args:
    coordinator_address: `HOST:PORT` of process 0's coordinator service (flag), or None.
    num_processes: processes in the run (flag), or None.
    process_id: this process's id in 0..num_processes-1 (flag), or None.
    auto: join a multi-process run even if nothing else is set, letting JAX detect the cluster (SLURM,
      Open MPI, Cloud TPU pod).
    heartbeat_timeout_s: seconds without a heartbeat after which a process counts as dead.
    initialization_timeout_s: seconds to wait for every process to connect.
    environ: the environment (default `os.environ`).

  Returns:
    Settings, or None when the run is one process (nothing set, or `num_processes` 1 and no coordinator).

  Raises:
    errors.ConfigError: a value is out of range.
  """
  environ = os.environ if environ is None else environ
  coordinator_address = coordinator_address or environ.get(ENV_COORDINATOR) or None
  num_processes = num_processes if num_processes is not None else _env_int(environ, ENV_NUM_PROCESSES)
  process_id = process_id if process_id is not None else _env_int(environ, ENV_PROCESS_ID)
  if num_processes is not None:
    errors.require_int(num_processes, 'num_processes', 1)
  if process_id is not None:
    errors.require_int(process_id, 'process_id', 0, None if num_processes is None else num_processes - 1)
  errors.require_int(heartbeat_timeout_s, 'heartbeat_timeout_s', 1)
  errors.require_int(initialization_timeout_s, 'initialization_timeout_s', 1)
  if coordinator_address is not None:
    host, sep, port = coordinator_address.rpartition(':')
    errors.require(bool(sep and host and port.isdigit() and 0 < int(port) < 65536), 'coordinator_address',
                   coordinator_address, 'must be HOST:PORT, e.g. 127.0.0.1:12355')
  if not auto and coordinator_address is None and (
      num_processes == 1 or (num_processes is None and process_id is None)):
    return None
  return Settings(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
                  heartbeat_timeout_s=heartbeat_timeout_s, initialization_timeout_s=initialization_timeout_s)


def _bind_gloo(hostname: str) -> None:
  """Makes the CPU backend's gloo collectives listen on `hostname` (by default they use the hostname's address):
  127.0.0.1 for a local run, the host's own address on the test bed (whose namespaces do not hold the machine's).

  Uses JAX internals (the CPU backend factory); if they moved, gloo keeps its default address.
  """
  try:
    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    def make_cpu_client():
      collectives = _jax.make_gloo_tcp_collectives(
          distributed_client=jax_distributed.global_state.client, hostname=hostname)
      return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory('cpu', make_cpu_client, priority=0, fail_quietly=False)
  except (ImportError, AttributeError, TypeError) as e:  # pragma: no cover - depends on the JAX version
    log.warning('could not bind CPU collectives to %s (%s); gloo uses the hostname\'s address', hostname, e)


class JoinError(RuntimeError):
  """This process could not join the multi-process run (settings incomplete, coordinator unreachable)."""


def initialize(settings: Settings | None) -> int:
  """Joins the multi-process run described by `settings` (before any JAX backend use); returns the process count.

  With `settings` None nothing happens and the count is 1.

  Raises:
    JoinError: the settings are incomplete and JAX detects no cluster, or connecting failed with an error.
      (A coordinator that never answers is different: after `initialization_timeout_s` JAX 0.10 ends the
      process from C++ with "Terminating process because the JAX distributed service detected fatal errors".)
  """
  if settings is None:
    return 1
  global _heartbeat_timeout_s
  _heartbeat_timeout_s = settings.heartbeat_timeout_s
  import jax
  # gloo is JAX's cross-process collective on CPU (and its default); only the environment
  # (JAX_CPU_COLLECTIVES_IMPLEMENTATION=mpi) chooses another.
  if 'JAX_CPU_COLLECTIVES_IMPLEMENTATION' not in os.environ:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  kwargs = {}
  if settings.loopback:
    kwargs['coordinator_bind_address'] = settings.coordinator_address  # a local run: loopback only
  try:
    jax.distributed.initialize(
        coordinator_address=settings.coordinator_address, num_processes=settings.num_processes,
        process_id=settings.process_id, initialization_timeout=settings.initialization_timeout_s,
        heartbeat_timeout_seconds=settings.heartbeat_timeout_s,
        # A process whose peers died waits at most this long at exit for them.
        shutdown_timeout_seconds=settings.heartbeat_timeout_s, **kwargs)
  except (ValueError, TypeError) as e:
    raise JoinError(f'cannot join a multi-process run: {e} Pass --coordinator_address, --num_processes and '
                    f'--process_id (or set ${ENV_COORDINATOR}, ${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID}).') from e
  except RuntimeError as e:  # jax.errors.JaxRuntimeError: a coordinator or a peer did not answer in time
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise JoinError(f'cannot join the multi-process run at {settings.coordinator_address or "(auto-detected)"} '
                    f'within {settings.initialization_timeout_s}s: {first}') from e
  if jax.config.jax_cpu_collectives_implementation == 'gloo':
    if settings.loopback:
      _bind_gloo('127.0.0.1')
    elif os.environ.get(ENV_HOST_ADDRESS):  # a host of the test bed (harness/testbed): its address in its namespace
      _bind_gloo(os.environ[ENV_HOST_ADDRESS])
  count = process_count()
  log.info('process %d of %d joined the run (coordinator %s)', process_index(), count,
           settings.coordinator_address or 'auto-detected')
  return count


_heartbeat_timeout_s = DEFAULT_HEARTBEAT_TIMEOUT_S  # of the run this process joined (`initialize`)


def heartbeat_timeout_s() -> int:
  """Seconds after which a silent peer counts as dead in the run this process joined (the default if none)."""
  return _heartbeat_timeout_s


def process_count() -> int:
  """Processes in the run, known right after `initialize` (before any backend starts); 1 if not distributed."""
  from jax._src import distributed as jax_distributed
  if jax_distributed.global_state.client is None:
    return 1
  return jax_distributed.global_state.num_processes or 1


def process_index() -> int:
  """This process's id, known right after `initialize`; 0 if not distributed."""
  from jax._src import distributed as jax_distributed
  return jax_distributed.global_state.process_id if jax_distributed.global_state.client else 0


def host_devices_per_process(devices: int, num_processes: int) -> int:
  """CPU devices each process must expose so that all processes together hold the config's `devices`."""
  errors.require(devices % num_processes == 0, 'devices', devices,
                 f'must be a multiple of the {num_processes} processes (each process holds devices / processes)')
  return devices // num_processes


def free_port(host: str = '127.0.0.1') -> int:
  """A TCP port that is free on `host` right now (for a local coordinator)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]
