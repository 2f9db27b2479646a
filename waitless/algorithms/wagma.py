"""WAGMA-SGD: wait-avoiding group model averaging, with a blocking global average every tau iterations.

Update rule for worker i at iteration t (P workers, groups of S, G = log2 P, g = log2 S, tau = `sync_every`),
c_j = what member j contributes: its posted model if fresh, else its send buffer (the model it posted last):
  rule='authors' (default; the authors' code):
    if (t+1) mod tau == 0 or S == P:  A_i = (1/P) sum_j W_j                    (blocking global average)
    else:                             A_i = (sum_{j in group_t(i)} c_j + W_i) / (S + 1)   fresh or not
    W_i <- A_i + U_i(g_i(W_i))        (the gradient at the W_i before the average; buf_i <- W_i)
  rule='step_then_average' (the rule this project built first; an option):
    W'_i <- W_i + U_i(g_i)
    if (t+1) mod tau == 0 or S == P:  W_i <- (1/P) sum_j W'_j
    else:                             Sg = sum_{j in group_t(i)} c_j (posted model W'_j)
                                      W_i <- Sg / S if fresh_i, (Sg + W'_i) / (S + 1) if not
    buf_i <- W'_i
Why the authors' rule is the default: it is what the paper's numbers were measured with
(Shigangli/WAGMA-SGD at 3cb53050a309fa461b01361fc173a91339b05556,
test-models/tf-models-r1.11/official/utils/opt_wagma_sgd_imagenet.py: `WAGMASGDOptimizer.apply_gradients`
assigns var <- allreducef(var) and then applies the momentum step of the gradient taken at the old var;
`allreducef::forward` returns (group sum + input) / (S + 1), own model counted twice, or sum / P every
LIMITER + 1 = tau iterations), and its order lets the group exchange of W(t) run under the gradient computation
(the time rule charges that overlap). Under it S = P or tau = 1 is not local SGD with H = 1 but
W_i <- mean_j W_j + U_i(g_i(W_i)) (D-PSGD's overlap order on the complete graph); under step_then_average
it is. The two rules differ by O(1) on a trajectory (a float64 port of the authors' code: 1.03 at P = 16,
S = 4, tau = 11), so an experiment says which it ran.
A worker lost for good (`live` false in the schedule) is frozen: its W, send buffer and optimizer state stay,
it contributes nothing, and its group counts its live members n_g (S without failures) in place of S.
The blocking global average needs every worker: the time rule stops the run there (`clock.StalledError`).

Groups: group_t(i) = {i XOR (any XOR of the masks m_r)}. group_patterns='rotate' (default):
m_r = 1 << ((t g + r) mod G), r = 0..g-1: P = 8, S = 4: t = 0 -> {0,1,2,3},{4,5,6,7}; t = 1 ->
{0,1,4,5},{2,3,6,7}; the mask set repeats with period n = G / gcd(G, g). group_patterns='authors':
m_r = 1 << (j g + r), j = t mod floor(G / g) (fflib3/src/colls/ffallreduce.c, `ffallreduce_nh`). The two are
the same whenever g divides G (every configuration the authors ran: P = 64, S = 8). Where it does not
(P = 8, S = 4; P = 16, S = 8) the authors' groups are fixed and the top G mod g bits of the worker id never mix
except in the global average; rotation is the default there because it keeps the paper's stated property
(information reaches all P workers in ceil(log_S P) iterations; the paper's ablation: fixed groups lose
accuracy), and the authors' own code asserts nothing about that case (`//assert(steps == STEPS)`).
The group sum is one of n static recursive-doubling programs (g single-axis exchange rounds each,
`collectives.xor_group_sum`), picked by the schedule's uniform `pattern` with `lax.switch` (one more branch
holds the global all-reduce): only the iteration's own collectives run, also when workers are vmapped.
`fixed_groups` keeps pattern 0 (the paper's ablation).

Choices: S = P makes every iteration the blocking global average (under step_then_average = `local_sgd` with
H = 1); the initial send buffer is W_0; optimizer state stays local.

Time (`WaitAvoidingGroups` below): worker i's local step ends at c_i; its model joins the collective at x_i:
its start (authors: W(t) is ready before the gradient) or c_i (step_then_average). The group collective of
iteration t is activated by the first worker to reach it and the activation spreads over the hypercube: worker
i learns of it at A_i = min_k (x_k + popcount(k XOR i) a), a = `activation_latency_s`; fresh iff x_i <= A_i; a
group completes at D = max over its members of A_i + allreduce(S); a late member does not delay it; worker i
ends at max(c_i, D) (authors: the exchange is hidden under the gradient as in dpsgd's order='overlap', an
iteration costs max(compute, exchange); step_then_average: D >= c_i for a fresh worker, compute + exchange).
Idealised for the authors' rule: their TF graph starts each tensor's exchange once that tensor's gradient is
ready (`tf.control_dependencies([grad])`), so it hides the exchange under the rest of the backward pass only;
the rule charges the full overlap that the order permits. Consequence (measured with step_then_average;
`experiments.simulate`, P = 16, S = 4, tau = 10, ideal network, a = 10 us, median 10 ms per step; share of
fresh contributions on group iterations): constant compute 1.0, 2 % lognormal noise 0.068, 20 % noise 0.063
(with a = 0 exactly one worker in 16 is fresh; a = 100 us and 2 % noise: 0.19). With any continuous noise
larger than `a` most contributions are one iteration stale, as in the real collective (the authors' code
always averages (sum + own W) / (S + 1)). On digits (16 workers, target 95 %, 3 seeds;
`benchmarks/wagma_comparison.py`) this staleness costs little: see its `noise` table. A worker more than one
iteration behind (its previous step had not finished when the activation reached it: its buffer is older than
one iteration; 20 % noise: about 3.4 of 16 workers per iteration) is still treated as one iteration stale by
the math; the rule counts such workers (`behind`).
Off the simulator (no schedule: every member is fresh) the group exchange is log2 S pairwise `ppermute`s, so on
a multi-process run a slow process delays its partners of that iteration only, but it does delay them: a
lock-step program cannot skip a late partner. Measured on 4 CPU processes, S = 2 (`benchmarks/real_stragglers.py`,
RESULTS.md section 8): a random 40 ms straggler per iteration cost 23-26 ms per iteration against sync's 37-45;
this rule, which does skip late members, predicted 12-13.

Reference: Li, Ben-Nun, Di Girolamo, Alistarh, Hoefler, "Breaking (Global) Barriers in Parallel Stochastic
Optimization with Wait-Avoiding Group Averaging", IEEE TPDS 2020 (arXiv 2005.00124).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional, TYPE_CHECKING

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import collectives
from waitless.algorithms import spec
from waitless.cluster import network as network_lib
from waitless.cluster import rules
from waitless.cluster.rules import activation as activation_lib
from waitless.cluster.rules import synchronous as rules_synchronous

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock

# 'authors': W_i <- (group sum of W(t) + W_i(t)) / (S + 1) + U_i(g_i(W_i(t))) (Shigangli/WAGMA-SGD, the default);
# 'step_then_average': W'_i = W_i + U_i(g_i), then the group average of W' (divisor S fresh, S + 1 stale).
RULES = ('authors', 'step_then_average')
# How the groups change: 'rotate' (masks move by g bits every iteration, modulo G) or 'authors' (their fixed
# floor(G / g) patterns). The two agree whenever log2 S divides log2 P.
GROUP_PATTERNS = ('rotate', 'authors')

# ---- groups ----

def _log2(n: int, name: str) -> int:
  if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1 or n & (n - 1):
    raise ValueError(f'{name}={n!r} must be a power of two')
  return int(n).bit_length() - 1


def default_group_size(workers: int) -> int:
  """sqrt(P) rounded up to a power of two: 2^ceil(log2(P) / 2) (P = 8 -> 4, 16 -> 4, 64 -> 8)."""
  return 1 << -(-_log2(workers, 'workers') // 2)


def group_masks(iteration: int, workers: int, group_size: int, patterns: str = 'rotate') -> list[int]:
  """The XOR masks of `iteration` (G = log2 P, g = log2 S): the group of i is i XOR any combination of them.

  patterns='rotate':  m_r = 1 << ((t g + r) mod G), r = 0..g-1 (every bit mixes within ceil(G / g) iterations).
  patterns='authors': m_r = 1 << (j g + r), j = t mod floor(G / g) (`ffallreduce_nh`, `mask <<= step*groupr`):
  the same masks whenever g divides G; otherwise the top G mod g bits are never in a mask.
  """
  big_g, g = _log2(workers, 'workers'), _log2(group_size, 'group_size')
  if group_size > workers:
    raise ValueError(f'group_size={group_size} must be <= workers={workers}')
  if patterns not in GROUP_PATTERNS:
    raise ValueError(f'patterns={patterns!r} must be one of {GROUP_PATTERNS}')
  if big_g == 0:
    return []
  if patterns == 'authors':
    j = iteration % num_patterns(workers, group_size, patterns)
    return [1 << (j * g + r) for r in range(g)]
  return [1 << ((iteration * g + r) % big_g) for r in range(g)]


def num_patterns(workers: int, group_size: int, patterns: str = 'rotate') -> int:
  """Iteration t uses the masks of iteration t mod n: n = G / gcd(G, g) ('rotate'), floor(G / g) ('authors');
  1 for P = 1 or S = 1."""
  big_g, g = _log2(workers, 'workers'), _log2(group_size, 'group_size')
  if big_g == 0 or g == 0:
    return 1
  return big_g // g if patterns == 'authors' else big_g // math.gcd(big_g, g)


def group_ids(iteration: int, workers: int, group_size: int, patterns: str = 'rotate') -> np.ndarray:
  """int32 (P,): the smallest member of each worker's group at `iteration` (a canonical group label)."""
  spread = 0
  for mask in group_masks(iteration, workers, group_size, patterns):
    spread |= mask
  return (np.arange(workers) & ~spread).astype(np.int32)


