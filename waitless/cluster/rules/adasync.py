"""AdaSync's time rule (`algorithms/adasync.py`): K of a K-family rule adapted from the training loss.

    K <- min(P - lost, max(1, round(K0 sqrt(F(W_0) / F(W_t)))))   every t0 seconds of simulated time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, TYPE_CHECKING

import numpy as np

from waitless import config_errors as errors
from waitless.algorithms.parameter_server import ServerSchedule
from waitless.cluster import schedules
from waitless.cluster.rules import base as rules_base
from waitless.cluster.rules import kasync
from waitless.cluster.rules import kbatch_async
from waitless.cluster.rules import kbatch_sync
from waitless.cluster.rules import ksync
from waitless.cluster.rules import parameter_server as ps

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


def adapted_k(k0: int, initial_loss: Optional[float], latest_loss: Optional[float], cap: int, current: int) -> int:
  """min(cap, max(1, round(K0 sqrt(F(W_0) / F(W_t))))), or `current` until both losses are known and positive.

  The simulated clock's rule (`AdaSync`) and the Ray runtime's server both adapt K with it.
  """
  if initial_loss is not None and latest_loss is not None and initial_loss > 0 and latest_loss > 0:
    return min(cap, max(1, int(round(k0 * math.sqrt(initial_loss / latest_loss)))))
  return current


# The variants AdaSync can adapt, with their time rules.
BASE_RULES = {'ksync': ksync.KSync, 'kbatch_sync': kbatch_sync.KBatchSync, 'kasync': kasync.KAsync,
              'kbatch_async': kbatch_async.KBatchAsync}


@dataclasses.dataclass(frozen=True)
class AdaSync(rules_base.TimeRule):
  """AdaSync time rule: K of `base` adapted every `period_s` seconds of simulated time from the loss.

  K is evaluated at the first iteration that starts at or after each multiple of t0, with F(W_0) the first
  loss reported and F(W_t) the latest one. The training loop reports losses with `clock.feedback(train_loss=...)`
  after each block; until a loss is reported K stays K0. `lost` = workers that fail and never return. K, the
  next adjustment time and both losses live in `clock.rule_state` (checkpointed).

  Schedule and reports: those of `base` (`ServerSchedule`, `k`, `max_staleness`).
  """
  base: ps.KRule     # KSync, KBatchSync, KAsync or KBatchAsync; its own k is ignored
  k0: int
  period_s: float    # t0

  schedule_type = ServerSchedule
  reports = ps.KRule.reports
  adjustable_k = True
  uses_feedback = True

  def __post_init__(self):
    errors.require_int(self.k0, 'k0', 1)
    if not isinstance(self.base, ps.KRule):
      raise ValueError(f'AdaSync needs a K-family base rule, got {type(self.base).__name__}')
    if not self.period_s > 0:
      raise ValueError(f'period_s={self.period_s!r} must be > 0')

  @property
  def fresh_views(self) -> bool:
    return self.base.fresh_views

  def tolerated_failures(self, workers: int) -> int:
    # K is capped at the workers left, so only K0 matters at the start; batch rules need a single learner.
    several = isinstance(self.base, (kbatch_sync.KBatchSync, kbatch_async.KBatchAsync))
    return workers - 1 if several else workers - self.k0

  def _state(self, clock: 'Clock') -> dict[str, Any]:
    state = clock.rule_state
    if 'k' not in state:
      state.update(k=self.k0, next_adjust_s=self.period_s, initial_loss=None, latest_loss=None)
    return state

  def feedback(self, clock: 'Clock', measurements: Mapping[str, float]) -> None:
    loss = measurements['train_loss']
    if not math.isfinite(loss):
      return
    state = self._state(clock)
    if state['initial_loss'] is None:
      state['initial_loss'] = loss
    state['latest_loss'] = loss

  def _adjust(self, clock: 'Clock', state: dict[str, Any], now: float) -> None:
    """The check at the start of an iteration that starts at simulated time `now`."""
    # A relative tolerance: simulated times are sums of floats, and 10 x 0.01 s must reach a 0.1 s boundary.
    slack = 1e-9 * self.period_s
    if now >= state['next_adjust_s'] - slack:
      periods = math.floor((now - state['next_adjust_s'] + slack) / self.period_s) + 1
      state['next_adjust_s'] += periods * self.period_s
      state['k'] = self._next_k(clock, state)

  def _next_k(self, clock: 'Clock', state: dict[str, Any]) -> int:
    """K at the next adjustment: the same at every adjustment until the next loss is reported."""
    return adapted_k(self.k0, state['initial_loss'], state['latest_loss'], clock.workers - clock.lost_workers,
                     state['k'])

  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
    state = self._state(clock)
    self._adjust(clock, state, clock.sim_time)
    return self.base.iterate(clock, iteration)

  vectorized = True

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> schedules.Steps:
    """n calls of `iterate` through the base rule's `iterate_block`.

    Losses arrive between blocks, so within a block K changes at most once: at the first adjustment, to
    `_next_k`. If that differs from K, the block is simulated, cut at the first iteration that starts at or
    after the adjustment time, the clock rewound and the prefix simulated again (the same draws), then the
    rest with the new K. Later adjustments in the block only advance the next adjustment time.
    """
    state = self._state(clock)
    slack = 1e-9 * self.period_s
    parts, now = [], clock.sim_time
    while n > 0:
      self._adjust(clock, state, now)
      snap = clock.snapshot() if self._next_k(clock, state) != state['k'] else None
      steps = self.base.iterate_block(clock, iteration, n)
      ends = np.maximum.accumulate(np.maximum(steps.end_time, now)).tolist()
      cut = len(ends)
      for j in range(1, len(ends)):
        if ends[j - 1] >= state['next_adjust_s'] - slack:
          if snap is not None:
            cut = j
            break
          self._adjust(clock, state, ends[j - 1])  # K stays
      if cut < len(ends):
        clock.restore(snap)
        steps = self.base.iterate_block(clock, iteration, cut)
      parts.append(steps)
      if not np.all(np.isfinite(steps.end_time)):
        break  # stalled: the clock raises
      now, n = ends[cut - 1], n - cut
    return ps.concat_steps(parts)


def time_rule(config) -> AdaSync:
  a = config.algorithm
  base = BASE_RULES[a.base](k=a.k0, microbatches=config.microbatches)  # its own K is ignored
  return AdaSync(base=base, k0=a.k0, period_s=float(a.adapt_every_s))
