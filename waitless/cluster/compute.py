"""Compute-time models: seconds one worker needs for one micro-batch.

A model is sampled only by the clock (`cluster/clock.py`), never by the math. Every model is vectorised over
workers and takes the worker ids and the per-worker index of the unit of work (so that a trace can be replayed
by position), plus the clock's seeded `numpy.random.Generator`, its only source of randomness.

Distributions (seconds per micro-batch, before the per-worker speed factor):
  constant             base_s
  exponential          Exp(rate), mean 1/rate
  shifted_exponential  shift_s + Exp(rate)
  pareto               scale * (1 + Lomax(shape)): classical Pareto, support [scale, inf), mean
                       scale * shape / (shape - 1) for shape > 1
  lognormal            base_s * exp(sigma * N(0, 1)): median base_s, mean base_s * exp(sigma^2 / 2)
  trace                row `unit mod rows`, column `worker` of a measured (units, P) table
`SlowWorkers` multiplies any of them by a fixed per-worker factor (persistent heterogeneity). Transient delays
and failures depend on when and at which job a unit runs, so they live in `cluster/faults.py`.

What a call costs (`CallOverhead`, `stragglers.overhead_s` = o). A real accelerator pays a fixed cost per call
(dispatch, kernel launches, synchronisation) besides the work that grows with its samples, so a call on s
samples costs o + (s / s_0) x X, where X is the distribution above and s_0 the configured micro-batch
(batch_size / microbatches samples): X is the per-sample part of one micro-batch, the overhead comes on top.
A micro-batch is one call, so a worker's job of m micro-batches costs m o + sum of m draws of X: splitting a
batch into more micro-batches pays more overheads. Composition, for every kind:
  constant, exponential, shifted_exponential, pareto, lognormal   o + X (the overhead is not random)
  trace        o + the table's entry: the table is read as the per-sample part; a table of measured whole
               calls already holds their overhead, so leave o = 0 with it
  SlowWorkers  factor_w x (o + X): a slow worker is a slower machine, slower at its overhead too
  random_delay + delay_s once per job (`cluster/faults.py`), unchanged by o
  failures     a micro-batch cut by a failure restarts from scratch at the return, its whole time paid
               again, the overhead included (`faults.Failure.run`)
A rule that merges calls (LAP-SGD's Q threads sharing an accelerator: Q concurrent micro-batches as one call
of Q s_0 samples) asks the clock for `per_call` units per call: each call pays o once (`split_overhead`).
With o = 0 no `CallOverhead` is built and every time is the one of the model without it, bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Protocol

import numpy as np

from waitless import config_errors as errors


class ComputeModel(Protocol):
  """Seconds of compute for one micro-batch of each given worker."""

  def sample(self, rng: np.random.Generator, workers: np.ndarray, units: np.ndarray) -> np.ndarray:
    """Returns float64 seconds, one per entry of `workers`.

    Args:
      rng: the clock's generator; the only source of randomness.
      workers: int array of worker ids.
      units: int array (same shape): how many micro-batches that worker had started before this one.
    """

  def mean(self) -> float:
    """Expected seconds per micro-batch, averaged over workers (inf when it does not exist)."""


@dataclasses.dataclass(frozen=True)
class Constant:
  """Every micro-batch takes `base_s` seconds on every worker (no stragglers)."""
  base_s: float

  def sample(self, rng, workers, units):
    del rng, units
    return np.full(np.shape(workers), self.base_s, dtype=np.float64)

  def mean(self):
    return self.base_s


@dataclasses.dataclass(frozen=True)
class Exponential:
  """X ~ Exp(rate): the memoryless model of the K-sync / K-async closed forms (Dutta et al., AISTATS 2018)."""
  rate: float

  def sample(self, rng, workers, units):
    del units
    return rng.exponential(1.0 / self.rate, size=np.shape(workers))

  def mean(self):
    return 1.0 / self.rate


@dataclasses.dataclass(frozen=True)
class ShiftedExponential:
  """X ~ shift_s + Exp(rate): a minimum compute time plus a memoryless tail."""
  shift_s: float
  rate: float

  def sample(self, rng, workers, units):
    del units
    return self.shift_s + rng.exponential(1.0 / self.rate, size=np.shape(workers))

  def mean(self):
    return self.shift_s + 1.0 / self.rate


@dataclasses.dataclass(frozen=True)
class Pareto:
  """Classical Pareto(shape, scale): heavy-tailed, X >= scale; used in the runtime figures of Dutta et al."""
  shape: float
  scale: float

  def sample(self, rng, workers, units):
    del units
    return self.scale * (1.0 + rng.pareto(self.shape, size=np.shape(workers)))

  def mean(self):
    return self.scale * self.shape / (self.shape - 1.0) if self.shape > 1 else float('inf')


@dataclasses.dataclass(frozen=True)
class Lognormal:
  """X = base_s * exp(sigma * Z), Z ~ N(0, 1): median base_s, multiplicative noise of spread sigma."""
  base_s: float
  sigma: float

  def sample(self, rng, workers, units):
    del units
    return self.base_s * np.exp(self.sigma * rng.standard_normal(size=np.shape(workers)))

  def mean(self):
    return self.base_s * float(np.exp(0.5 * self.sigma ** 2))


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
  """Replays measured times: micro-batch `u` of worker `w` takes `times[u mod rows, w]` seconds.

  Wrapping around (mod rows) lets a short measured trace drive a long run; it draws no random numbers.
  """
  times: np.ndarray  # float64 (rows, P), all finite and > 0

  def sample(self, rng, workers, units):
    del rng
    return self.times[np.asarray(units) % self.times.shape[0], np.asarray(workers)]

  def mean(self):
    return float(self.times.mean())


@dataclasses.dataclass(frozen=True, eq=False)
class SlowWorkers:
  """Persistent heterogeneity: worker w's times from `base` multiplied by `factors[w]`."""
  base: ComputeModel
  factors: np.ndarray  # float64 (P,), 1 for a normal worker

  def sample(self, rng, workers, units):
    return self.base.sample(rng, workers, units) * self.factors[np.asarray(workers)]

  def mean(self):
    return self.base.mean() * float(self.factors.mean())


