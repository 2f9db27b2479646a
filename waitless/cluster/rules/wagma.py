"""WAGMA's time rule (`algorithms/wagma.py`): group averages that a late member does not delay.

Idealised for the authors' rule: their graph starts each tensor's exchange once that tensor's gradient is ready
(`tf.control_dependencies([grad])`), so it hides the exchange under the rest of the backward pass only; the
rule charges the full overlap of the exchange with the gradient that their order permits.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, TYPE_CHECKING

import numpy as np

from waitless import config_errors as errors
from waitless.algorithms import spec
from waitless.algorithms import wagma
from waitless.algorithms.wagma import WagmaSchedule
from waitless.cluster import network as network_lib
from waitless.cluster import schedules
from waitless.cluster.rules import activation as activation_lib
from waitless.cluster.rules import base

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


def group_reduce(values: np.ndarray, masks: list[int], op=np.maximum) -> np.ndarray:
  """`op` (np.maximum, np.add) over worker i's group (i XOR any combination of `masks`) of `values`, on every
  member: recursive doubling, as the device's group sum."""
  out = np.array(values, np.float64)
  index = np.arange(len(out))
  for mask in masks:
    out = op(out, out[index ^ mask])
  return out


def _group_hops(first, workers: int, masks: tuple[int, ...]) -> np.ndarray:
  """int16 (..., P): max over j in the group of i (i XOR any of `masks`) of popcount(j XOR k), for each k in
  `first` and every worker i: the hops from k to i's group's farthest member (the masks' bits, then the rest)."""
  spread = 0
  for mask in masks:
    spread |= mask
  if np.ndim(first) == 0:  # one iteration's first worker: a cached row
    return activation_lib.hops_row(int(first), workers, spread) + np.int16(len(masks))
  return activation_lib.hops_from(first, workers, ignore=spread) + np.int16(len(masks))


def _pair_views(buffer: np.ndarray, bit: int):
  """(view, the view with every worker i swapped for i XOR bit) of a float64 (P,) buffer, shape (P/2bit, 2, bit)."""
  view = buffer.reshape(-1, 2, bit)
  return view, view[:, ::-1, :]


