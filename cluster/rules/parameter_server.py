"""Time rules of the parameter-server family (Dutta et al., "Slow and Stale Gradients Can Win the Race").

K-sync, K-batch-sync, K-async, K-batch-async (async SGD is K-batch-async with K = 1) and AdaSync, which
changes K of any of them every t0 seconds of simulated time from the training loss.

Model of the server (all rules here): P learners and one server version counter v (W_v). A learner's gradient
reaches the server p2p(M) seconds after its compute ends (push); a model reaches a learner p2p(M) seconds
after it asks (fetch). With the ideal network both are free and the closed forms of ALGORITHMS.md section 5
hold (X ~ Exp(mu), mean time per update): K-sync and K-async (H_P - H_{P-K}) / mu, K-batch-sync and
K-batch-async K / (P mu). In SPMD the server is emulated by every worker holding an identical copy of W,
changed only by the same all-reduced update; a learner that computes on an older model keeps its own view.

Iteration t = server update t (version t -> t+1). K is read every iteration from `clock.rule_state['k']` when
set (AdaSync, `Clock.set_k`), else the constructor's `k`. Every schedule carries `k`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TYPE_CHECKING

import numpy as np

from cluster.rules import base as rule_base  # `base` is AdaSync's field: the rule it adapts

if TYPE_CHECKING:
  from cluster.clock import Clock


def _current_k(rule, clock: "Clock") -> int:
  k = int(clock.rule_state.get('k', rule.k))
  if not 1 <= k <= clock.workers:
    raise ValueError(f'{type(rule).__name__}: K={k} must be in 1..{clock.workers} (workers)')
  return k


class _KRule:
  """Shared by the K-family: an adjustable K, and how many lost workers it survives."""
  adjustable_k = True

  def __post_init__(self):
    rule_base.check_positive_int(self.k, 'k')
    rule_base.check_positive_int(self.microbatches, 'microbatches')

  def tolerated_failures(self, workers: int) -> int:
    return workers - self.k


@dataclasses.dataclass(frozen=True)
class KSync(_KRule):
  """K-sync SGD (`ksync`; K = P is fully synchronous SGD through a server).

  All learners start round t at S from W_t (fetched). The server takes the first K gradients to arrive and
  cancels the other learners' work (lost: not idle, and their samples are not consumed). The round ends when
  the new model is back at the learners:
    T = K-th smallest (S + X_i + p2p(M)),   end = T + p2p(M);   time per update X_(K) + 2 p2p(M).
  Ties are broken by worker id. Idle: T - arrival_i for the K contributors, 0 for the others.
  Bytes: K pushes + P fetches of M.

  Schedule:
    contributed: bool (P,), worker i's gradient is among the first K (exactly K are True).
    microbatches_done: int32 (P,), m if contributed else 0.
    staleness: int32 (P,), all 0 (every gradient is computed at the current W_t).
    k: int32 (P,), the K of this update, same for all (the update is W - eta/K * sum of the K gradients).
  """
  k: int
  microbatches: int = 1

  def iterate(self, clock: "Clock", iteration: int) -> rule_base.Iteration:
    del iteration
    p, m, k = clock.workers, self.microbatches, _current_k(self, clock)
    up = clock.network.p2p(clock.model_bytes)
    arrival = clock.work(np.arange(p), clock.times.max(), m) + up
    chosen = np.argsort(arrival, kind='stable')[:k]
    contributed = np.zeros(p, bool)
    contributed[chosen] = True
    update = arrival[chosen[-1]]
    clock.times[:] = update + up
    return rule_base.Iteration(
        schedule={'contributed': contributed, 'microbatches_done': np.where(contributed, m, 0).astype(np.int32),
                  'staleness': np.zeros(p, np.int32), 'k': rule_base.full(p, k, np.int32)},
        idle=np.where(contributed, update - arrival, 0.0), bytes_communicated=float(k + p) * clock.model_bytes,
        staleness=np.zeros(p))


@dataclasses.dataclass(frozen=True)
class KBatchSync(_KRule):
  """K-batch-sync SGD (`kbatch_sync`): the first K mini-batch gradients from any learners, then cancel.

  All learners start round t at S from W_t. A learner that finishes a mini-batch pushes it and immediately
  starts another one at the same W_t; the server takes the first K gradients to arrive (a fast learner may give
  several), then cancels all work in progress:
    T = K-th smallest arrival over all (learner, mini-batch) completions,   end = T + p2p(M).
  Time per update with X ~ Exp(mu) and an ideal network: K / (P mu) on average. Nobody idles.
  Bytes: K pushes + P fetches of M.

  Schedule:
    contributions: int32 (P,), c_i in 0..K: mini-batch gradients of learner i in this update, all computed at
      W_t on consecutive mini-batches of its stream; sum_i c_i = K.
    microbatches_done: int32 (P,), c_i * m (the samples consumed; cancelled work consumes none).
    staleness: int32 (P,), all 0.
    k: int32 (P,), the K of this update (W - eta/K * sum of the K gradients).
  """
  k: int
  microbatches: int = 1

  def tolerated_failures(self, workers: int) -> int:
    return workers - 1  # any single learner can deliver all K mini-batches

  def iterate(self, clock: "Clock", iteration: int) -> rule_base.Iteration:
    del iteration
    p, m, k = clock.workers, self.microbatches, _current_k(self, clock)
    up = clock.network.p2p(clock.model_bytes)
    finish = clock.work(np.arange(p), clock.times.max(), m)
    counts = np.zeros(p, np.int32)
    for _ in range(k):
      i = int(np.argmin(finish))  # ties: lowest worker id first
      counts[i] += 1
      last = finish[i]
      finish[i] = clock.work(np.array([i]), last, m)[0]
    clock.times[:] = last + 2 * up
    return rule_base.Iteration(
        schedule={'contributions': counts, 'microbatches_done': counts * np.int32(m),
                  'staleness': np.zeros(p, np.int32), 'k': rule_base.full(p, k, np.int32)},
        idle=np.zeros(p), bytes_communicated=float(k + p) * clock.model_bytes, staleness=np.zeros(p))


def _init_learners(clock: "Clock", m: int) -> dict[str, Any]:
  """Event state of asynchronous learners: each starts a mini-batch on W_0 at the current time."""
  state = clock.rule_state
  if 'finish' not in state:
    state['finish'] = clock.work(np.arange(clock.workers), clock.times.max(), m)  # float64 (P,)
    state['view'] = np.zeros(clock.workers, np.int64)  # server version each in-flight job computes on
    state['version'] = 0                                # server updates so far
  return state


@dataclasses.dataclass(frozen=True)
class KAsync(_KRule):
  """K-async SGD (`kasync`; K = 1 is asynchronous SGD with one gradient per update).

  Learners compute continuously, each on its own view of W. The server waits for the first K learners to push
  (arrival = end of their job + p2p(M)), updates at T = the K-th arrival with their gradients (each computed
  at that learner's view, possibly stale), and only those K learners fetch the new W and start again at
  T + p2p(M); the others keep computing on their views (no cancellation).
  Time per update with X ~ Exp(mu) and an ideal network: (H_P - H_{P-K}) / mu (memorylessness).
  Ties are broken by worker id. Idle: T - arrival_i for the K contributors (they wait for the update), 0 for
  the others. Staleness of a pushed gradient: server version at the update minus the version of the learner's view.
  Bytes: K pushes + K fetches of M. The iteration ends at T (`clock.times` is set to T for every worker;
  the in-flight jobs are in `rule_state`).

  Schedule:
    contributed: bool (P,), learner i pushed a gradient in this update (exactly K).
    microbatches_done: int32 (P,), m if contributed else 0.
    staleness: int32 (P,), for contributors: versions between their view and the model being updated
      (0 = computed on the current W_t); 0 for the others.
    refresh_view: bool (P,), = contributed: after the update, learner i's view <- the new W_{t+1}.
    k: int32 (P,), the K of this update (W - eta/K * sum of the K gradients).
  """
  k: int
  microbatches: int = 1

  def _update(self, clock: "Clock", state: dict[str, Any], k: int, up: float):
    """One server update: (who pushed, their staleness, their arrival times, update time)."""
    finish, view = state['finish'], state['view']
    chosen = np.argsort(finish, kind='stable')[:k]  # ties: lowest worker id first
    arrival = finish[chosen] + up
    update = arrival.max()
    version = state['version']
    stale = version - view[chosen]
    state['version'] = version + 1
    view[chosen] = version + 1
    finish[chosen] = clock.work(chosen, update + up, self.microbatches)
    clock.times[:] = update
    return chosen, stale, arrival, update

  def iterate(self, clock: "Clock", iteration: int) -> rule_base.Iteration:
    del iteration
    p, m, k = clock.workers, self.microbatches, _current_k(self, clock)
    state = _init_learners(clock, m)
    chosen, stale, arrival, update = self._update(clock, state, k, clock.network.p2p(clock.model_bytes))
    contributed = np.zeros(p, bool)
    contributed[chosen] = True
    staleness = np.zeros(p, np.int32)
    staleness[chosen] = stale
    idle = np.zeros(p)
    idle[chosen] = update - arrival
    return rule_base.Iteration(
        schedule={'contributed': contributed, 'microbatches_done': np.where(contributed, m, 0).astype(np.int32),
                  'staleness': staleness, 'refresh_view': contributed.copy(), 'k': rule_base.full(p, k, np.int32)},
        idle=idle, bytes_communicated=2.0 * k * clock.model_bytes, staleness=staleness.astype(np.float64),
        mean_staleness=float(stale.mean()))

  def iterate_block(self, clock: "Clock", iteration: int, n: int) -> rule_base.Steps:
    """n calls of `iterate`, writing straight into the block's arrays (the simulator's hot path)."""
    del iteration
    p, m, k = clock.workers, self.microbatches, _current_k(self, clock)
    state = _init_learners(clock, m)
    up = clock.network.p2p(clock.model_bytes)
    contributed = np.zeros((n, p), bool)
    staleness = np.zeros((n, p), np.int32)
    idle = np.zeros((n, p))
    end, mean_staleness = np.zeros(n), np.zeros(n)
    for t in range(n):
      chosen, stale, arrival, end[t] = self._update(clock, state, k, up)
      contributed[t, chosen] = True
      staleness[t, chosen] = stale
      idle[t, chosen] = end[t] - arrival
      mean_staleness[t] = stale.sum() / k
    return rule_base.Steps(
        schedule={'contributed': contributed, 'microbatches_done': contributed.astype(np.int32) * np.int32(m),
                  'staleness': staleness, 'refresh_view': contributed.copy(), 'k': np.full((n, p), k, np.int32)},
        idle=idle, bytes_communicated=np.full(n, 2.0 * k * clock.model_bytes), mean_staleness=mean_staleness,
        end_time=end)


@dataclasses.dataclass(frozen=True)
class KBatchAsync(_KRule):
  """K-batch-async SGD (`kbatch_async`); with K = 1 it is asynchronous SGD (`async`).

  The server updates after every K gradients from any learners; a learner, after each push, fetches the
  server's current W and starts again at once: no cancellation, no idle time. Events are processed in order
  of arrival (ties: lowest worker id). A push reaches the server at job end + p2p(M); the reply carries the
  model the server holds at that moment: W_t for the first K-1 pushes of update t, W_{t+1} for the K-th (the
  server updates first). The learner starts its next job when the reply arrives, another p2p(M) later.
  Time per update with X ~ Exp(mu) and an ideal network: K / (P mu) in the long run. The iteration ends at the
  K-th arrival. Bytes: K pushes + K fetches of M.

  Schedule (update t: W_{t+1} = W_t - eta/K * sum of the K gradients):
    contributions: int32 (P,), c_i: gradients learner i pushed in this update (sum_i c_i = K). Its first one
      was computed at its view (see `staleness`); its 2nd..c_i-th at W_t (it had fetched W_t in between).
    microbatches_done: int32 (P,), c_i * m.
    staleness: int32 (P,), versions between learner i's view and W_t for its first gradient in this update
      (0 if c_i = 0); its later gradients in the update have staleness 0.
    fetch_current: bool (P,), learner i's last push in this update was not the K-th: afterwards its view is
      W_t (the model before this update).
    refresh_view: bool (P,), learner i made the K-th push: afterwards its view is W_{t+1}.
      (Neither flag: view unchanged. Both are never True.)
    k: int32 (P,), the K of this update.
  """
  k: int
  microbatches: int = 1

  def tolerated_failures(self, workers: int) -> int:
    return workers - 1

  def iterate(self, clock: "Clock", iteration: int) -> rule_base.Iteration:
    del iteration
    p, m, k = clock.workers, self.microbatches, _current_k(self, clock)
    state = _init_learners(clock, m)
    finish, view = state['finish'], state['view']
    version = state['version']
    up = clock.network.p2p(clock.model_bytes)
    counts = np.zeros(p, np.int32)
    first_staleness = np.zeros(p, np.int32)
    fetch_current = np.zeros(p, bool)
    refresh = np.zeros(p, bool)
    total_staleness = 0
    one = np.zeros(1, np.int64)
    for e in range(k):
      i = int(np.argmin(finish))
      arrival = finish[i] + up
      stale = version - int(view[i])
      total_staleness += stale
      if counts[i] == 0:
        first_staleness[i] = stale
      counts[i] += 1
      last = e == k - 1
      view[i] = version + 1 if last else version
      fetch_current[i], refresh[i] = not last, last
      one[0] = i
      finish[i] = clock.work(one, arrival + up, m)[0]
    state['version'] = version + 1
    clock.times[:] = arrival
    return rule_base.Iteration(
        schedule={'contributions': counts, 'microbatches_done': counts * np.int32(m),
                  'staleness': first_staleness, 'fetch_current': fetch_current, 'refresh_view': refresh,
                  'k': rule_base.full(p, k, np.int32)},
        idle=np.zeros(p), bytes_communicated=2.0 * k * clock.model_bytes,
        staleness=first_staleness.astype(np.float64), mean_staleness=total_staleness / k)


@dataclasses.dataclass(frozen=True)
class AdaSync:
  """AdaSync (`adasync`): K of a K-family rule adapted every t0 seconds of simulated time from the loss.

    K <- min(P - lost, max(1, round(K0 * sqrt(F(W_0) / F(W_t)))))
  evaluated at the first iteration that starts at or after each multiple of t0, with F(W_0) the first loss
  reported and F(W_t) the latest one. The training loop reports losses with `clock.feedback(train_loss=...)`
  (once before training with the initial loss if it has it, then after each block); until a loss is reported
  K stays K0. `lost` = workers that fail and never return. K, the next adjustment time and both losses live
  in `clock.rule_state` (checkpointed). Reference: Dutta et al., arXiv 2003.10579 (journal version).

  Schedule: that of `base` (it carries `k`).
  """
  base: Any          # KSync, KBatchSync, KAsync or KBatchAsync; its own k is ignored
  k0: int
  period_s: float    # t0

  adjustable_k = True

  def __post_init__(self):
    rule_base.check_positive_int(self.k0, 'k0')
    if not getattr(self.base, 'adjustable_k', False):
      raise ValueError(f'AdaSync needs a K-family base rule, got {type(self.base).__name__}')
    if not self.period_s > 0:
      raise ValueError(f'period_s={self.period_s!r} must be > 0')

  def tolerated_failures(self, workers: int) -> int:
    # K is capped at the workers left, so only K0 matters at the start; batch rules need a single learner.
    return workers - 1 if isinstance(self.base, (KBatchSync, KBatchAsync)) else workers - self.k0

  def _state(self, clock: "Clock") -> dict[str, Any]:
    state = clock.rule_state
    if 'k' not in state:
      state.update(k=self.k0, next_adjust_s=self.period_s, initial_loss=None, latest_loss=None)
    return state

  def feedback(self, clock: "Clock", measurements: dict[str, float]) -> None:
    loss = measurements.get('train_loss', measurements.get('loss'))
    if loss is None or not math.isfinite(loss):
      return
    state = self._state(clock)
    if state['initial_loss'] is None:
      state['initial_loss'] = loss
    state['latest_loss'] = loss

  def iterate(self, clock: "Clock", iteration: int) -> rule_base.Iteration:
    state = self._state(clock)
    # A relative tolerance: simulated times are sums of floats, and 10 x 0.01 s must reach a 0.1 s boundary.
    slack = 1e-9 * self.period_s
    if clock.sim_time >= state['next_adjust_s'] - slack:
      periods = math.floor((clock.sim_time - state['next_adjust_s'] + slack) / self.period_s) + 1
      state['next_adjust_s'] += periods * self.period_s
      f0, f = state['initial_loss'], state['latest_loss']
      if f0 is not None and f is not None and f0 > 0 and f > 0:
        k = int(round(self.k0 * math.sqrt(f0 / f)))
        state['k'] = min(clock.workers - clock.lost_workers, max(1, k))
    return self.base.iterate(clock, iteration)
