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

import math
from typing import NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import collectives
from waitless.algorithms import spec

# 'authors': W_i <- (group sum of W(t) + W_i(t)) / (S + 1) + U_i(g_i(W_i(t))) (Shigangli/WAGMA-SGD, the default);
# 'step_then_average': W'_i = W_i + U_i(g_i), then the group average of W' (divisor S fresh, S + 1 stale).
RULES = ('authors', 'step_then_average')
# How the groups change: 'rotate' (masks move by g bits every iteration, modulo G) or 'authors' (their fixed
# floor(G / g) patterns). The two agree whenever log2 S divides log2 P.
GROUP_PATTERNS = ('rotate', 'authors')

# ---- groups ----

def exact_log2(n: int, name: str) -> int:
  if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1 or n & (n - 1):
    raise ValueError(f'{name}={n!r} must be a power of two')
  return int(n).bit_length() - 1


def default_group_size(workers: int) -> int:
  """sqrt(P) rounded up to a power of two: 2^ceil(log2(P) / 2) (P = 8 -> 4, 16 -> 4, 64 -> 8)."""
  return 1 << -(-exact_log2(workers, 'workers') // 2)


def group_masks(iteration: int, workers: int, group_size: int, patterns: str = 'rotate') -> list[int]:
  """The XOR masks of `iteration` (G = log2 P, g = log2 S): the group of i is i XOR any combination of them.

  patterns='rotate':  m_r = 1 << ((t g + r) mod G), r = 0..g-1 (every bit mixes within ceil(G / g) iterations).
  patterns='authors': m_r = 1 << (j g + r), j = t mod floor(G / g) (`ffallreduce_nh`, `mask <<= step*groupr`):
  the same masks whenever g divides G; otherwise the top G mod g bits are never in a mask.
  """
  big_g, g = exact_log2(workers, 'workers'), exact_log2(group_size, 'group_size')
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
  big_g, g = exact_log2(workers, 'workers'), exact_log2(group_size, 'group_size')
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


# ---- config glue ----

def group_size_of(config) -> int:
  """S from the config: `algorithm.group_size`, or sqrt(P) rounded up to a power of two when it is 0."""
  s = config.algorithm.group_size
  return default_group_size(config.workers) if s == 0 else s


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
        'activation_latency_s': spec.DEFAULT_ACTIVATION_LATENCY_S,  # a: seconds per hop of the activation
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
    validate=validate)
