"""What this machine has: memory available for new allocations and CPUs, the figures a program's limits are checked
against before it allocates anything (issue 59: limits before allocation).

A neutral module (the standard library only), as `config_errors`: the simulator's and the harness's checks read it.
"""

from __future__ import annotations

import os
from typing import Optional

_CGROUP_V2 = '/sys/fs/cgroup'
_CGROUP_V1_MEMORY = '/sys/fs/cgroup/memory'


def _read_int(path: str) -> Optional[int]:
  try:
    with open(path) as f:
      text = f.read().strip()
  except OSError:
    return None
  return int(text) if text.isdigit() else None


def _cgroup_memory_left() -> Optional[int]:
  """The memory this process's cgroup may still take (its limit less its usage), or None without a limit."""
  for limit_file, usage_file in (('memory.max', 'memory.current'), ('memory.limit_in_bytes', 'memory.usage_in_bytes')):
    root = _CGROUP_V2 if limit_file == 'memory.max' else _CGROUP_V1_MEMORY
    limit, usage = _read_int(os.path.join(root, limit_file)), _read_int(os.path.join(root, usage_file))
    if limit is not None and usage is not None and limit < 1 << 60:  # 'max' / 2^63: no limit
      return max(limit - usage, 0)
  return None


def available_memory_bytes() -> Optional[int]:
  """Bytes of memory new allocations can have: /proc/meminfo's MemAvailable, or less where the cgroup's limit
  or `ulimit -v` leaves less; None when none is known."""
  available = None
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          available = int(line.split()[1]) * 1024
          break
  except OSError:
    pass
  for left in (_cgroup_memory_left(), _address_space_left()):
    if left is not None:
      available = left if available is None else min(available, left)
  return available


def _address_space_left() -> Optional[int]:
  """What `ulimit -v` (RLIMIT_AS) leaves this process beyond its current size, or None without a limit."""
  try:
    import resource
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
  except (ImportError, OSError, ValueError):
    return None
  if limit == resource.RLIM_INFINITY:
    return None
  try:
    with open('/proc/self/status') as f:
      size = next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmSize:'))
  except (OSError, StopIteration, ValueError):
    return None
  return max(limit - size, 0)


def cpu_count() -> int:
  """CPUs this process may run on: its affinity, capped by a cgroup CPU quota (cgroup v2 `cpu.max`)."""
  try:
    count = len(os.sched_getaffinity(0))
  except (AttributeError, OSError):
    count = os.cpu_count() or 1
  try:
    with open(os.path.join(_CGROUP_V2, 'cpu.max')) as f:
      quota, period = f.read().split()[:2]
    if quota != 'max':
      count = min(count, max(1, int(int(quota) / int(period))))
  except (OSError, ValueError):
    pass
  return max(count, 1)


def gigabytes(nbytes: float) -> str:
  """`nbytes` in a short form for a one-line message: '8.6 GB'."""
  return f'{nbytes / 1e9:.3g} GB'
