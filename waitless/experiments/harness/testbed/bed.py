"""The shaped test bed's objects: H hosts on this machine, each a network namespace with a CPU quota, on shaped links.

  with bed.Bed.create(bed.Spec(cpus=(0.8, 0.4), rate_mbit=174)) as b:   # hosts 0 and 1; 1 has half the CPU
    b.popen(1, ['python', '-c', 'print(1)'])                             # runs inside host 1 (its netns and cgroup)

Layout (every name starts with PREFIX and the bed's id, so that nothing else on the machine is ever touched):
  switch        a namespace `wl-tb-ID-sw` holding a bridge `br0`, no address
  host i        a namespace `wl-tb-ID-hI` with `lo` up and `eth0` at ADDRESS_BASE + i + 1 (10.77.0.0/24, which exists
                only inside these namespaces), MTU `Spec.mtu`; its other end `hI` is a port of the bridge. Both ends
                are created inside the namespaces (`ip -n`), never in the machine's own namespace.
  link i        a tbf qdisc at `Spec.rate_mbit` on eth0 (what host i sends) and one on hI (what it receives): each host
                has a full-duplex link of its own, so a profile's per-host bandwidth is that rate. tbf's burst must
                hold the largest packet: the MTU is lowered from veth's 65,536-byte GSO default to 9,000 and the
                burst is at least twice it.
  cgroup i      `/sys/fs/cgroup/cpu/wl-tb-ID-hI` (cgroup v1 cpu controller) with cfs_quota = cpus x period: host i's
                processes get at most that many cores, however loaded the machine, so a host with less CPU is
                really slower. A process joins it before it enters the namespace with `nsenter --net` (which
                switches only the network: `ip netns exec` remounts /sys, and a process inside it could not join).

Every process started on a host is in its cgroup, also the daemons it starts (Ray's), so `destroy` stops them all
by their pids (cgroup.procs) before it removes the namespaces and cgroups. A state file per bed
(`STATE_DIR/ID.json`: the launcher's pid and start time, the objects) lets `remove_stale` remove the beds of a
launcher that is gone (kill -9) at the next start; `destroy` is idempotent, so a half-built bed is removed too.
Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN), `ip`, `tc`, `nsenter` and a cgroup v1 cpu controller: `check_privileges`
says which is missing in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Sequence

from waitless import config_errors as errors

PREFIX = 'wl-tb-'
STATE_DIR = '/run/waitless-testbed'
CGROUP_CPU = '/sys/fs/cgroup/cpu'
NETNS_DIR = '/var/run/netns'
ADDRESS_BASE = '10.77.0.'  # host i: ADDRESS_BASE + (i + 1); only inside the bed's namespaces
PREFIX_LEN = 24
PERIOD_US = 10_000  # a short period: a quota throttles in 10 ms slices, not 100 ms ones (steadier iterations)


class Unavailable(RuntimeError):
  """The machine cannot hold a test bed (not root, a tool or the cgroup v1 cpu controller missing): one line."""


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a bed is made of.

  Attributes:
    cpus: one entry per host (2..4 hosts): the cores its cgroup may use (cfs quota), > 0.
    rate_mbit: every host link's rate per direction, Mbit/s; None leaves the links unshaped.
    burst_bytes: tbf's bucket; None: max(2 x mtu, rate x 1 ms).
    mtu: of every link (tbf's burst must hold a packet).
    latency_ms: tbf's queue, as the time a packet may wait (a full queue drops).
    cpu_weight: the hosts' cgroups' cpu.shares (None: the kernel's 1024, a plain process's weight). A quota caps a
      host's CPU; on a machine with other work it gets its quota only if its weight wins it: a higher weight
      reserves it, at the other work's expense.
  """
  cpus: tuple[float, ...]
  rate_mbit: float | None = None
  burst_bytes: int | None = None
  mtu: int = 9000
  latency_ms: float = 200.0
  cpu_weight: int | None = None

  def __post_init__(self):
    errors.require(2 <= len(self.cpus) <= 4, '--cpus', ','.join(map(str, self.cpus)),
                   'one CPU quota per host, 2 to 4 hosts')
    cores = os.cpu_count() or 1
    for c in self.cpus:
      errors.require_number(c, '--cpus', 'every quota must be a number of cores > 0, e.g. 0.8', lambda v: v > 0)
      errors.require(c <= cores, '--cpus', ','.join(map(str, self.cpus)),
                     f'a host\'s quota cannot exceed this machine\'s {cores} cores')
    if self.rate_mbit is not None:
      errors.require_number(self.rate_mbit, '--rate_mbit', 'must be a rate in Mbit/s > 0', lambda v: v > 0)
    errors.require_int(self.mtu, '--mtu', 1280, 65535)
    if self.cpu_weight is not None:
      errors.require_int(self.cpu_weight, '--cpu_weight', 2, 262144, why='cgroup v1 cpu.shares')
    if self.burst_bytes is not None:
      errors.require_int(self.burst_bytes, '--burst_bytes', self.mtu + 100,
                         why=f'tbf\'s bucket must hold the largest packet (mtu {self.mtu})')

  @property
  def hosts(self) -> int:
    return len(self.cpus)

  @property
  def burst(self) -> int:
    """tbf's bucket in bytes."""
    if self.cpu_weight is not None:
      errors.require_int(self.cpu_weight, '--cpu_weight', 2, 262144, why='cgroup v1 cpu.shares')
    if self.burst_bytes is not None:
      return self.burst_bytes
    return int(max(2 * self.mtu, (self.rate_mbit or 0) * 1e6 / 8 * 1e-3))