@dataclasses.dataclass(frozen=True)
class WaitAvoidingGroups(base.TimeRule):
  """WAGMA-SGD (`wagma`): group averaging that never waits for late members; global average every tau.

  Worker i runs iteration t from start_i = end_i(t-1): its local step finishes at c_i = start_i + X_i. Its
  model joins the collective at x_i = start_i (rule='authors': W(t) is averaged while the gradient at W(t) is
  computed, as dpsgd's order='overlap') or x_i = c_i (rule='step_then_average': W' exists after the step).
  - If (t+1) mod tau == 0 or S == P: blocking global average: end_i = max(c_i, max_j x_j + allreduce(P)) (=
    max_j c_j + allreduce(P) stepping first); all fresh.
  - Else (wait-avoiding, the default) the group collective is activated by the first worker of the whole
    system to reach it and the activation travels over the hypercube, `activation_latency_s` = a per hop:
    worker i learns of it at A_i = min_k (x_k + popcount(k XOR i) a). Worker i is fresh iff x_i <= A_i (its
    posted model is in the sum; else its progress thread contributes the send buffer, its previous one). Its
    group completes at D = max over members j of A_j + allreduce(S) (ring all-reduce within the group);
    end_i = max(c_i, D) (= D for a fresh worker stepping first). Idle: end_i - c_i, except a fresh worker
    stepping first: D - allreduce(S) - c_i (its exchange is not hidden, so it is not idle time).
  - `wait_avoiding=False` (ablation): every group waits for its slowest member: D = max over the group of
    x_j + allreduce(S), everyone fresh.
  With exactly constant compute every worker is fresh (A_i = c_i). With continuous noise larger than a most
  workers are stale (only those no earlier arrival's activation reaches first).
  Emulation limit: a worker whose previous model was not posted by A_i (x_i(t-1) > A_i: its buffer is two or
  more iterations old) is still treated as one iteration stale by the math; the rule flags it (`behind`).
  A worker that failed for good (`stragglers.fail_worker`, no return) is not live: it contributes nothing,
  its clock stays where it failed, and its group is its n_g live members: D = max over them of A_j +
  allreduce(n_g) (the failure is known to its peers, e.g. through the heartbeat; like non-blocking SGD's
  trigger, the activation still crosses its hypercube node). The next global average needs it: the clock
  raises `StalledError` there, so the run goes on between global averages and stops at the first one.

  Schedule: `WagmaSchedule`. Per-worker staleness statistic: 0 fresh (or lost), 1 stale, 2 behind (meaning 2 or
  more). Reports: `fresh_share` (share of fresh contributions among live workers, 1 on global-average
  iterations; mean over a metrics window), `stale` and `behind` (counts of live workers, summed over a window).
  """
  group_size: int      # S
  sync_every: int      # tau
  microbatches: int = 1
  activation_latency_s: float = spec.DEFAULT_ACTIVATION_LATENCY_S  # a: one hop of the activation broadcast
  fixed_groups: bool = False   # always the groups of iteration 0
  wait_avoiding: bool = True   # False: every group waits for its slowest member
  rule: str = 'authors'        # 'authors': W(t) is posted at the start, under the gradient; 'step_then_average'
  group_patterns: str = 'rotate'  # 'rotate' | 'aligned' (`group_masks`)

  schedule_type = WagmaSchedule
  reports = {'fresh_share': 'mean', 'stale': 'sum', 'behind': 'sum'}
  vectorized = True

  def __post_init__(self):
    errors.require_int(self.group_size, 'group_size', 1)
    errors.require_int(self.sync_every, 'sync_every', 1)
    errors.require_int(self.microbatches, 'microbatches', 1)
    wagma.exact_log2(self.group_size, 'group_size')
    wagma.check_options(self.rule, self.group_patterns)
    activation_lib.check_latency(self.activation_latency_s)

  def pattern(self, iteration: int, workers: int) -> int:
    return 0 if self.fixed_groups else iteration % wagma.num_patterns(workers, self.group_size, self.group_patterns)

  @property
  def overlaps(self) -> bool:
    """The posted model is W(t), ready when the iteration starts: the exchange runs under the gradient."""
    return self.rule == 'authors'

  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
    p, s = clock.workers, self.group_size
    wagma.exact_log2(p, 'workers')
    if s > p:
      raise ValueError(f'group_size={s} must be <= workers={p}')
    pattern = self.pattern(iteration, p)
    masks = wagma.group_masks(pattern, p, s, self.group_patterns)
    state = clock.rule_state
    previous = state.get('previous_posted')
    previous = np.zeros(p) if previous is None else previous
    start = clock.times.copy()
    finished = clock.work(np.arange(p), clock.times, self.microbatches)
    live = np.isfinite(finished)  # a worker that failed for good finishes nothing more
    # When worker i's model joins the collective: at its start (authors: W(t), the exchange overlaps the
    # gradient, as dpsgd's order='overlap') or when its step is done (step_then_average: W').
    posted = np.where(live, start, np.inf) if self.overlaps else finished
    state['previous_posted'] = posted
    members = np.full(p, s)
    if (iteration + 1) % self.sync_every == 0 or s == p:
      arrival = posted.max()  # +inf after a permanent failure: the clock stops the run here
      clock.times[:] = np.maximum(finished, arrival + clock.network.allreduce(clock.model_bytes, p))
      fresh, behind = np.ones(p, bool), np.zeros(p, bool)
      idle = clock.times - finished if self.overlaps else arrival - finished
      communicated = network_lib.ring_bytes(clock.model_bytes, p)
      global_average = True
    else:
      if self.wait_avoiding:
        activation = activation_lib.activation_times(posted, self.activation_latency_s)
        fresh = posted <= activation
        behind = ~fresh & live & (previous > activation)
      else:
        activation, fresh, behind = posted, live.copy(), np.zeros(p, bool)
      members = group_reduce(live, masks, np.add).astype(np.int64)
      # Every live member has joined (fresh, or stale through its progress thread); a lost one is not waited for.
      joined = group_reduce(np.where(live, activation, -np.inf), masks)
      group_time = {k: clock.network.allreduce(clock.model_bytes, k) for k in np.unique(members).tolist()}
      done = joined + np.array([group_time[k] for k in members.tolist()])
      end = np.where(live, np.maximum(finished, done), clock.times)  # a lost worker's clock stays where it failed
      idle = np.where(live, np.where(fresh & ~self.overlaps, joined - finished, end - finished), 0.0)
      clock.times[:] = end
      sizes, groups = np.unique(members[wagma.group_ids(pattern, p, s, self.group_patterns) == np.arange(p)],
                                return_counts=True)
      communicated = sum(count * network_lib.ring_bytes(clock.model_bytes, size)
                         for size, count in zip(sizes.tolist(), groups.tolist()))
      global_average = False
    if not live.any():  # nobody is left: the clock stops the run
      clock.times[:] = np.inf
    staleness = np.where(fresh | ~live, 0, np.where(behind, 2, 1)).astype(np.float64)
    return schedules.Iteration(
        schedule=WagmaSchedule(microbatches_done=np.where(live, self.microbatches, 0).astype(np.int32),
                               fresh=fresh, behind=behind, live=live, members=members.astype(np.int32),
                               pattern=np.int32(pattern),
                               global_average=np.bool_(global_average)),
        idle=idle, bytes_communicated=communicated, staleness=staleness,
        measurements={'fresh_share': float(fresh[live].mean()) if live.any() else 0.0,
                      'stale': float((~fresh & live).sum()),
                      'behind': float(behind.sum())})

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> Optional[schedules.Steps]:
    """n calls of `iterate`: the compute times drawn ahead, one iteration at a time on preallocated rows, and
    everything that does not feed the next iteration (fresh, behind, idle, the schedule) after the loop.

    The activation: with f(x) = x + a (rounded), relaxing the hypercube's dimensions one by one gives exactly
    A_i = min_k f^popcount(i XOR k)(c_k) (f is monotone, so it commutes with min). A worker k with
    c_k >= f^G(min c) never lowers it, so when only the first arrival k* is earlier than that (the usual case
    with noise larger than G a), A_i = f^popcount(i XOR k*)(min c) and the group's last activation is
    f^(popcount((i XOR k*) outside the group's bits) + g)(min c): a table lookup in place of the relaxation.
    Failures: None (one `iterate` at a time).
    """
    p, s = clock.workers, self.group_size
    big_g = wagma.exact_log2(p, 'workers')
    if s > p:
      raise ValueError(f'group_size={s} must be <= workers={p}')
    jobs = clock.job_seconds(n, self.microbatches)
    if jobs is None:
      return None
    steps = iteration + np.arange(n)
    global_average = ((steps + 1) % self.sync_every == 0) | (s == p)
    patterns = steps % wagma.num_patterns(p, s, self.group_patterns) if not self.fixed_groups else np.zeros(n, np.int64)
    allreduce = clock.network.allreduce(clock.model_bytes, p)
    group_time = clock.network.allreduce(clock.model_bytes, s)
    a, wait_avoiding = float(self.activation_latency_s), self.wait_avoiding
    masks = {int(t): wagma.group_masks(int(t), p, s, self.group_patterns) for t in np.unique(patterns[~global_average])}
    relax_buffer, group_buffer = np.empty(p), np.empty(p)
    relax = []
    bit = 1
    while bit < p:
      relax.append((*_pair_views(relax_buffer, bit), np.empty((p // (2 * bit), 2, bit))))
      bit <<= 1
    group_views = {t: [_pair_views(group_buffer, mask) for mask in m] for t, m in masks.items()}
    finished, times = np.empty((n, p)), np.empty((n, p))
    overlaps = self.overlaps
    posted = np.empty((n, p)) if overlaps else finished  # see `iterate`
    activation, joined = np.zeros((n, p)), np.zeros((n, p))  # filled on group iterations (quick ones below)
    quick, quick_worker, quick_min = [], [], []  # group iterations with a single first arrival
    start = clock.times
    for k, (is_global, pattern) in enumerate(zip(global_average.tolist(), patterns.tolist())):
      c, end, x = finished[k], times[k], posted[k]
      if overlaps:
        x[:] = start
      np.add(start, jobs[k], out=c)
      if is_global:
        if overlaps:
          np.maximum(c, x.max() + allreduce, out=end)
        else:
          end.fill(c.max() + allreduce)
        start = end
        continue
      if wait_avoiding:
        two = x.argpartition(1)[:2] if p > 1 else np.zeros(2, np.intp)  # the two first arrivals
        first, (earliest, second) = int(two[0]), x[two].tolist()
        ladder = [earliest]  # f^h(min c), h = 0..G
        for _ in range(big_g):
          ladder.append(ladder[-1] + a)
        if second >= ladder[-1]:  # nobody but the first arrives before f^G(min c)
          quick.append(k)
          quick_worker.append(first)
          quick_min.append(ladder[0])
          done = np.array([x + group_time for x in ladder]).take(_group_hops(first, p, tuple(masks[pattern])))
          np.maximum(c, done, out=end)
          start = end
          continue
        relax_buffer[:] = x
        for view, swapped, tmp in relax:
          np.add(swapped, a, out=tmp)
          np.minimum(view, tmp, out=view)
        activation[k] = relax_buffer
        group_buffer[:] = relax_buffer
      else:
        group_buffer[:] = x
      for view, swapped in group_views[pattern]:
        np.maximum(view, swapped, out=view)
      joined[k] = group_buffer
      np.add(group_buffer, group_time, out=end)
      np.maximum(c, end, out=end)
      start = end
    clock.times[:] = times[-1]
    state = clock.rule_state
    previous = state.get('previous_posted')
    previous = np.vstack([np.zeros(p) if previous is None else previous, posted[:-1]])
    state['previous_posted'] = posted[-1].copy()
    if quick:
      quick = np.asarray(quick)
      ladder = np.empty((len(quick), big_g + 1))
      ladder[:, 0] = quick_min
      for h in range(1, big_g + 1):
        ladder[:, h] = ladder[:, h - 1] + a
      first = np.asarray(quick_worker)
      rows = np.arange(len(quick))[:, None]
      activation[quick] = ladder[rows, activation_lib.hops_from(first, p)]
      for t in np.unique(patterns[quick]):
        of_t = patterns[quick] == t
        joined[quick[of_t]] = ladder[rows[of_t], _group_hops(first[of_t], p, tuple(masks[int(t)]))]
    group = ~global_average[:, None]
    if wait_avoiding:
      fresh = ~group | (posted <= activation)
      behind = group & ~fresh & (previous > activation)
    else:
      fresh, behind = np.ones((n, p), bool), np.zeros((n, p), bool)
    if overlaps:
      idle = times - finished
    else:
      idle = np.where(group, np.where(fresh, joined - finished, times - finished),
                      finished.max(axis=1, keepdims=True) - finished)
    stale, behind_count = (~fresh).sum(axis=1).astype(np.float64), behind.sum(axis=1).astype(np.float64)
    communicated = np.where(global_average, network_lib.ring_bytes(clock.model_bytes, p),
                            (p // s) * network_lib.ring_bytes(clock.model_bytes, s))
    return schedules.Steps(
        schedule=WagmaSchedule(microbatches_done=np.full((n, p), self.microbatches, np.int32), fresh=fresh,
                               behind=behind, live=np.ones((n, p), bool),
                               members=np.full((n, p), s, np.int32), pattern=patterns.astype(np.int32),
                               global_average=global_average),
        # Staleness 0 fresh, 1 stale, 2 behind: its mean is (stale + behind) / P, exactly.
        idle=idle, bytes_communicated=communicated.astype(np.float64), mean_staleness=(stale + behind_count) / p,
        end_time=times.max(axis=1), times=times,
        measurements={'fresh_share': fresh.mean(axis=1), 'stale': stale, 'behind': behind_count})


def time_rule(config):
  a = config.algorithm
  return WaitAvoidingGroups(
      group_size=wagma.group_size_of(config), sync_every=a.sync_every, microbatches=config.microbatches,
      activation_latency_s=float(a.activation_latency_s), fixed_groups=a.fixed_groups,
      wait_avoiding=a.wait_avoiding, rule=a.rule, group_patterns=a.group_patterns)