@dataclasses.dataclass(frozen=True, eq=False)
class CallOverhead:
  """A fixed cost per call: each micro-batch takes `overhead_s` + `base`'s time (its per-sample part).

  Built by the factory only for overhead_s > 0, inside `SlowWorkers` (whose factor then scales the overhead
  too): SlowWorkers(CallOverhead(distribution, o), factors). Draws nothing itself, so the random stream is
  the one of `base`.
  """
  base: ComputeModel
  overhead_s: float  # seconds per call, > 0

  def sample(self, rng, workers, units):
    return self.overhead_s + self.base.sample(rng, workers, units)

  def mean(self):
    return self.overhead_s + self.base.mean()


def split_overhead(model: ComputeModel, workers: int) -> tuple[ComputeModel, np.ndarray]:
  """(the per-sample model, float64 (P,) seconds of one call's overhead on each worker) of `model`.

  For rules that merge several micro-batches into one call: such a call costs overhead[w] + the sum of the
  per-sample model's draws, which are the same random numbers as `model`'s. A model without `CallOverhead`
  is its own per-sample model with zero overhead.
  """
  if isinstance(model, SlowWorkers) and isinstance(model.base, CallOverhead):
    factors = np.asarray(model.factors, np.float64)
    return SlowWorkers(base=model.base.base, factors=factors), model.base.overhead_s * factors
  if isinstance(model, CallOverhead):
    return model.base, np.full(workers, model.overhead_s, np.float64)
  return model, np.zeros(workers, np.float64)


def reads_units(model: ComputeModel) -> bool:
  """Whether `model.sample` depends on the units (a trace replays by position; an unknown model may): the
  i.i.d. distributions ignore them, so their draws can be taken ahead in any order."""
  if isinstance(model, (SlowWorkers, CallOverhead)):
    return reads_units(model.base)
  return not isinstance(model, (Constant, Exponential, ShiftedExponential, Pareto, Lognormal))


def load_trace(path: str, workers: int, field: str = 'stragglers.trace_path') -> np.ndarray:
  """Reads a (units, P) table of seconds from `.npy` or CSV (an optional header row is skipped).

  Raises:
    errors.ConfigError naming `field` if the file is missing or unreadable, or does not have one column per
    worker, or holds a value that is not a finite positive number.
  """
  errors.require(bool(path), field, path, 'kind=trace needs the path of a .npy or .csv file')
  errors.require(os.path.isfile(path), field, path, 'file not found')
  try:
    if path.endswith('.npy'):
      table = np.load(path, allow_pickle=False)
    else:
      try:
        table = np.loadtxt(path, delimiter=',', ndmin=2)
      except ValueError:  # a header row
        table = np.loadtxt(path, delimiter=',', ndmin=2, skiprows=1)
    table = np.asarray(table, np.float64)
  except (OSError, ValueError) as e:
    raise errors.ConfigError(field, path, f'must be a .npy or numeric CSV file ({e})') from e
  if table.ndim == 1 and workers == 1:
    table = table[:, None]
  errors.require(table.ndim == 2 and table.shape[0] >= 1 and table.shape[1] == workers, field, path,
                 f'must hold a (units, workers={workers}) table of seconds, one column per worker; '
                 f'found shape {table.shape}')
  errors.require(bool(np.all(np.isfinite(table)) and np.all(table > 0)), field, path,
                 'every time must be a finite number > 0')
  return table