def address(host: int) -> str:
  """Host `host`'s address inside the bed."""
  return f'{ADDRESS_BASE}{host + 1}'


def check_privileges() -> None:
  """Raises Unavailable with one line naming what this machine lacks for a test bed."""
  if os.geteuid() != 0:
    raise Unavailable('the test bed needs root (network namespaces, tc and cgroups): run it as root')
  for tool in ('ip', 'tc', 'nsenter'):
    if shutil.which(tool) is None:
      raise Unavailable(f'the test bed needs `{tool}` (iproute2 / util-linux), which is not on PATH')
  if not os.path.isfile(os.path.join(CGROUP_CPU, 'cpu.cfs_quota_us')):
    raise Unavailable(f'the test bed needs the cgroup v1 cpu controller at {CGROUP_CPU} (cpu.cfs_quota_us), '
                      'which this machine does not mount')


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
  done = subprocess.run(argv, capture_output=True, text=True, check=False)
  if check and done.returncode:
    raise RuntimeError(f'{" ".join(argv)} failed (status {done.returncode}): {done.stderr.strip()}')
  return done


def _start_time(pid: int) -> str | None:
  """A process's start time in clock ticks (/proc/PID/stat field 22): with the pid, who it is; None if gone."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[19]
  except (OSError, IndexError):
    return None


class Bed:
  """A test bed that exists (or is being built or removed); `create` builds one, `destroy` removes it."""

  def __init__(self, bed_id: str, spec: Spec):
    self.id, self.spec = bed_id, spec
    self.switch = f'{PREFIX}{bed_id}-sw'
    self.namespaces = [f'{PREFIX}{bed_id}-h{i}' for i in range(spec.hosts)]
    self.cgroups = [os.path.join(CGROUP_CPU, f'{PREFIX}{bed_id}-h{i}') for i in range(spec.hosts)]

  # --- building and removing ---

  @classmethod
  def create(cls, spec: Spec, bed_id: str | None = None) -> 'Bed':
    """Removes stale beds, then builds this one; on any failure removes what was built and re-raises."""
    check_privileges()
    remove_stale()
    bed = cls(bed_id or str(os.getpid()), spec)
    bed._write_state()
    try:
      bed._build()
    except BaseException:
      bed.destroy()
      raise
    return bed

  def __enter__(self) -> 'Bed':
    return self

  def __exit__(self, *exc) -> None:
    self.destroy()

  def _write_state(self) -> None:
    os.makedirs(STATE_DIR, exist_ok=True)
    state = {'id': self.id, 'launcher_pid': os.getpid(), 'launcher_start': _start_time(os.getpid()),
             'cpus': list(self.spec.cpus), 'rate_mbit': self.spec.rate_mbit, 'cpu_weight': self.spec.cpu_weight}
    path = os.path.join(STATE_DIR, f'{self.id}.json')
    with open(path + '.tmp', 'w') as f:
      json.dump(state, f)
    os.replace(path + '.tmp', path)

  def _build(self) -> None:
    spec = self.spec
    _run('ip', 'netns', 'add', self.switch)
    sw = ('ip', '-n', self.switch)
    _run(*sw, 'link', 'add', 'br0', 'type', 'bridge')
    _run(*sw, 'link', 'set', 'br0', 'mtu', str(spec.mtu), 'up')
    for i, ns in enumerate(self.namespaces):
      _run('ip', 'netns', 'add', ns)
      host = ('ip', '-n', ns)
      _run(*host, 'link', 'set', 'lo', 'up')
      _run(*sw, 'link', 'add', f'h{i}', 'mtu', str(spec.mtu), 'type', 'veth', 'peer', 'name', 'eth0', 'mtu',
           str(spec.mtu), 'netns', ns)
      _run(*sw, 'link', 'set', f'h{i}', 'master', 'br0', 'up')
      _run(*host, 'addr', 'add', f'{address(i)}/{PREFIX_LEN}', 'dev', 'eth0')
      _run(*host, 'link', 'set', 'eth0', 'up')
      if spec.rate_mbit is not None:
        shape = ('root', 'tbf', 'rate', f'{spec.rate_mbit}mbit', 'burst', str(spec.burst), 'latency',
                 f'{spec.latency_ms}ms')
        _run('ip', 'netns', 'exec', ns, 'tc', 'qdisc', 'add', 'dev', 'eth0', *shape)
        _run('ip', 'netns', 'exec', self.switch, 'tc', 'qdisc', 'add', 'dev', f'h{i}', *shape)
      os.mkdir(self.cgroups[i])
      with open(os.path.join(self.cgroups[i], 'cpu.cfs_period_us'), 'w') as f:
        f.write(str(PERIOD_US))
      with open(os.path.join(self.cgroups[i], 'cpu.cfs_quota_us'), 'w') as f:
        f.write(str(max(1000, int(round(spec.cpus[i] * PERIOD_US)))))
      if spec.cpu_weight is not None:
        with open(os.path.join(self.cgroups[i], 'cpu.shares'), 'w') as f:
          f.write(str(spec.cpu_weight))

  def destroy(self) -> None:
    """Stops every process in the bed's cgroups (SIGKILL, by pid), removes the cgroups, namespaces (and with them
    their links and qdiscs) and the state file. Idempotent; whatever does not exist is skipped."""
    _remove(self.id)

  # --- running ---

  def popen(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
    """Starts `argv` on host `host`: in its cgroup, then (nsenter) in its network namespace, in a process group of
    its own (`start_new_session`), with WAITLESS_HOST_ADDRESS set to the host's address. `kwargs`: Popen's.

    A shell joins the cgroup and execs nsenter, which execs `argv`: no Python runs between fork and exec (a
    `preexec_fn` would, which a multithreaded launcher such as calibrate's JAX process must not do)."""
    env = dict(kwargs.pop('env', None) or os.environ)
    env['WAITLESS_HOST_ADDRESS'] = address(host)
    join = 'echo $$ > "$1" && ns="$2" && shift 2 && exec nsenter --net="$ns" -- "$@"'
    return subprocess.Popen(['sh', '-c', join, 'sh', os.path.join(self.cgroups[host], 'cgroup.procs'),
                             os.path.join(NETNS_DIR, self.namespaces[host]), *argv],
                            start_new_session=True, env=env, **kwargs)

  def pids(self, host: int) -> list[int]:
    """The processes now in host `host`'s cgroup."""
    return _cgroup_pids(self.cgroups[host])

  def qdisc_stats(self) -> list[dict]:
    """Per host: bytes sent and received through its shaped link and the drops, from tc's counters."""
    stats = []
    for i, ns in enumerate(self.namespaces):
      sent = _qdisc(ns, 'eth0')
      received = _qdisc(self.switch, f'h{i}')
      stats.append({'host': i, 'sent_bytes': sent.get('bytes', 0), 'received_bytes': received.get('bytes', 0),
                    'dropped': sent.get('drops', 0) + received.get('drops', 0)})
    return stats


def _qdisc(ns: str, dev: str) -> dict:
  done = _run('ip', 'netns', 'exec', ns, 'tc', '-j', '-s', 'qdisc', 'show', 'dev', dev, check=False)
  try:
    rows = json.loads(done.stdout or '[]')
  except json.JSONDecodeError:
    return {}
  return next((r for r in rows if r.get('kind') == 'tbf'), {})


def _cgroup_pids(cgroup: str) -> list[int]:
  try:
    with open(os.path.join(cgroup, 'cgroup.procs')) as f:
      return [int(line) for line in f if line.strip()]
  except OSError:
    return []


def _remove(bed_id: str, timeout_s: float = 10.0) -> None:
  """Removes bed `bed_id`'s processes, cgroups, namespaces and state file, whatever of them exists.

  Every process in its cgroups gets SIGKILL (by pid, again until none is left: one may be forking), then the
  cgroup goes (a killed process leaves it a moment later). What is still there after `timeout_s` is left with
  a warning on stderr; the next start removes it (`remove_stale` finds it by its prefix)."""
  prefix = f'{PREFIX}{bed_id}-'
  deadline = time.monotonic() + timeout_s
  for cgroup in [os.path.join(CGROUP_CPU, n) for n in os.listdir(CGROUP_CPU) if n.startswith(prefix)]:
    while time.monotonic() < deadline:
      for pid in _cgroup_pids(cgroup):
        with contextlib.suppress(ProcessLookupError):
          os.kill(pid, signal.SIGKILL)
      try:
        os.rmdir(cgroup)
        break
      except FileNotFoundError:
        break
      except OSError:  # EBUSY: a process has not left it yet
        time.sleep(0.05)
    else:
      print(f'[testbed] warning: {cgroup} still holds processes {_cgroup_pids(cgroup)}; the next start removes it',
            file=sys.stderr)
  for name in sorted((n for n in _our_netns() if n.startswith(prefix)), key=lambda n: n.endswith('-sw')):
    _run('ip', 'netns', 'del', name, check=False)  # the hosts, then the switch; their links and qdiscs go too
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(STATE_DIR, f'{bed_id}.json'))


