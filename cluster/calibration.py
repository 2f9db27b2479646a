"""Calibrates the compute-time model from a measured training step (`stragglers.calibrate = True`).

The simulated unit is one micro-batch of one worker. A jitted step on one device processes
(workers / devices) workers x microbatches micro-batches x the iterations of one call, one after another, so
    seconds per micro-batch = median seconds per call / `microbatches_per_call(config, iterations)`.
`calibrated(stragglers, seconds)` then rescales the configured distribution so that its mean (its median for
`lognormal`, whose `base_s` is a median) equals the measurement; the straggler modifiers stay as they are.

Typical use in the training loop, after the step is jitted and before the clock is built:

    if config.stragglers.calibrate:
      seconds = calibration.seconds_per_microbatch(
          train_step, state, batch, schedule,
          microbatches_per_call=calibration.microbatches_per_call(config, config.steps_per_call),
          carry=True)                               # train_step returns the new state first (donation)
      config.stragglers = calibration.calibrated(config.stragglers, seconds)
    clock = factory.make_clock(config, rule, model_bytes)
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np


def time_callable(fn: Callable[..., Any], *args, warmup: int = 2, repeats: int = 5, carry: bool = False) -> float:
  """Median wall-clock seconds of one `fn(*args)`, waiting for its outputs (the first call compiles).

  Args:
    fn: the (jitted) function to time.
    *args: its arguments.
    warmup: untimed calls first (compilation, caches).
    repeats: timed calls; the median is returned (robust to a noisy shared machine).
    carry: `fn` returns a tuple whose first element replaces the first argument of the next call, as a train
      step that donates its state must be called.

  Returns:
    Seconds per call.
  """
  args = list(args)

  def call():
    out = fn(*args)
    jax.block_until_ready(out)
    if carry:
      args[0] = out[0]

  for _ in range(warmup):
    call()
  seconds = []
  for _ in range(repeats):
    begin = time.perf_counter()
    call()
    seconds.append(time.perf_counter() - begin)
  return float(np.median(seconds))


def microbatches_per_call(config: ml_collections.ConfigDict, iterations_per_call: int = 1) -> int:
  """Micro-batches one device computes back to back in one call of the step."""
  per_device = max(1, config.workers // max(1, config.get('devices', 1)))
  return per_device * config.microbatches * iterations_per_call


def seconds_per_microbatch(fn: Callable[..., Any], *args, microbatches_per_call: int, **timing) -> float:
  """Measured seconds of one worker's micro-batch: `time_callable(fn, *args) / microbatches_per_call`."""
  if microbatches_per_call < 1:
    raise ValueError(f'microbatches_per_call={microbatches_per_call} must be >= 1')
  return time_callable(fn, *args, **timing) / microbatches_per_call


def calibrated(stragglers: ml_collections.ConfigDict, seconds: float) -> ml_collections.ConfigDict:
  """A copy of `stragglers` whose distribution has mean `seconds` per micro-batch (median for lognormal).

  constant / slow_workers / random_delay / lognormal: base_s = seconds; exponential: rate = 1 / seconds;
  shifted_exponential and pareto (shape > 1): shift and scale multiplied so that the mean is `seconds`,
  keeping the shape of the distribution; trace: unchanged (it is measured already). `calibrate` is cleared.
  """
  if not seconds > 0:
    raise ValueError(f'seconds={seconds!r} must be > 0')
  c = ml_collections.ConfigDict(stragglers.to_dict())
  kind = c.kind
  if kind in ('constant', 'slow_workers', 'random_delay', 'lognormal'):
    c.base_s = float(seconds)
  elif kind == 'exponential':
    c.rate = 1.0 / seconds
  elif kind == 'shifted_exponential':
    factor = seconds / (c.shift_s + 1.0 / c.rate)
    c.shift_s, c.rate = c.shift_s * factor, c.rate / factor
  elif kind == 'pareto':
    c.scale = seconds * (c.shape - 1.0) / c.shape if c.shape > 1 else float(seconds)
  if 'calibrate' in c:
    c.calibrate = False
  return c