# ---- the math ----

class WagmaState(NamedTuple):
  count: jax.Array         # int32 (): iterations so far (the same on every worker)
  inner: optax.OptState    # this worker's own inner optimizer state
  send_buffer: optax.Params  # like params: the model this worker last posted (W_0 at first), what it contributes
  #                            when stale: W_i(t-1) under rule='authors', W'_i(t-1) under 'step_then_average'


def wagma(inner: optax.GradientTransformation, group_size: Optional[int] = None, sync_every: int = 10,
          fixed_groups: bool = False, rule: str = 'authors', group_patterns: str = 'rotate',
          axis_name: collectives.AxisName = None) -> optax.GradientTransformationExtraArgs:
  """A wait-avoiding group average of the models and a local step of `inner` (global average every tau-th step).

  Args:
    inner: the optimizer U, applied by each worker to its own gradient.
    group_size: S, a power of two <= P; None: `default_group_size(P)` for the P of `axis_name`.
    sync_every: tau >= 1; used only without a schedule (a library loop): then iteration t averages globally
      iff (t+1) mod tau == 0, and every worker is fresh. The harness's schedule says it instead.
    fixed_groups: always the groups of iteration 0 (ablation).
    rule: 'authors' (average W(t) with divisor S + 1, then the step of the gradient at W(t)) or
      'step_then_average' (step, then average W' with divisor S fresh, S + 1 stale). See the module docstring.
    group_patterns: how the groups change, 'rotate' or 'authors' (`group_masks`).
    axis_name: the worker axes (P must be a power of two); None for one worker (averaging is the identity).

  Returns:
    A transformation whose `update(grads, state, params, *, schedule=None, step=None)` moves each worker's
    params to its new params. `schedule`: a `WagmaSchedule` with per-worker `fresh` and uniform
    `pattern` and `global_average` (unbatched: the `lax.switch` over them is a real conditional when workers
    are vmapped). `step`: the replicated iteration number, used only without a schedule (None: the state's
    counter).
  """
  if rule not in RULES:
    raise ValueError(f'rule={rule!r} must be one of {RULES}')
  if group_patterns not in GROUP_PATTERNS:
    raise ValueError(f'group_patterns={group_patterns!r} must be one of {GROUP_PATTERNS}')
  authors = rule == 'authors'
  inner = optax.with_extra_args_support(inner)

  @spec.owns_its_buffers
  def init_fn(params):
    return WagmaState(count=jnp.zeros((), jnp.int32), inner=inner.init(params), send_buffer=params)

  def update_fn(grads, state, params=None, *, schedule=None, step: Optional[jax.Array] = None, **extra):
    del extra
    if params is None:
      raise ValueError('wagma needs params: it averages models, not gradients.')
    p = collectives.num_workers(axis_name)
    s = default_group_size(p) if group_size is None else group_size
    n = 1 if fixed_groups else num_patterns(p, s, group_patterns)
    masks_of = [group_masks(k, p, s, group_patterns) for k in range(n)]
    updates, inner_state = inner.update(grads, state.inner, params)
    stepped = optax.apply_updates(params, updates)
    # The model this iteration posts to its group: W(t) (authors: its gradient is independent of the average,
    # so the exchange can run under the gradient computation) or the stepped W' (step_then_average).
    posted = params if authors else stepped

    if schedule is None:
      t = state.count if step is None else step
      fresh, live, members = jnp.ones((), bool), jnp.ones((), bool), jnp.full((), s, jnp.int32)
      global_average = ((t + 1) % sync_every == 0) | (s == p)
      pattern = t % n
    else:
      fresh, global_average, pattern = schedule.fresh, schedule.global_average, schedule.pattern
      live, members = schedule.live, schedule.members
      global_average = global_average | (s == p)
    pattern = jnp.asarray(0 if fixed_groups else pattern, jnp.int32)

    def group_average(masks):
      def branch(operands):
        own, contribution, is_fresh, is_live, count, old = operands
        total = collectives.xor_group_sum(contribution, axis_name, masks)

        def average(sum_, mine, before):
          count_ = jnp.maximum(count, 1).astype(sum_.dtype)
          with_own = (sum_ + mine) / (count_ + 1)  # own model counted twice if fresh, beside its buffer if stale
          mean = with_own if authors else jnp.where(is_fresh, sum_ / count_, with_own)
          return jnp.where(is_live, mean, before).astype(mine.dtype)
        return jax.tree.map(average, total, own, old)
      return branch

    def global_mean(operands):
      return collectives.worker_mean(operands[0], axis_name)

    # A live worker contributes its posted model (fresh) or its send buffer (stale); a lost one (never fresh)
    # nothing.
    contribution = jax.tree.map(lambda new, buf: jnp.where(fresh, new, jnp.where(live, buf, jnp.zeros_like(buf))),
                                posted, state.send_buffer)
    index = jnp.where(global_average, n, pattern)
    averaged = lax.switch(index, [group_average(m) for m in masks_of] + [global_mean],
                          (posted, contribution, fresh, live, members, params))
    keep = lambda new, old: jax.tree.map(lambda x, y: jnp.where(live, x, y), new, old)  # a lost worker is frozen
    if authors:  # W_i <- A_i + U_i(g_i(W_i(t))); a lost worker keeps its W
      averaged = keep(optax.apply_updates(averaged, updates), params)
    updates = jax.tree.map(lambda new, old: new - old, averaged, params)
    return updates, WagmaState(count=optax.safe_increment(state.count), inner=keep(inner_state, state.inner),
                               send_buffer=keep(posted, state.send_buffer))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ---- the time rule ----

