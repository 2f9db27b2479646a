"""Calibrates the compute-time model from a measured training step (`stragglers.calibrate = True`).

The simulated unit is one micro-batch of one worker. A jitted step on one device processes
(workers / devices) workers x microbatches micro-batches x the iterations of one call, one after another, so
    seconds per micro-batch = median seconds per call / `microbatches_per_call(config, iterations)`.
`calibrated(stragglers, seconds)` then rescales the configured distribution so that one call, its overhead
(`stragglers.overhead_s`) plus the distribution's mean (its median for `lognormal`, whose `base_s` is a median),
takes the measured seconds; the straggler modifiers stay as they are.

The per-call overhead itself comes from timing the step at two (or more) micro-batch sizes s_k: a call costs
    t(s) = overhead + s x per_sample,
fitted by least squares (`fit_overhead`; two sizes: the line through both points). Timing noise can tilt the
line below the origin; a negative overhead is clamped to 0 and the per-sample seconds refitted through the
origin (`Fit.clamped` says so): the step then shows no per-call cost this measurement can resolve.
`Fit.seconds(s)` is the fitted time of a call on s samples, so
    calibrated(stragglers, fit.seconds(batch_size / microbatches), overhead_s=fit.overhead_s)
writes both into the config (`benchmarks/call_overhead.py` does it for a config's model).

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
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import ml_collections
import numpy as np

from waitless import config_errors as errors


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


class Fit(NamedTuple):
  """t(s) = overhead_s + s x per_sample_s: seconds of one call on s samples."""
  overhead_s: float    # seconds per call, >= 0
  per_sample_s: float  # seconds per sample, > 0
  clamped: bool        # the least-squares overhead was negative: set to 0, per_sample_s fitted through 0

  def seconds(self, samples: float) -> float:
    """Fitted seconds of one call on `samples` samples."""
    return self.overhead_s + samples * self.per_sample_s


def fit_overhead(samples: Sequence[float], seconds: Sequence[float]) -> Fit:
  """Least-squares line through (samples_k, seconds_k): per-call overhead and per-sample seconds.

  Args:
    samples: micro-batch sizes, at least two distinct.
    seconds: measured seconds of one call at each size.

  Returns:
    The fit; a negative intercept is clamped to 0 and the slope refitted through the origin
    (sum s t / sum s^2), `clamped` set.

  Raises:
    ValueError: fewer than two distinct sizes, or times that do not grow with the size (slope <= 0: the
      sizes are too close for this machine's noise; time sizes further apart).
  """
  s = np.asarray(samples, np.float64)
  t = np.asarray(seconds, np.float64)
  if s.shape != t.shape or s.ndim != 1 or len(np.unique(s)) < 2:
    raise ValueError(f'need seconds at two or more distinct sizes, got samples={s.tolist()}, '
                     f'seconds={t.tolist()}')
  ds = s - s.mean()
  slope = float(ds @ (t - t.mean()) / (ds @ ds))
  intercept = float(t.mean() - slope * s.mean())
  clamped = intercept < 0
  if clamped:
    intercept, slope = 0.0, float(s @ t / (s @ s))
  if not slope > 0:
    raise ValueError(f'call times {t.tolist()} do not grow with the micro-batch size {s.tolist()}: '
                     'time sizes further apart')
  return Fit(overhead_s=intercept, per_sample_s=slope, clamped=clamped)


def fit_alpha_beta(messages: Sequence[float], volumes: Sequence[float],
                   seconds: Sequence[float]) -> tuple[float, float]:
  """Latency and seconds per byte of a collective, t = messages x alpha + volume x b, by relative least squares.

  Each measurement k is weighted by 1 / t_k (its relative error is minimised): collective times span orders of
  magnitude from a few KB to tens of MB, and an unweighted fit would let the largest sizes' absolute noise set
  the latency. Ring all-reduce among n of M bytes: messages 2(n-1), volume 2(n-1)/n M; a point-to-point
  message: messages 1, volume M.

  Returns:
    (alpha, b): seconds per message (clamped at 0, b then refitted alone) and seconds per byte (1 / beta).

  Raises:
    ValueError: fewer than two distinct volumes, or times that do not grow with the volume (b <= 0).
  """
  k = np.asarray(messages, np.float64)
  v = np.asarray(volumes, np.float64)
  t = np.asarray(seconds, np.float64)
  if len(np.unique(v)) < 2 or not np.all(t > 0):
    raise ValueError(f'need positive times at two or more volumes, got volumes={v.tolist()}, seconds={t.tolist()}')
  w = 1.0 / t
  (alpha, per_byte), *_ = np.linalg.lstsq(np.stack([k * w, v * w], axis=1), np.ones_like(t), rcond=None)
  if alpha < 0:
    alpha, per_byte = 0.0, float((v * w) @ np.ones_like(t) / ((v * w) @ (v * w)))
  if not per_byte > 0:
    raise ValueError(f'times {t.tolist()} do not grow with the volume {v.tolist()}: time sizes further apart')
  return float(alpha), float(per_byte)


def time_sizes(make_call: Callable[[int], tuple[Callable[..., Any], tuple]], sizes: Sequence[int],
               **timing) -> np.ndarray:
  """float64 seconds of one call at each size: `time_callable(*make_call(size))` (`timing`: its options).

  `make_call(size)` returns (fn, args), a jitted step and its inputs for a micro-batch of `size` samples.
  """
  seconds = []
  for size in sizes:
    fn, args = make_call(int(size))
    seconds.append(time_callable(fn, *args, **timing))
  return np.asarray(seconds, np.float64)


def calibrated(stragglers: ml_collections.ConfigDict, seconds: float,
               overhead_s: Optional[float] = None) -> ml_collections.ConfigDict:
  """A copy of `stragglers` in which one micro-batch call takes `seconds` on average (median for lognormal).

  `overhead_s` (None: the configured `stragglers.overhead_s`, 0 when absent) is written into the copy, and the
  distribution, the per-sample part, rescaled to mean `seconds - overhead_s`: constant / slow_workers /
  random_delay / lognormal: base_s; exponential: rate = 1 / mean; shifted_exponential and pareto
  (shape > 1): shift and scale multiplied so that the mean is right, keeping the shape of the distribution;
  trace: unchanged (it is measured already). `calibrate` is cleared.

  Raises:
    ValueError: seconds <= 0.
    config_errors.ConfigError naming `stragglers.overhead_s`: an overhead < 0, or one that leaves no time for
      the per-sample part (seconds <= overhead_s: a configured overhead longer than this machine's call).
  """
  if not seconds > 0:
    raise ValueError(f'seconds={seconds!r} must be > 0')
  overhead = float(stragglers.get('overhead_s', 0.0) if overhead_s is None else overhead_s)
  errors.require(overhead >= 0, 'stragglers.overhead_s', overhead, 'must be a number >= 0 (seconds per call)')
  errors.require(seconds > overhead, 'stragglers.overhead_s', overhead,
                 f'must be below the measured {seconds:.6g} s per micro-batch call, or the per-sample part '
                 'would be <= 0')
  c = ml_collections.ConfigDict(stragglers.to_dict())
  if overhead_s is not None or 'overhead_s' in c:
    c.overhead_s = overhead
  seconds = seconds - overhead
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
