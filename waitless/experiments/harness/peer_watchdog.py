"""A dead peer stops a multi-process run with one readable line, not JAX's C++ abort and thread dump.

Every process runs a `PeerWatchdog` thread: it bumps a counter under `waitless/alive/<process>` in the
coordination service's key-value store and reads everyone else's. A peer whose counter has not moved for
`timeout_s` (half of JAX's heartbeat timeout, so this fires before the runtime aborts) is dead or stuck; a
store that stops answering means the coordinator (process 0) is gone. The survivor then prints one line (who,
the last step this process completed, the command that resumes the run) and exits with `EXIT_PEER_LOST`
without waiting for the collective it may be blocked in. A process that finishes marks itself done, so a peer
that ends first is never taken for a dead one.
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
import time
from typing import Callable, Optional

EXIT_PEER_LOST = 76
_PREFIX = 'waitless/alive/'
_DONE = 'done'


class PeerWatchdog(threading.Thread):
  """Watches the other processes of a run (a daemon thread; `start()` it after `jax.distributed` joined)."""

  def __init__(self, client, process_id: int, num_processes: int, timeout_s: float,
               completed_step: Callable[[], Optional[int]], workdir: str,
               exit_fn: Callable[[int], None] = os._exit):
    super().__init__(name='waitless-peer-watchdog', daemon=True)
    self._client = client
    self._me = process_id
    self._peers = [p for p in range(num_processes) if p != process_id]
    self._timeout_s = timeout_s
    self._completed_step = completed_step
    self._workdir = workdir
    self._exit = exit_fn
    self._stop = threading.Event()
    self.message: Optional[str] = None

  def finish(self) -> None:
    """This process is done: peers must not wait for its counter any more; stop watching."""
    self._stop.set()
    try:
      self._client.key_value_set(f'{_PREFIX}{self._me}', _DONE, allow_overwrite=True)
    except Exception:  # the coordinator may already be gone at the very end
      pass

  def report(self, what: str) -> None:
    """Stops this process with the one-line message (also for errors seen outside the thread)."""
    self._stop.set()
    self._stop_run(what)

  def _stop_run(self, what: str) -> None:
    step = self._completed_step()
    done = 'no step yet' if step is None else f'step {step}'
    command = shlex.join([sys.executable, '-m', 'waitless.experiments.main', *sys.argv[1:]])
    self.message = (f'process {self._me}: {what}; this process completed {done}. The run cannot continue: rerun '
                    f'the same command on every process to resume from the last checkpoint in {self._workdir} '
                    f'({command})')
    print(self.message, file=sys.stderr, flush=True)
    self._exit(EXIT_PEER_LOST)

  def run(self) -> None:
    counter = 0
    seen = {p: (None, time.monotonic()) for p in self._peers}  # peer -> (last value, when it changed)
    poll = max(self._timeout_s / 5, 0.05)
    while not self._stop.wait(poll):
      counter += 1
      try:
        self._client.key_value_set(f'{_PREFIX}{self._me}', str(counter), allow_overwrite=True)
        values = dict(self._client.key_value_dir_get(_PREFIX))
      except Exception as e:  # the store lives in process 0
        if self._stop.is_set():
          return
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        self._stop_run(f'lost contact with the coordinator (process 0) ({first[:120]})')
        return
      now = time.monotonic()
      silent = []
      for peer in self._peers:
        value = values.get(f'{_PREFIX}{peer}')
        if value == _DONE:
          continue
        if value != seen[peer][0]:
          seen[peer] = (value, now)
        elif now - seen[peer][1] > self._timeout_s:
          silent.append(peer)
      if silent and not self._stop.is_set():
        names = ', '.join(str(p) for p in silent)
        self._stop_run(f'process(es) {names} stopped responding for {self._timeout_s:g}s (died or hung)')
        return