class WagmaSchedule(NamedTuple):
  """Schedule of one WAGMA iteration."""
  microbatches_done: np.ndarray  # int32 (P,), m (0 for a worker that failed for good)
  fresh: np.ndarray              # bool (P,), worker i's posted model (authors: W_i, step_then_average: W'_i)
  #                                is in its group's sum, else its send buffer (True for all on global averages)
  group: np.ndarray              # int32 (P,), smallest worker id in worker i's group (informative)
  behind: np.ndarray             # bool (P,), worker i was more than one iteration behind (treated as one)
  live: np.ndarray               # bool (P,), False: worker i failed for good (frozen, contributes nothing)
  members: np.ndarray            # int32 (P,), live members of worker i's group: the group average's divisor
  pattern: np.ndarray            # int32 (), the iteration's mask pattern: masks of iteration `pattern`
  #                                (t mod G / gcd(G, g); 0 with fixed groups); picks the `lax.switch` branch
  global_average: np.ndarray     # bool (), this iteration ends with the blocking average over all P
  UNIFORM = ('pattern', 'global_average')




def group_reduce(values: np.ndarray, masks: list[int], op=np.maximum) -> np.ndarray:
  """`op` (np.maximum, np.add) over worker i's group (i XOR any combination of `masks`) of `values`, on every
  member: recursive doubling, as the device's group sum."""
  out = np.array(values, np.float64)
  index = np.arange(len(out))
  for mask in masks:
    out = op(out, out[index ^ mask])
  return out