def _our_netns() -> list[str]:
  done = _run('ip', 'netns', 'list', check=False)
  return [line.split()[0] for line in done.stdout.splitlines() if line.startswith(PREFIX)]


def remove_stale() -> list[str]:
  """Removes every bed whose launcher is gone (a kill -9, a crash): by its state file, and any object with the
  prefix that no living bed's state file claims. Returns the ids removed."""
  alive, removed = set(), []
  if os.path.isdir(STATE_DIR):
    for name in os.listdir(STATE_DIR):
      if not name.endswith('.json'):
        continue
      try:
        with open(os.path.join(STATE_DIR, name)) as f:
          state = json.load(f)
        started = _start_time(state['launcher_pid'])  # the pid and its start time: the same launcher, alive
        living = started is not None and started == state['launcher_start']
      except (OSError, ValueError, KeyError, TypeError):
        living = False
      bed_id = name[:-len('.json')]
      if living:
        alive.add(bed_id)
      else:
        _remove(bed_id)
        removed.append(bed_id)
  orphans = {n[len(PREFIX):].rsplit('-', 1)[0] for n in _our_netns()}
  orphans |= {n[len(PREFIX):].rsplit('-', 1)[0] for n in os.listdir(CGROUP_CPU) if n.startswith(PREFIX)}
  for bed_id in sorted(orphans - alive - set(removed)):
    _remove(bed_id)
    removed.append(bed_id)
  return removed
