"""The time-rule contract: what every rule declares and checks (what one iteration returns, `Iteration` /
`Steps`, lives in `cluster/schedules.py`).

A time rule turns the compute and network models into one iteration of an algorithm: it advances the clock's
per-worker times and returns the per-worker SCHEDULE the math consumes. The schedule is the one contract
between the host clock and the device step, so it is typed: each algorithm declares a `typing.NamedTuple` in
its math module (`algorithms/NAME.py`, or `algorithms/schedules.py` for the shared `EveryoneSchedule`) with a
comment on every field (dtype, shape, meaning), its rule names it in `schedule_type` and fills it, and the
update reads its fields by name. Every schedule has

  microbatches_done: int32 (P,), micro-batches of data each worker's contribution consumed this iteration

and a class attribute `UNIFORM`, the names of the fields that hold the same value for every worker (shape ()
per iteration). The step passes those to the algorithm's `update` unbatched, so that a conditional over them
stays a real conditional when several workers are vmapped on one device (a per-worker predicate turns
`lax.cond` into a select that runs every branch, collectives included).

What a rule reports per iteration besides the common statistics (idle time, staleness, bytes) is declared in
`reports`: measurement name -> how a metrics window reduces it ('mean', 'sum' or 'max'). The training loop and
`experiments.simulate` aggregate them generically.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Mapping, TYPE_CHECKING

from waitless.cluster import schedules

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock

REDUCTIONS = ('mean', 'sum', 'max')


class TimeRule(abc.ABC):
  """How one iteration of an algorithm advances the per-worker clocks. Rules never touch parameters.

  Subclasses are frozen dataclasses of their hyper-parameters and declare:
    schedule_type: the NamedTuple of their schedule (see the module docstring).
    reports: measurement name -> window reduction ('mean' | 'sum' | 'max'); every `Iteration.measurements`
      (and `Steps.measurements`) has exactly these keys.
    adjustable_k: K can be set from outside (`Clock.set_k`, AdaSync) through `clock.rule_state['k']`.
    vectorized: `iterate_block` is implemented (the hot event-driven rules).
    uses_feedback: `feedback` changes the schedules that follow (AdaSync): the training loop then samples a
      block only after the previous block's measurements came back (no lookahead).
  Whatever a rule carries between iterations lives in `clock.rule_state` (checkpointed with the clock).
  """

  schedule_type: ClassVar[type]
  reports: ClassVar[Mapping[str, str]] = {}
  adjustable_k: ClassVar[bool] = False
  vectorized: ClassVar[bool] = False
  uses_feedback: ClassVar[bool] = False

  @abc.abstractmethod
  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
    """Advances `clock.times` by one iteration and returns what happened."""

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> schedules.Steps:
    """n calls of `iterate` (same random draws, same results); only where `vectorized`; None: not this block
    (the clock then calls `iterate` n times)."""
    raise NotImplementedError(f'{type(self).__name__} has no vectorised iterate_block')

  def tolerated_failures(self, workers: int) -> int:
    """Workers the rule can lose for good and still progress (0: it waits for everyone)."""
    del workers
    return 0

  def feedback(self, clock: 'Clock', measurements: Mapping[str, float]) -> None:
    """Training measurements after each block (AdaSync's loss); most rules ignore them."""
    del clock, measurements


def check_rule(rule: TimeRule) -> None:
  """Raises TypeError if `rule` breaks the contract in a way that is checkable before running it."""
  if not isinstance(rule, TimeRule):
    raise TypeError(f'{type(rule).__name__} is not a cluster.rules.base.TimeRule')
  kind = rule.schedule_type
  if 'microbatches_done' not in kind._fields:
    raise TypeError(f'{kind.__name__} has no microbatches_done field')
  if 'microbatches_done' in schedules.uniform_fields(kind):
    raise TypeError(f'{kind.__name__}.microbatches_done must be per-worker')
  bad = {k: v for k, v in rule.reports.items() if v not in REDUCTIONS}
  if bad:
    raise TypeError(f'{type(rule).__name__}.reports: reductions must be one of {REDUCTIONS}, got {bad}')