@functools.lru_cache(maxsize=16)
def _group_hops(workers: int, masks: tuple[int, ...]) -> np.ndarray:
  """int16 (P, P): max over j in the group of i (i XOR any of `masks`) of popcount(j XOR k), at [k, i]."""
  spread = 0
  for mask in masks:
    spread |= mask
  outside = np.arange(workers) & ~spread
  return activation_lib.hypercube_hops(workers)[np.ix_(outside, outside)] + np.int16(len(masks))


def _pair_views(buffer: np.ndarray, bit: int):
  """(view, the view with every worker i swapped for i XOR bit) of a float64 (P,) buffer, shape (P/2bit, 2, bit)."""
  view = buffer.reshape(-1, 2, bit)
  return view, view[:, ::-1, :]


@dataclasses.dataclass(frozen=True)
class WaitAvoidingGroups(rules.TimeRule):
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
  period: int          # tau
  microbatches: int = 1
  activation_latency_s: float = activation_lib.DEFAULT_ACTIVATION_LATENCY_S  # a: one hop of the activation broadcast
  fixed_groups: bool = False   # always the groups of iteration 0
  wait_avoiding: bool = True   # False: every group waits for its slowest member
  rule: str = 'authors'        # 'authors': W(t) is posted at the start, under the gradient; 'step_then_average'
  group_patterns: str = 'rotate'  # 'rotate' | 'authors' (`group_masks`)

  schedule_type = WagmaSchedule
  reports = {'fresh_share': 'mean', 'stale': 'sum', 'behind': 'sum'}
  vectorized = True

  def __post_init__(self):
    rules.check_positive_int(self.group_size, 'group_size')
    rules.check_positive_int(self.period, 'period')
    rules.check_positive_int(self.microbatches, 'microbatches')
    _log2(self.group_size, 'group_size')
    if self.rule not in RULES:
      raise ValueError(f'rule={self.rule!r} must be one of {RULES}')
    if self.group_patterns not in GROUP_PATTERNS:
      raise ValueError(f'group_patterns={self.group_patterns!r} must be one of {GROUP_PATTERNS}')
    a = self.activation_latency_s
    if not isinstance(a, (int, float, np.integer, np.floating)) or not math.isfinite(a) or a < 0:
      raise ValueError(f'activation_latency_s={a!r} must be a number >= 0')

  def pattern(self, iteration: int, workers: int) -> int:
    return 0 if self.fixed_groups else iteration % num_patterns(workers, self.group_size, self.group_patterns)

  @property
  def overlaps(self) -> bool:
    """The posted model is W(t), ready when the iteration starts: the exchange runs under the gradient."""
    return self.rule == 'authors'

  def iterate(self, clock: 'Clock', iteration: int) -> rules.Iteration:
    p, s = clock.workers, self.group_size
    _log2(p, 'workers')
    if s > p:
      raise ValueError(f'group_size={s} must be <= workers={p}')
    pattern = self.pattern(iteration, p)
    masks = group_masks(pattern, p, s, self.group_patterns)
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
    if (iteration + 1) % self.period == 0 or s == p:
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
      sizes, groups = np.unique(members[group_ids(pattern, p, s, self.group_patterns) == np.arange(p)],
                                return_counts=True)
      communicated = sum(count * network_lib.ring_bytes(clock.model_bytes, size)
                         for size, count in zip(sizes.tolist(), groups.tolist()))
      global_average = False
    if not live.any():  # nobody is left: the clock stops the run
      clock.times[:] = np.inf
    staleness = np.where(fresh | ~live, 0, np.where(behind, 2, 1)).astype(np.float64)
    return rules.Iteration(
        schedule=WagmaSchedule(microbatches_done=np.where(live, self.microbatches, 0).astype(np.int32),
                               fresh=fresh, group=group_ids(pattern, p, s, self.group_patterns), behind=behind,
                               live=live,
                               members=members.astype(np.int32), pattern=np.int32(pattern),
                               global_average=np.bool_(global_average)),
        idle=idle, bytes_communicated=communicated, staleness=staleness,
        measurements={'fresh_share': float(fresh[live].mean()) if live.any() else 0.0,
                      'stale': float((~fresh & live).sum()),
                      'behind': float(behind.sum())})

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> Optional[rules.Steps]:
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
    big_g = _log2(p, 'workers')
    if s > p:
      raise ValueError(f'group_size={s} must be <= workers={p}')
    jobs = rules_synchronous.job_seconds(clock, n, self.microbatches)
    if jobs is None:
      return None
    steps = iteration + np.arange(n)
    global_average = ((steps + 1) % self.period == 0) | (s == p)
    patterns = steps % num_patterns(p, s, self.group_patterns) if not self.fixed_groups else np.zeros(n, np.int64)
    allreduce = clock.network.allreduce(clock.model_bytes, p)
    group_time = clock.network.allreduce(clock.model_bytes, s)
    a, wait_avoiding = float(self.activation_latency_s), self.wait_avoiding
    masks = {int(t): group_masks(int(t), p, s, self.group_patterns) for t in np.unique(patterns[~global_average])}
    group_hops = {t: _group_hops(p, tuple(m)) for t, m in masks.items()} if wait_avoiding else {}
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
          done = np.array([x + group_time for x in ladder]).take(group_hops[pattern][first])
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
      activation[quick] = ladder[rows, activation_lib.hypercube_hops(p)[first]]
      for t in np.unique(patterns[quick]):
        of_t = patterns[quick] == t
        joined[quick[of_t]] = ladder[rows[of_t], group_hops[int(t)][first[of_t]]]
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
    ids = np.stack([group_ids(t, p, s, self.group_patterns) for t in range(int(patterns.max()) + 1)])
    communicated = np.where(global_average, network_lib.ring_bytes(clock.model_bytes, p),
                            (p // s) * network_lib.ring_bytes(clock.model_bytes, s))
    return rules.Steps(
        schedule=WagmaSchedule(microbatches_done=np.full((n, p), self.microbatches, np.int32), fresh=fresh,
                               group=ids[patterns], behind=behind, live=np.ones((n, p), bool),
                               members=np.full((n, p), s, np.int32), pattern=patterns.astype(np.int32),
                               global_average=global_average),
        # Staleness 0 fresh, 1 stale, 2 behind: its mean is (stale + behind) / P, exactly.
        idle=idle, bytes_communicated=communicated.astype(np.float64), mean_staleness=(stale + behind_count) / p,
        end_time=times.max(axis=1), times=times,
        measurements={'fresh_share': fresh.mean(axis=1), 'stale': stale, 'behind': behind_count})


# ---- config glue ----

def group_size_of(config) -> int:
  """S from the config: `algorithm.group_size`, or sqrt(P) rounded up to a power of two when it is 0."""
  s = config.algorithm.group_size
  return default_group_size(config.workers) if s == 0 else s


def time_rule(config):
  a = config.algorithm
  return WaitAvoidingGroups(
      group_size=group_size_of(config), period=a.sync_every, microbatches=config.microbatches,
      activation_latency_s=float(a.activation_latency_s), fixed_groups=a.fixed_groups,
      wait_avoiding=a.wait_avoiding, rule=a.rule, group_patterns=a.group_patterns)


def _power_of_two(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 1 and not value & (value - 1)


def validate(config):
  a, p = config.algorithm, config.workers
  errors.require(_power_of_two(p), 'workers', p, 'wagma needs a power of two (groups are XOR-mask cosets)')
  s = a.group_size
  errors.require(s == 0 or _power_of_two(s), 'algorithm.group_size', s,
                 'must be a power of two (0: sqrt(workers) rounded up to a power of two)')
  errors.require(s <= p, 'algorithm.group_size', s, f'must be <= workers={p}')
  errors.require_int(a.sync_every, 'algorithm.sync_every', 1)
  lat = a.activation_latency_s
  errors.require(isinstance(lat, (int, float)) and not isinstance(lat, bool) and math.isfinite(lat) and lat >= 0,
                 'algorithm.activation_latency_s', lat, 'must be a number >= 0 (seconds)')
  for field in ('fixed_groups', 'wait_avoiding'):
    errors.require(isinstance(a[field], bool), f'algorithm.{field}', a[field], 'must be a bool')
  errors.require(a.rule in RULES, 'algorithm.rule', a.rule, f'must be one of {", ".join(RULES)}')
  errors.require(a.group_patterns in GROUP_PATTERNS, 'algorithm.group_patterns', a.group_patterns,
                 f'must be one of {", ".join(GROUP_PATTERNS)}')


SPEC = spec.AlgorithmSpec(
    name='wagma',
    defaults={
        'group_size': 0,        # S, a power of two <= workers; 0: sqrt(workers) rounded up to a power of two
        'sync_every': 10,       # tau: blocking global average every tau-th iteration (paper: 10 ImageNet, 8 WMT)
        'activation_latency_s': activation_lib.DEFAULT_ACTIVATION_LATENCY_S,  # a: seconds per hop of the activation
        'fixed_groups': False,  # ablation: always the groups of iteration 0
        'wait_avoiding': True,  # ablation (False): every group waits for its slowest member, all fresh
        'rule': 'authors',      # 'authors' (average W(t) / (S + 1), then the step) | 'step_then_average'
        'group_patterns': 'rotate',  # 'rotate' (every bit mixes) | 'authors' (their fixed floor(G / g) patterns)
    },
    # group_size 0 is resolved from the P of axis_name (= workers in the harness; 1 for axis_name=None).
    build=lambda config, inner, axis_name: wagma(
        inner, group_size=config.algorithm.group_size or None, sync_every=config.algorithm.sync_every,
        fixed_groups=config.algorithm.fixed_groups, rule=config.algorithm.rule,
        group_patterns=config.algorithm.group_patterns, axis_name=axis_name),
    time_rule=time_rule, validate=validate)
