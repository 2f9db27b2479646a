"""The fits of calibration: measured seconds in, the compute and network figures a profile or a config holds.

Numpy only (the measurements are `experiments/harness/measure.py`'s, the profile JSON `experiments/calibrate.py`'s):
  fit_overhead      a call on s samples costs t(s) = overhead + s x per_sample: least squares over two or more
                    sizes (two: the line through both points); a negative overhead (noise tilting the line below
                    the origin) is clamped to 0 and the per-sample seconds refitted through the origin
                    (`Fit.clamped`)
  fit_alpha_beta    a collective costs t = messages x alpha + volume / beta: relative least squares
  fit_harness       the harness's per-micro-batch overhead and host time per iteration, from its runs
  fit_network       the collectives' figures of every round: the micro-benchmark's bandwidths, the harness's
                    latencies
  fit_stack         the structured model's network terms (`stacks.Stack`: latency and bandwidth across nodes)
                    from all-reduces at several process counts and sizes, through the library's own algorithms;
                    `holdout_error` fits all but the largest count and reports the error of predicting it
  robust, figure    a figure of several rounds: their median after the outliers are dropped, and its spread
  calibrated        `stragglers.*` rescaled so that one micro-batch call takes the measured seconds
`Fit.seconds(s)` is the fitted time of a call on s samples, so
    calibrated(stragglers, fit.seconds(batch_size / microbatches), overhead_s=fit.overhead_s)
writes both into a config (`benchmarks/call_overhead.py` does it for a config's model).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple, Optional, Sequence

import ml_collections
import numpy as np

from waitless import config_errors as errors
from waitless.cluster import network as network_lib
from waitless.cluster import stacks

MAD_SCALE = 1.4826  # a normal sample's standard deviation / its median absolute deviation
OUTLIER_MADS = 3.0  # a round further than this many scaled MADs from the median is dropped


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


def fit_harness(single_s, microbatches: int, no_collective_s, batch_size: int,
                per_sample_s: float) -> tuple[np.ndarray, np.ndarray]:
  """Per round, the harness's per-micro-batch overhead and the host's seconds per iteration, both clamped at 0.

  An iteration of one process's synchronous run at m micro-batches of the batch B takes
  T(m) = host_s + m x overhead_s + B x per_sample_s, so overhead_s = (T(M) - T(1)) / (M - 1); host_s is an
  iteration without any collective (`no_collective_s`, as the processes of the collectives' runs pay it) less
  its micro-batch, overhead_s + B x per_sample_s.

  Args:
    single_s: (rounds, 2) seconds per iteration of the one-process runs at m = 1 and m = `microbatches`.
    microbatches: M >= 2.
    no_collective_s: (rounds,) seconds per iteration of a run that never communicates.
    batch_size: B, the samples of one worker's iteration.
    per_sample_s: the compute fit's seconds per sample.

  Returns:
    (overhead_s, host_s), float64 (rounds,) each.
  """
  single = np.asarray(single_s, np.float64)
  overhead = np.maximum((single[:, 1] - single[:, 0]) / (microbatches - 1), 0.0)
  host = np.maximum(np.asarray(no_collective_s, np.float64) - overhead - batch_size * per_sample_s, 0.0)
  return overhead, host


class NetworkFit(NamedTuple):
  """Every round's collective figures (`fit_network`); bandwidths in gigabits per second."""
  allreduce: np.ndarray            # (rounds, 2): the micro-benchmark's ring fit, (latency_s, bandwidth_gbps)
  p2p: np.ndarray                  # (rounds, 2): its ring-shift fit, (latency_s, bandwidth_gbps)
  allreduce_latency_s: np.ndarray  # (rounds,): the harness's all-reduce less the bandwidth term, per message
  p2p_latency_s: np.ndarray        # (rounds,): the harness's exchange less the bandwidth term
  dropped: int                     # timings <= 0 (below the timer's noise) left out of the fits


def fit_network(rows: Mapping[str, Sequence[Sequence[float]]], rounds: int, processes: int, harness_s,
                nbytes: float) -> NetworkFit:
  """The collectives' figures of every round, from the micro-benchmark's rows and the harness's times.

  The bandwidths: per round, the all-reduce rows fitted to the ring, t = 2(n-1) alpha + 2 (n-1)/n M / beta, and
  the ring shift to t = alpha + M / beta (`fit_alpha_beta`). The latencies: what the harness pays per iteration
  for the model's `nbytes` (an all-reduce among `processes` = n, one exchange) less the bandwidth term at the
  rounds' median bandwidth, per message (2(n-1) of them in the ring), at least 0.

  Args:
    rows: {"allreduce": [[round, n, bytes, seconds], ...], "p2p": [[round, bytes, seconds], ...]}, what
      `experiments/harness/collective_timing.py` writes; rows of seconds <= 0 are dropped.
    rounds: the rounds 0..rounds-1 the rows hold.
    processes: n, the participants of the harness's collectives.
    harness_s: (rounds, 2) seconds per iteration the harness paid for its all-reduce and for one exchange.
    nbytes: the model's bytes, what the harness's collectives carry.
  """
  allreduce, p2p = [], []
  kept = {kind: [row for row in rows[kind] if row[-1] > 0] for kind in rows}
  dropped = sum(len(rows[kind]) - len(kept[kind]) for kind in rows)
  for r in range(rounds):
    ar = np.array([row[1:] for row in kept['allreduce'] if row[0] == r], np.float64)
    alpha, per_byte = fit_alpha_beta(2 * (ar[:, 0] - 1), 2 * (ar[:, 0] - 1) / ar[:, 0] * ar[:, 1], ar[:, 2])
    allreduce.append((alpha, 8.0 / per_byte / 1e9))
    pp = np.array([row[1:] for row in kept['p2p'] if row[0] == r], np.float64)
    alpha, per_byte = fit_alpha_beta(np.ones(len(pp)), pp[:, 0], pp[:, 1])
    p2p.append((alpha, 8.0 / per_byte / 1e9))
  allreduce, p2p = np.asarray(allreduce), np.asarray(p2p)
  n = processes
  volume = 2 * (n - 1) / n * nbytes * 8 / 1e9
  harness = np.asarray(harness_s, np.float64)
  ar_latency = np.maximum(harness[:, 0] - volume / np.median(allreduce[:, 1]), 0) / (2 * (n - 1))
  p2p_latency = np.maximum(harness[:, 1] - nbytes * 8 / 1e9 / np.median(p2p[:, 1]), 0)
  return NetworkFit(allreduce, p2p, ar_latency, p2p_latency, dropped)


def fit_allreduce_sizes(whole_s: float, fragment_s: float, nbytes: float, fragments: int,
                        n: int) -> tuple[float, float]:
  """The ring all-reduce's latency per message and bandwidth from what the harness pays for an all-reduce of the
  whole model (`nbytes`) and of one fragment of it (`nbytes / fragments`), both among `n`:
  t = 2(n-1) alpha + 2 (n-1)/n M / beta through the two points (alpha clamped at 0).

  The harness's cost per all-reduce beyond the micro-benchmark's bandwidth term is part per message, part per
  byte (the copies and the reduction on the hosts' CPUs, TCP under the link's shaper); measured at one size it
  cannot be split, and charged per message it is paid F times by a model split into F fragments.

  Returns:
    (alpha, bandwidth_gbps).

  Raises:
    ValueError: the fragment costs as much as the whole model or more (per-byte cost <= 0).
  """
  volume = 2 * (n - 1) / n * nbytes
  per_byte = (whole_s - fragment_s) / (volume - volume / fragments)
  if not per_byte > 0:
    raise ValueError(f'the fragment\'s all-reduce ({fragment_s:.4g} s) is not cheaper than the whole model\'s '
                     f'({whole_s:.4g} s): time more steps')
  alpha = max((whole_s - per_byte * volume) / (2 * (n - 1)), 0.0)
  return float(alpha), float(8.0 / per_byte / 1e9)


def robust(values) -> tuple[float, float, list[int]]:
  """The median of a figure's rounds after the outliers are dropped, the kept rounds' spread, the dropped ones.

  A round further than OUTLIER_MADS scaled median absolute deviations from the median of all rounds is dropped
  (on a shared machine, another user's job landed on it); the spread is the kept rounds' scaled MAD (their
  standard deviation if they were normal, not inflated by a dropped round). Two rounds drop nothing (both lie one
  MAD from their median); a MAD of 0 drops nothing either.

  Returns:
    (value, spread, the dropped rounds' indices).
  """
  values = np.asarray(values, np.float64)
  median = np.median(values)
  mad = MAD_SCALE * np.median(np.abs(values - median))
  dropped = [i for i, v in enumerate(values) if mad > 0 and abs(v - median) > OUTLIER_MADS * mad]
  kept = np.delete(values, dropped)
  median = float(np.median(kept))
  return median, float(MAD_SCALE * np.median(np.abs(kept - median))), dropped


def figure(values, source: str, loads=None, **extra) -> dict:
  """A profile figure of several rounds: {"value", "spread", "rounds", "dropped", "source"[, "load"], **extra}.

  `value` and `spread` are `robust`'s, `rounds` every round's value, `dropped` the outliers' indices, `load` (where
  `loads` is given) the load average when each round started: what the machine's other users were doing.
  """
  value, spread, dropped = robust(values)
  out = {'value': value, 'spread': spread, 'rounds': np.asarray(values, np.float64).tolist(), 'dropped': dropped,
         'source': source, **extra}
  if loads is not None:
    out['load'] = [round(float(x), 2) for x in loads]
  return out


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


class StackFit(NamedTuple):
  """The structured model's network terms fitted to measured collectives (`fit_stack`)."""
  stack: stacks.Stack    # the skeleton with its fitted terms
  latency_s: float       # the network's latency per collective step
  bandwidth_gbps: float  # the network's bandwidth (NCCL: its rings' bus bandwidth)
  relative_errors: np.ndarray  # (rows,): fitted / measured - 1 on the rows fitted


def _with_terms(skeleton: stacks.Stack, latency_s: float, per_byte: float) -> stacks.Stack:
  link = network_lib.AlphaBeta(latency_s=latency_s, bandwidth_gbps=8.0 / (per_byte * 1e9))
  return dataclasses.replace(skeleton, inter=link)


def fit_stack(skeleton: stacks.Stack, rows: Sequence[Sequence[float]], iterations: int = 8) -> StackFit:
  """The network's latency and bandwidth of `skeleton` (its library, GPUs per node, staging, framework as they
  are), fitted to all-reduce times measured at several process counts and sizes, through the library's own
  structure: the extrapolation to more processes then runs the same algorithms the library would.

  For a fixed choice of algorithm per row the time is t = t_0 + alpha x a(n, M) + b x v(n, M) (b seconds per
  byte); a(n, M) and v(n, M) are read off the skeleton itself (its time with alpha or b set to one unit, less
  its time with both at zero), and (alpha, b) fitted by relative least squares as `fit_alpha_beta`. The choice
  of algorithm depends on the terms (NCCL's ring or tree), so the fit is repeated with the fitted terms until
  it settles. A term no row informs (a(n, M) = 0 everywhere: NCCL's latencies are its own) keeps the
  skeleton's value.

  Args:
    skeleton: the stack whose network terms are fitted (`stacks.Stack`; a profile of version 2's network).
    rows: [[n, bytes, seconds], ...]: all-reduces among n processes of `bytes` each; two or more sizes.
    iterations: the most re-linearisations.

  Returns:
    The fit, with the fitted rows' relative errors.

  Raises:
    ValueError: fewer than two sizes, times <= 0, or times that do not grow with the size.
  """
  data = np.asarray(rows, np.float64)
  if data.ndim != 2 or data.shape[1] != 3 or len(np.unique(data[:, 1])) < 2 or not np.all(data[:, 2] > 0):
    raise ValueError(f'need rows [n, bytes, seconds > 0] at two or more sizes, got {np.asarray(rows).tolist()}')
  n, m, t = data[:, 0].astype(int), data[:, 1], data[:, 2]
  alpha = skeleton.inter.latency_s
  per_byte = skeleton.inter.seconds_per_byte
  unit_alpha, unit_byte, tiny = 1e-6, 1e-9, 1e-15
  for _ in range(iterations):
    # Linear in (alpha, b) around the current choice of algorithm: evaluate the skeleton at the current terms,
    # then with each term moved by a unit; the differences are a(n, M) and v(n, M).
    def times(lat, pb):
      stack = _with_terms(skeleton, lat, pb)
      return np.array([stack.allreduce(mi, ni) for ni, mi in zip(n, m)])
    base = times(alpha, per_byte)
    a = (times(alpha + unit_alpha, per_byte) - base) / unit_alpha
    v = (times(alpha, per_byte + unit_byte) - base) / unit_byte
    t0 = base - a * alpha - v * per_byte
    w = 1.0 / t
    columns, names = [], []
    if np.any(np.abs(a) > tiny):
      columns.append(a * w)
      names.append('alpha')
    columns.append(v * w)
    names.append('b')
    target = (t - t0) * w
    solution, *_ = np.linalg.lstsq(np.stack(columns, axis=1), target, rcond=None)
    fitted = dict(zip(names, solution))
    new_alpha = max(float(fitted.get('alpha', alpha)), 0.0)
    if 'alpha' in fitted and fitted['alpha'] < 0:  # clamp the latency, refit the bandwidth alone
      fitted['b'] = float((v * w) @ ((t - t0) * w) / ((v * w) @ (v * w)))
    new_per_byte = float(fitted['b'])
    if not new_per_byte > 0:
      raise ValueError(f'times {t.tolist()} do not grow with the size {m.tolist()}: time sizes further apart')
    settled = abs(new_alpha - alpha) <= 1e-12 + 1e-9 * alpha and abs(new_per_byte / per_byte - 1) < 1e-9
    alpha, per_byte = new_alpha, new_per_byte
    if settled:
      break
  stack = _with_terms(skeleton, alpha, per_byte)
  predicted = np.array([stack.allreduce(mi, ni) for ni, mi in zip(n, m)])
  return StackFit(stack, alpha, 8.0 / (per_byte * 1e9), predicted / t - 1)


def holdout_error(skeleton: stacks.Stack, rows: Sequence[Sequence[float]]) -> tuple[StackFit, np.ndarray]:
  """Fits on every process count but the largest and predicts the largest: (the fit, the held-out rows'
  relative errors, predicted / measured - 1). What a calibration's extrapolation to more nodes is worth."""
  data = np.asarray(rows, np.float64)
  largest = data[:, 0].max()
  fit = fit_stack(skeleton, data[data[:, 0] < largest])
  held = data[data[:, 0] == largest]
  predicted = np.array([fit.stack.allreduce(mi, int(ni)) for ni, mi, _ in held])
  return fit, predicted / held[:, 2] - 1
