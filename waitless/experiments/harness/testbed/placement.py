"""Where a program that starts its own processes (`experiments.calibrate`) puts them: on the test bed's hosts when
it runs on one (`ENV_TESTBED` names the bed; `experiments.testbed -- calibrate` sets it), else on this machine.

  placement.popen(i, argv, ...)   process i's Popen: on host i of the bed (its cgroup and namespace), or plain
  placement.coordinator_host()    the address process 0 listens on: host 0's in the bed, else 127.0.0.1
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Sequence

from waitless.experiments.harness.testbed import bed as bed_lib

ENV_TESTBED = 'WAITLESS_TESTBED'


def current() -> bed_lib.Bed | None:
  """The bed this process runs on (from its state file), or None."""
  bed_id = os.environ.get(ENV_TESTBED)
  if not bed_id:
    return None
  with open(os.path.join(bed_lib.STATE_DIR, f'{bed_id}.json')) as f:
    state = json.load(f)
  return bed_lib.Bed(bed_id, bed_lib.Spec(cpus=tuple(state['cpus']), rate_mbit=state['rate_mbit']))


def hosts() -> int | None:
  """The bed's host count, or None off the bed."""
  bed = current()
  return None if bed is None else bed.spec.hosts


def popen(host: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
  """Starts process `host` of a multi-process measurement: on the bed's host `host` (modulo the hosts), else here
  (in a process group of its own either way, so that its launcher can stop it and what it started)."""
  bed = current()
  if bed is None:
    return subprocess.Popen(list(argv), start_new_session=True, **kwargs)
  return bed.popen(host % bed.spec.hosts, argv, **kwargs)


def coordinator_host() -> str:
  bed = current()
  return '127.0.0.1' if bed is None else bed_lib.address(0)


def _rate(bed: bed_lib.Bed) -> str:
  return f'{bed.spec.rate_mbit:g} Mbit/s per direction' if bed.spec.rate_mbit else 'unshaped'


def links() -> str:
  """What the processes' collectives cross, for a profile's sources."""
  bed = current()
  return 'loopback' if bed is None else f'the test bed\'s links ({_rate(bed)}, tbf)'


def bed_description() -> str:
  """'' off the bed; else what the bed is, for a profile's description."""
  bed = current()
  if bed is None:
    return ''
  quotas = ', '.join(f'{c:g}' for c in bed.spec.cpus)
  return f'; on the shaped test bed: {bed.spec.hosts} hosts of {quotas} CPU (cgroup quotas), links {_rate(bed)}'
