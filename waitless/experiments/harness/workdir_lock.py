"""One program at a time per workdir: an advisory lock (`flock`) on `<workdir>/.lock`, held while the program runs.

Two programs on one workdir (a comparison started twice, a run started from two shells) would train every run
twice and write duplicate event files: the second stops before anything trains, in one line naming the holder
(its pid, host and command, which the holder writes into the lock file). The kernel releases the lock when its holder
exits, however it exits (also `kill -9`), so a stale lock file never blocks a rerun.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import socket
import sys
import time

LOCK_FILE = '.lock'


class WorkdirBusy(ValueError):
  """Another program holds the workdir (or it cannot hold a lock file at all: not writable)."""


class WorkdirLock:
  """The held lock of one workdir; `release()` (or the process's exit) gives it up."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    try:
      os.makedirs(workdir, exist_ok=True)
      self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise WorkdirBusy(f'workdir {workdir} is not writable ({e.strerror or e}): use another --workdir') from e
    try:
      fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      holder = os.read(self._fd, 4096).decode(errors='replace').strip() or 'another process'
      os.close(self._fd)
      raise WorkdirBusy(f'workdir {workdir} is in use by {holder}: wait for it to finish, stop it, or use another '
                        '--workdir') from None
    command = shlex.join([os.path.basename(sys.executable), *sys.argv])
    os.ftruncate(self._fd, 0)
    os.write(self._fd, (f'pid {os.getpid()} on {socket.gethostname()} since '
                        f'{time.strftime("%Y-%m-%d %H:%M:%S")} ({command[:300]})\n').encode())

  def release(self) -> None:
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None
