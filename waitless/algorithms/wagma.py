"""WAGMA-SGD: wait-avoiding group model averaging, with a blocking global average every tau iterations.

Update rule for worker i at iteration t (P workers, groups of S, G = log2 P, g = log2 S, tau = `sync_every`),
c_j = what member j contributes: its posted model if fresh, else its send buffer (the model it posted last):
  rule='authors' (default):
    if (t+1) mod tau == 0 or S == P:  A_i = (1/P) sum_j W_j                    (blocking global average)
    else:                             A_i = (sum_{j in group_t(i)} c_j + W_i) / (S + 1)   fresh or not
    W_i <- A_i + U_i(g_i(W_i))        (the gradient at the W_i before the average; buf_i <- W_i)
  rule='step_then_average':
    W'_i <- W_i + U_i(g_i)
    if (t+1) mod tau == 0 or S == P:  W_i <- (1/P) sum_j W'_j
    else:                             Sg = sum_{j in group_t(i)} c_j (posted model W'_j)
                                      W_i <- Sg / S if fresh_i, (Sg + W'_i) / (S + 1) if not
    buf_i <- W'_i
'authors' is the update of the authors' code (Shigangli/WAGMA-SGD, `opt_wagma_sgd_imagenet.py`:
`WAGMASGDOptimizer.apply_gradients` averages var, own model counted twice, then applies the momentum step of
the gradient taken at the old var); its order lets the group exchange of W(t) run under the gradient
computation. Under it S = P or tau = 1 is W_i <- mean_j W_j + U_i(g_i(W_i)), not local SGD with H = 1 as under
'step_then_average'; the two rules give different trajectories, so an experiment says which it ran.
A worker lost for good (`live` false in the schedule) is frozen: its W, send buffer and optimizer state stay,
it contributes nothing, and its group counts its live members n_g (S without failures) in place of S.

Groups: group_t(i) = {i XOR (any XOR of the masks m_r)} (`group_masks`): 'rotate' (default) moves the masks by
g bits every iteration, modulo G; 'aligned' takes them from the floor(G / g) whole g-bit blocks, one block per
iteration (fflib3's `ffallreduce_nh`, the patterns the authors' code uses). The two agree whenever g divides G.
The group sum is one of n static recursive-doubling programs (`collectives.xor_group_sum`), picked by the
schedule's uniform `pattern` with `lax.switch` (one more branch holds the global all-reduce): only the
iteration's own collectives run, also when workers are vmapped.
The time rule (who is fresh, when a group completes) is `cluster/rules/wagma.py`. Off the simulator (no
schedule: every member is fresh) the group exchange is log2 S pairwise `ppermute`s: a slow process delays its
partners of that iteration only, but it does delay them (a lock-step program cannot skip a late partner).

Reference: Li, Ben-Nun, Di Girolamo, Alistarh, Hoefler, "Breaking (Global) Barriers in Parallel Stochastic
Optimization with Wait-Avoiding Group Averaging", IEEE TPDS 2020 (arXiv 2005.00124).
"""
from __future__ import annotations

import functools
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
# How the groups change: 'rotate' (masks move by g bits every iteration, modulo G) or 'aligned' (masks from the
# floor(G / g) whole g-bit blocks, the authors' `ffallreduce_nh`). The two agree whenever log2 S divides log2 P.
GROUP_PATTERNS = ('rotate', 'aligned')

# ---- groups ----

def exact_log2(n: int, name: str) -> int:
  """log2 n for a power of two n >= 1; else ValueError naming `name`."""
  if not errors.is_int(n) or n < 1 or n & (n - 1):
    raise ValueError(f'{name}={n!r} must be a power of two')
  return int(n).bit_length() - 1


