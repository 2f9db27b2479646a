"""Stopping a run cleanly when the cluster asks: SIGTERM (SLURM's --signal, TPU maintenance) or SIGINT.

The first signal only sets a flag; the training loop finishes the block it is running, writes a checkpoint and
raises `Preempted`, and the run exits with `EXIT_PREEMPTED` and one line saying how to resume. A second signal
interrupts at once (`Interrupted`, a KeyboardInterrupt that names the signal; the last checkpoint is kept): the
run exits with `EXIT_PREEMPTED` after a SIGTERM (the scheduler asked again: rerun to resume), 130 after Ctrl-C.
Before the loop (imports, compiling, restoring) `exit_before_training` makes a SIGTERM exit with `EXIT_PREEMPTED`
and one line, not the default silent 143, and a Ctrl-C exit with 130 and one line, not a KeyboardInterrupt
traceback from inside an import: nothing was trained since the last checkpoint. In a multi-process run every
process must stop after the same block (a checkpoint is a collective write), so the flag is agreed on across
processes once per block: a process stops when any process was asked to.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import NamedTuple


EXIT_PREEMPTED = 75  # EX_TEMPFAIL: temporary failure, rerun to resume
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
  """A second stop signal: stop at once. `signal_name` says which ('SIGTERM' or 'SIGINT')."""

  def __init__(self, signal_name: str):
    super().__init__(signal_name)
    self.signal_name = signal_name


def exit_code(interrupt: KeyboardInterrupt) -> int:
  """The exit status after `interrupt`: EXIT_PREEMPTED for a SIGTERM (resumable, as a preemption), else 130."""
  return EXIT_PREEMPTED if getattr(interrupt, 'signal_name', None) == 'SIGTERM' else 130


def _exit_preempted(signum, frame) -> None:
  """Writes the line and leaves at once (`os._exit`): a SystemExit raised here unwinds from wherever the main
  thread is, often inside an import of jaxlib or TensorFlow or beside XLA's compiling threads, and the
  interpreter's shutdown then crashed with a segmentation fault (status 139 in 4 of 6 `experiments.compare`
  starts signalled after 1.5 s). Nothing is lost: before the loop nothing has been trained, and at worst (a
  signal while a finished run's last checkpoint is being closed) this is a `kill -9`, which a rerun resumes
  from exactly (tested): files are written atomically, and an unfinished orbax save is never the latest step."""
  del frame
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  sys.stderr.write(f'stopped by {signal.Signals(signum).name} before training started: nothing to save; rerun the '
                   'same command to start (or resume from the last checkpoint)\n')
  sys.stderr.flush()
  os._exit(EXIT_PREEMPTED if signum == signal.SIGTERM else 130)


def exit_before_training() -> None:
  """Until the training loop takes over the signals: a SIGTERM exits with EXIT_PREEMPTED, a SIGINT (Ctrl-C) with
  130, each with one line."""
  if threading.current_thread() is threading.main_thread():
    for sig in SIGNALS:
      signal.signal(sig, _exit_preempted)


class Preempted(RuntimeError):
  """The run stopped at a signal after checkpointing; rerunning the same command resumes it."""

  def __init__(self, step: int, workdir: str, signal_name: str):
    super().__init__(f'preempted by {signal_name} at step {step}: checkpoint saved in {workdir}; rerun the same '
                     'command to resume from it')
    self.step = step
    self.signal_name = signal_name


class StopRequests:
  """Catches the stop signals while the training loop runs (`install` / `uninstall`, or a context manager)."""

  def __init__(self):
    self.signal_name: str | None = None
    self.completed_step: int | None = None  # the loop's progress: the last step every block before it finished
    self._previous = {}

  def install(self) -> None:
    if threading.current_thread() is threading.main_thread():  # signals reach only the main thread
      for sig in SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)

  def uninstall(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def __enter__(self) -> 'StopRequests':
    self.install()
    return self

  def __exit__(self, *exc) -> None:
    self.uninstall()

  def _handle(self, signum, frame) -> None:
    del frame
    if self.signal_name is not None:  # asked twice: stop now
      raise Interrupted(signal.Signals(signum).name)
    self.signal_name = signal.Signals(signum).name

  def request(self, name: str = 'request') -> None:
    """Asks the loop to stop after the current block (what a signal does)."""
    self.signal_name = name

  def agreed(self, step: int, checkpoint_due: bool = False) -> 'Agreement':
    """Whether to stop, and whether to checkpoint, after the block that starts at `step`: the same answers on
    every process. `checkpoint_due`: this process's own wish to checkpoint (its wall-clock period passed,
    `checkpoint_every_s`); agreed in the same exchange, so a multi-process run pays one per block for both."""
    self.completed_step = step
    asked = self.signal_name is not None
    import jax  # not at module level: main imports this before JAX
    if jax.process_count() > 1:
      import numpy as np
      from jax.experimental import multihost_utils
      wishes = np.any(multihost_utils.process_allgather(np.array([asked, checkpoint_due], np.int32)), axis=0)
      asked, checkpoint_due = bool(wishes[0]), bool(wishes[1])
      if asked and self.signal_name is None:
        self.signal_name = 'a peer process'
    return Agreement(stop=asked, checkpoint=asked or checkpoint_due)


class Agreement(NamedTuple):
  """What every process does after a block (`StopRequests.agreed`)."""
  stop: bool        # stop after it: a signal reached this process or a peer
  checkpoint: bool  # checkpoint after it: a stop, or the wall-clock checkpoint period passed here or on a peer
