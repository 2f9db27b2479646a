"""TEST-ONLY: make one process's devices really slower, `--debug_slow_process=I:S` (experiments.main, benchmarks).

Process I sleeps S seconds in every micro-batch loss it computes: a host callback inside the loss, so its
device is busy for it. That is a slower device, whose cost grows with the work it is given (a device given
fewer micro-batches sleeps less), not a fixed per-step delay that no amount of skipped work can hide. Only for
testing straggler tolerance on one machine; never for a real experiment.

The callback returns 0, added to the loss (its input the loss itself, under `stop_gradient`): the sleep then
lies between the micro-batch's forward pass and everything that reads the loss, so a host timestamp taken
after the gradient (`measured_time.Stopwatch`) comes after it even when the gradient is not computed in a
loop. (`jax.debug.callback` with no data dependency may be scheduled anywhere in the iteration.)
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional

from waitless import config_errors as errors

FLAG = 'debug_slow_process'


def _pair(value: str, field: str, allowed: str, first_ok: Callable[[int], bool]) -> tuple[int, float]:
  """"N:S" as (N, S): N a non-negative integer accepted by `first_ok`, S a finite number of seconds >= 0; else a
  one-line ConfigError naming `field` and saying `allowed`."""
  parts = value.split(':')
  ok = len(parts) == 2 and parts[0].isdigit() and first_ok(int(parts[0]))
  try:
    seconds = float(parts[1]) if ok else -1.0
  except ValueError:
    seconds = -1.0
  errors.require(ok and math.isfinite(seconds) and seconds >= 0, field, value, allowed)
  return int(parts[0]), seconds


def parse_slow(value: str, processes: int) -> tuple[int, float]:
  """(process, seconds per micro-batch) of `--debug_slow_process`; (-1, 0) for none ('').

  Raises:
    config_errors.ConfigError: not "I:S" with I in 0..processes-1 and S a finite number >= 0 (one line).
  """
  if not value:
    return -1, 0.0
  return _pair(value, FLAG, f'must be "I:S", a process I in 0..{processes - 1} and S >= 0 seconds per micro-batch',
               lambda i: i < processes)


def parse_delay(value: str, processes: int) -> tuple[int, float]:
  """(processes delayed per iteration, seconds) of `--debug_delay` (`benchmarks/real_stragglers.py`: each
  iteration K processes drawn at random sleep S seconds once); (0, 0) for none ('').

  Raises:
    config_errors.ConfigError: not "K:S" with K in 0..processes and S a finite number >= 0 (one line).
  """
  if not value:
    return 0, 0.0
  return _pair(value, 'debug_delay', f'must be "K:S", K in 0..{processes} processes per iteration and S >= 0 '
               'seconds', lambda k: k <= processes)


def parse_crash(value: str, learners: int) -> tuple[int, int]:
  """(learner, server version) of `--debug_crash_learner` (TEST-ONLY, runtime=ray: learner I's process exits once
  it holds a model of version >= T, `ray_runtime/worker.py`); (-1, 0) for none ('').

  Raises:
    config_errors.ConfigError: not "I:T" with I in 0..learners-1 and T an integer >= 0 (one line).
  """
  if not value:
    return -1, 0
  allowed = f'must be "I:T", a learner I in 0..{learners - 1} and T >= 0 server updates'
  learner, version = _pair(value, 'debug_crash_learner', allowed, lambda i: i < learners)
  errors.require(version == int(version), 'debug_crash_learner', value, allowed)
  return learner, int(version)


def loss_hook(process: int, seconds: float) -> Optional[Callable]:
  """loss -> loss + 0 after process `process` slept `seconds` (on every other process: no sleep); None when
  nothing is slowed (process < 0 or seconds == 0), so that the program has no callback at all."""
  if process < 0 or seconds == 0:
    return None
  import jax  # parse_slow runs before JAX starts
  from jax import lax
  import numpy as np

  def sleep(loss):
    if jax.process_index() == process:
      time.sleep(seconds)
    return np.zeros(np.shape(loss), np.asarray(loss).dtype)

  def hook(loss):
    zero = jax.pure_callback(sleep, jax.ShapeDtypeStruct(loss.shape, loss.dtype), lax.stop_gradient(loss),
                             vmap_method='sequential')
    return loss + zero

  return hook


def slowed_task(task, hook: Callable):
  """`task` (a `tasks.Task`) whose training loss goes through `hook` (`loss_hook`) on every micro-batch."""
  def loss(*args):
    value, model_state = task.loss(*args)
    return hook(value), model_state
  return dataclasses.replace(task, loss=loss)