def default_group_size(workers: int) -> int:
  """sqrt(P) rounded up to a power of two: 2^ceil(log2(P) / 2) (P = 8 -> 4, 16 -> 4, 64 -> 8)."""
  return 1 << -(-exact_log2(workers, 'workers') // 2)


def group_masks(iteration: int, workers: int, group_size: int, patterns: str = 'rotate') -> list[int]:
  """The XOR masks of `iteration` (G = log2 P, g = log2 S): the group of i is i XOR any combination of them.

  patterns='rotate':  m_r = 1 << ((t g + r) mod G), r = 0..g-1 (every bit mixes within ceil(G / g) iterations).
  patterns='aligned': m_r = 1 << (j g + r), j = t mod floor(G / g) (`ffallreduce_nh`, `mask <<= step*groupr`,
  the authors' patterns): the same masks whenever g divides G; otherwise the top G mod g bits are never in a mask.
  """
  big_g, g = exact_log2(workers, 'workers'), exact_log2(group_size, 'group_size')
  if group_size > workers:
    raise ValueError(f'group_size={group_size} must be <= workers={workers}')
  if patterns not in GROUP_PATTERNS:
    raise ValueError(f'patterns={patterns!r} must be one of {GROUP_PATTERNS}')
  if big_g == 0:
    return []
  if patterns == 'aligned':
    j = iteration % num_patterns(workers, group_size, patterns)
    return [1 << (j * g + r) for r in range(g)]
  return [1 << ((iteration * g + r) % big_g) for r in range(g)]


def num_patterns(workers: int, group_size: int, patterns: str = 'rotate') -> int:
  """Iteration t uses the masks of iteration t mod n: n = G / gcd(G, g) ('rotate'), floor(G / g) ('aligned');
  1 for P = 1 or S = 1."""
  big_g, g = exact_log2(workers, 'workers'), exact_log2(group_size, 'group_size')
  if big_g == 0 or g == 0:
    return 1
  return big_g // g if patterns == 'aligned' else big_g // math.gcd(big_g, g)


def group_ids(iteration: int, workers: int, group_size: int, patterns: str = 'rotate') -> np.ndarray:
  """int32 (P,): the smallest member of each worker's group at `iteration` (a canonical group label)."""
  spread = 0
  for mask in group_masks(iteration, workers, group_size, patterns):
    spread |= mask
  return (np.arange(workers) & ~spread).astype(np.int32)


# ---- the math ----

def check_options(rule: str, group_patterns: str) -> None:
  """Raises ValueError unless `rule` is one of RULES and `group_patterns` one of GROUP_PATTERNS."""
  if rule not in RULES:
    raise ValueError(f'rule={rule!r} must be one of {RULES}')
  if group_patterns not in GROUP_PATTERNS:
    raise ValueError(f'group_patterns={group_patterns!r} must be one of {GROUP_PATTERNS}')


class WagmaState(NamedTuple):
  """State of `wagma` on one worker.

  Attributes:
    count: int32 (), iterations so far (the same on every worker).
    inner: this worker's own inner optimizer state.
    send_buffer: like params, the model this worker last posted (W_0 at first), what it contributes when
      stale: W_i(t-1) under rule='authors', W'_i(t-1) under 'step_then_average'.
  """
  count: jax.Array
  inner: optax.OptState
  send_buffer: optax.Params


def _iteration(schedule, t, group_size: int, workers: int, patterns: int, sync_every: int, fixed_groups: bool):
  """(fresh, live, members, global_average, pattern) of iteration t: the schedule's, or without one (a library
  loop) every worker fresh and live, and a global average every `sync_every`-th iteration."""
  if schedule is None:
    fresh, live, members = jnp.ones((), bool), jnp.ones((), bool), jnp.full((), group_size, jnp.int32)
    global_average = ((t + 1) % sync_every == 0) | (group_size == workers)
    pattern = t % patterns
  else:
    fresh, global_average, pattern = schedule.fresh, schedule.global_average, schedule.pattern
    live, members = schedule.live, schedule.members
    global_average = global_average | (group_size == workers)
  pattern = jnp.asarray(0 if fixed_groups else pattern, jnp.int32)
  return fresh, live, members, global_average, pattern


def _contribution(posted, send_buffer, fresh, live):
  """What a worker adds to its group's sum: its posted model (fresh), its send buffer (stale), or nothing (lost)."""
  return jax.tree.map(lambda new, buf: jnp.where(fresh, new, jnp.where(live, buf, jnp.zeros_like(buf))),
                      posted, send_buffer)


def _group_mean(total, own, before, members, fresh, live, authors: bool):
  """One leaf of the group average: (sum + own) / (n_g + 1), or sum / n_g for a fresh worker under
  step_then_average (own model counted twice if fresh, beside its buffer if stale); a lost worker keeps `before`."""
  count = jnp.maximum(members, 1).astype(total.dtype)
  with_own = (total + own) / (count + 1)
  mean = with_own if authors else jnp.where(fresh, total / count, with_own)
  return jnp.where(live, mean, before).astype(own.dtype)


def _group_average(operands, *, masks, authors: bool, axis_name):
  """A `lax.switch` branch: the average over the groups of `masks` (the XOR masks of one pattern)."""
  own, contribution, fresh, live, members, before = operands
  total = collectives.xor_group_sum(contribution, axis_name, masks)
  return jax.tree.map(lambda t, o, b: _group_mean(t, o, b, members, fresh, live, authors), total, own, before)


def _global_average(operands, *, axis_name):
  """The last `lax.switch` branch: the blocking average of the posted models over all P workers."""
  return collectives.worker_mean(operands[0], axis_name)


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
    group_patterns: how the groups change, 'rotate' or 'aligned' (the authors' patterns; `group_masks`).
    axis_name: the worker axes (P must be a power of two); None for one worker (averaging is the identity).

  Returns:
    A transformation whose `update(grads, state, params, *, schedule=None, step=None)` moves each worker's
    params to its new params. `schedule`: a `WagmaSchedule` with per-worker `fresh` and uniform
    `pattern` and `global_average` (unbatched: the `lax.switch` over them is a real conditional when workers
    are vmapped). `step`: the replicated iteration number, used only without a schedule (None: the state's
    counter).

  Example:
    >>> tx = wagma(optax.sgd(0.1), group_size=4, axis_name='workers')  # inside shard_map over 'workers'
    >>> updates, state = tx.update(grads, state, params, schedule=schedule)
  """
  check_options(rule, group_patterns)
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
    updates, inner_state = inner.update(grads, state.inner, params)
    # The model this iteration posts to its group: W(t) (authors: its gradient is independent of the average,
    # so the exchange can run under the gradient computation) or the stepped W' (step_then_average).
    posted = params if authors else optax.apply_updates(params, updates)
    t = state.count if step is None else step
    fresh, live, members, global_average, pattern = _iteration(schedule, t, s, p, n, sync_every, fixed_groups)
    branches = [functools.partial(_group_average, masks=group_masks(k, p, s, group_patterns), authors=authors,
                                  axis_name=axis_name) for k in range(n)]
    branches.append(functools.partial(_global_average, axis_name=axis_name))
    averaged = lax.switch(jnp.where(global_average, n, pattern), branches,
                          (posted, _contribution(posted, state.send_buffer, fresh, live), fresh, live, members,
                           params))
    keep = lambda new, old: jax.tree.map(lambda x, y: jnp.where(live, x, y), new, old)  # a lost worker is frozen
    if authors:  # W_i <- A_i + U_i(g_i(W_i(t))); a lost worker keeps its W
      averaged = keep(optax.apply_updates(averaged, updates), params)
    updates = jax.tree.map(lambda new, old: new - old, averaged, params)
    return updates, WagmaState(count=optax.safe_increment(state.count), inner=keep(inner_state, state.inner),
                               send_buffer=keep(posted, state.send_buffer))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class WagmaSchedule(NamedTuple):
  """Schedule of one WAGMA iteration (what `update` reads; `cluster/rules/wagma.py` writes it)."""
  microbatches_done: np.ndarray  # int32 (P,), m (0 for a worker that failed for good)
  fresh: np.ndarray              # bool (P,), worker i's posted model (authors: W_i, step_then_average: W'_i)
  #                                is in its group's sum, else its send buffer (True for all on global averages)
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
  return errors.is_int(value) and value >= 1 and not value & (value - 1)


def validate(config):
  a, p = config.algorithm, config.workers
  errors.require(_power_of_two(p), 'workers', p, 'wagma needs a power of two (groups are XOR-mask cosets)')
  s = a.group_size
  errors.require(s == 0 or _power_of_two(s), 'algorithm.group_size', s,
                 'must be a power of two (0: sqrt(workers) rounded up to a power of two)')
  errors.require(s <= p, 'algorithm.group_size', s, f'must be <= workers={p}')
  errors.require_int(a.sync_every, 'algorithm.sync_every', 1)
  errors.require_number(a.activation_latency_s, 'algorithm.activation_latency_s', 'must be a number >= 0 (seconds)',
                        lambda v: v >= 0)
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
        'group_patterns': 'rotate',  # 'rotate' (every bit mixes) | 'aligned' (whole g-bit blocks, the authors')
    },
    # group_size 0 is resolved from the P of axis_name (= workers in the harness; 1 for axis_name=None).
    build=lambda config, inner, axis_name: wagma(
        inner, group_size=config.algorithm.group_size or None, sync_every=config.algorithm.sync_every,
        fixed_groups=config.algorithm.fixed_groups, rule=config.algorithm.rule,
        group_patterns=config.algorithm.group_patterns, axis_name=axis_name),
    validate=validate)
