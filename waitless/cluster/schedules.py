"""What a time rule hands the clock: one iteration (`Iteration`) or a block of them (`Steps`), and the typed
schedule they carry (its uniform fields, stacking n iterations, taking one back).

The one home of the records that both sides of the rule contract read: `cluster/clock.py` consumes them, the
rules (`cluster/rules/`) build them. It imports nothing from `cluster`, so the imports run one way:
rules -> clock -> schedules (the clock never imports a rule module).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Optional

import numpy as np


def uniform_fields(schedule_type: type) -> tuple[str, ...]:
  """The declared uniform fields of a schedule type (each must be one of its fields)."""
  uniform = tuple(schedule_type.UNIFORM)
  unknown = set(uniform) - set(schedule_type._fields)
  if unknown:
    raise TypeError(f'{schedule_type.__name__}.UNIFORM names unknown fields {sorted(unknown)}')
  return uniform


def split(schedule: NamedTuple) -> tuple[dict[str, Any], dict[str, Any]]:
  """(per-worker fields, uniform fields) of a schedule, as name -> value dicts."""
  uniform = uniform_fields(type(schedule))
  fields = schedule._asdict()
  return ({k: v for k, v in fields.items() if k not in uniform}, {k: v for k, v in fields.items() if k in uniform})


def stack(schedules: list[NamedTuple]) -> NamedTuple:
  """The schedules of n iterations stacked field by field: per-worker (n, P), uniform (n,)."""
  kind = type(schedules[0])
  return kind(*(np.stack(values) for values in zip(*schedules)))


def take(schedule: NamedTuple, index) -> NamedTuple:
  """Iteration(s) `index` of a stacked schedule (the leading axis of every field)."""
  return type(schedule)(*(np.asarray(v)[index] for v in schedule))


@dataclasses.dataclass(frozen=True)
class Iteration:
  """What one iteration did, on the host.

  Attributes:
    schedule: the rule's schedule for this iteration: per-worker fields (P,), uniform fields ().
    idle: float64 (P,), seconds each worker waited (barriers, blocked collectives) in this iteration; time
      spent communicating, and compute that was cancelled or abandoned, is not idle.
    bytes_communicated: bytes put on the network by all workers together in this iteration.
    staleness: float64 (P,), staleness of each worker's contribution (0 for synchronous rules).
    mean_staleness: mean staleness of the contributions applied in this iteration, weighted by gradients;
      None means `staleness.mean()`.
    measurements: the rule's declared `reports`, one number each for this iteration.
  """
  schedule: NamedTuple
  idle: np.ndarray
  bytes_communicated: float
  staleness: np.ndarray
  mean_staleness: Optional[float] = None
  measurements: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Steps:
  """n iterations at once, from a rule's vectorised `iterate_block(clock, iteration, n)`.

  Attributes:
    schedule: the rule's schedule stacked: per-worker fields (n, P), uniform fields (n,).
    idle: float64 (n, P).
    bytes_communicated: float64 (n,).
    mean_staleness: float64 (n,).
    end_time: float64 (n,): every worker's time after each iteration.
    measurements: name -> float64 (n,), the declared `reports`.
    times: float64 (n, P), each worker's time after each iteration, for rules whose workers do not move in
      step (then end_time = times.max(axis=1)); None: every worker's time is end_time.
  """
  schedule: NamedTuple
  idle: np.ndarray
  bytes_communicated: np.ndarray
  mean_staleness: np.ndarray
  end_time: np.ndarray
  measurements: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
  times: Optional[np.ndarray] = None


def full(p: int, value, dtype) -> np.ndarray:
  """A per-worker schedule field holding the same value for every worker."""
  return np.full((p,), value, dtype)
