"""Time rule of WAGMA-SGD: wait-avoiding group model averaging, with a global barrier every tau iterations."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, TYPE_CHECKING

import numpy as np

from cluster import network as network_lib
from cluster.rules import base

if TYPE_CHECKING:
  from cluster.clock import Clock


def _log2(n: int, name: str) -> int:
  if n < 1 or n & (n - 1):
    raise ValueError(f'{name}={n} must be a power of two')
  return n.bit_length() - 1


def group_masks(iteration: int, workers: int, group_size: int) -> list[int]:
  """m_r = 1 << ((t g + r) mod G), r = 0..g-1 (G = log2 P, g = log2 S): the group of i is i XOR any of them."""
  big_g, g = _log2(workers, 'workers'), _log2(group_size, 'group_size')
  if big_g == 0:
    return []
  return [1 << ((iteration * g + r) % big_g) for r in range(g)]


def group_ids(iteration: int, workers: int, group_size: int) -> np.ndarray:
  """int32 (P,): the smallest member of each worker's group at `iteration` (a canonical group label)."""
  spread = 0
  for mask in group_masks(iteration, workers, group_size):
    spread |= mask
  return (np.arange(workers) & ~spread).astype(np.int32)


class WagmaSchedule(NamedTuple):
  """Schedule of one WAGMA iteration."""
  microbatches_done: np.ndarray  # int32 (P,), = m
  fresh: np.ndarray              # bool (P,), worker i contributed W'_i (True for all on global-average
  #                                iterations); fresh: W_i <- group sum / S, stale: (group sum + W'_i) / (S + 1)
  group: np.ndarray              # int32 (P,), smallest worker id in worker i's group (informative; the math
  #                                derives groups from t itself)
  behind: np.ndarray             # bool (P,), worker i was more than one iteration behind (treated as one)
  global_average: np.ndarray     # bool (), this iteration ends with the blocking average over all P
  UNIFORM = ('global_average',)


@dataclasses.dataclass(frozen=True)
class WaitAvoidingGroups(base.TimeRule):
  """WAGMA-SGD (`wagma`): group averaging that never waits for late members; global average every tau.

  Worker i runs iteration t from start_i = end_i(t-1): its local step finishes at c_i = start_i + X_i.
  - If (t+1) mod tau == 0: blocking global average: end_i = max_j c_j + allreduce(P); all fresh.
  - Else the group collective of iteration t is activated by the first worker of the whole system to reach it
    and spreads along a tree: it runs at A = min_j c_j + log2(P) alpha (alpha = one network latency) for
    every group, and completes at A + allreduce(S) (ring all-reduce within the group of S). Worker i is fresh
    iff c_i <= A (its new model W'_i is in the sum); otherwise its send buffer (its previous W') is summed.
    Fresh: end_i = A + allreduce(S), idle A - c_i. Stale: end_i = max(c_i, A + allreduce(S)), idle the part of
    that wait after c_i. Nobody waits for a late member.
  Groups: `group_masks` / `group_ids` (ALGORITHMS.md section 4; P = 8, S = 4: t = 0 -> {0..3},{4..7}).
  Emulation limit: a worker whose previous local step had not finished by A (c_i(t-1) > A, its buffer is two
  or more iterations old) is still treated as one iteration stale by the math; the rule flags it (`behind`)
  and counts it. With no stragglers every worker is fresh in every iteration.
  Reference: Li et al., "Breaking (Global) Barriers in Parallel Stochastic Optimization with Wait-Avoiding
  Group Averaging", IEEE TPDS 2020.

  Schedule: `WagmaSchedule`. Per-worker staleness statistic: 0 fresh, 1 stale, 2 behind (meaning 2 or
  more). Reports (summed over a metrics window): `stale`, `behind`.
  """
  group_size: int      # S
  period: int          # tau
  microbatches: int = 1

  schedule_type = WagmaSchedule
  reports = {'stale': 'sum', 'behind': 'sum'}

  def __post_init__(self):
    base.check_positive_int(self.group_size, 'group_size')
    base.check_positive_int(self.period, 'period')
    base.check_positive_int(self.microbatches, 'microbatches')
    _log2(self.group_size, 'group_size')


  def iterate(self, clock: "Clock", iteration: int) -> base.Iteration:
    p, s = clock.workers, self.group_size
    if s > p or p % s:
      raise ValueError(f'group_size={s} must divide workers={p}')
    state = clock.rule_state
    previous = state.get('previous_finish')
    previous = np.zeros(p) if previous is None else previous
    finished = clock.work(np.arange(p), clock.times, self.microbatches)
    state['previous_finish'] = finished
    if (iteration + 1) % self.period == 0:
      arrival = finished.max()
      clock.times[:] = arrival + clock.network.allreduce(clock.model_bytes, p)
      fresh, behind = np.ones(p, bool), np.zeros(p, bool)
      idle = arrival - finished
      communicated = network_lib.ring_bytes(clock.model_bytes, p)
      global_average = True
    else:
      activation = finished.min() + math.log2(p) * clock.network.latency()
      done = activation + clock.network.allreduce(clock.model_bytes, s)
      fresh = finished <= activation
      behind = previous > activation
      end = np.where(fresh, done, np.maximum(finished, done))
      idle = np.where(fresh, activation - finished, end - finished)
      clock.times[:] = end
      communicated = (p // s) * network_lib.ring_bytes(clock.model_bytes, s)
      global_average = False
    staleness = np.where(fresh, 0, np.where(behind, 2, 1)).astype(np.float64)
    return base.Iteration(
        schedule=WagmaSchedule(microbatches_done=base.full(p, self.microbatches, np.int32), fresh=fresh,
                               group=group_ids(iteration, p, s), behind=behind,
                               global_average=np.bool_(global_average)),
        idle=idle, bytes_communicated=communicated, staleness=staleness,
        measurements={'stale': float((~fresh).sum()), 'behind': float(behind.sum())})
