"""LAP-SGD and LPP-SGD: Hogwild threads per node, local steps, non-blocking model averaging across nodes.

One worker = one node holding one model W shared by Q compute threads (Hogwild, lock-free). Emulation
(choice): the threads take turns; node update t (0-based) applies the gradient of thread j = t mod Q, taken at
that thread's VIEW V_j, the node model it read right after its previous update (W_0 for its first), with its
own optimizer state (momentum) U_j:
    W <- W + U_j(g(V_j))                                   (thread j's step on the shared model)
    every H-th update: snapshot s = W, all-reduce starts   (H = 1 before `pre_post_steps`: post-local)
    d updates later:   W <- W + (mean(s) - s)              (non-blocking average, weights only)
    V_j <- W                                               (thread j reads the node model again)
With equal thread speeds V_j is the node model of update t - Q + 1: each gradient is Q - 1 updates stale.
The learning-rate schedule follows the node-level update counter t, not the thread's own step count: every
`optax.ScaleByScheduleState.count` in thread j's state is set to t before its step (other counters, e.g.
Adam's bias correction, stay per thread, as the thread's moments have seen only its own steps).
The average is `algorithms.delayed_averaging` (`local_progress` correction): the snapshot is carried in the
state and its all-reduce runs at the apply step inside a conditional over the uniform schedule fields.

LPP-SGD (`lpp_sgd`): the parameters, flattened in leaf order, are split into Q contiguous disjoint blocks of
equal size (+-1 element; a leaf may be split, choice). From update `prepass_steps` on each thread alternates a
full step and a partial step (the first Q updates after the prepass are full, the next Q partial, ...); a
partial step of thread j changes only block j: the update and thread j's optimizer state outside the block
are left as they were (choice: no step at all there, as a framework skips parameters without gradient).

With Q = 1 and d = 0 this is local SGD with period H (`local_sgd`), exactly. State per node: Q views (none
when Q = 1), Q inner optimizer states and the snapshot: about Q + 1 extra copies of the parameters.

Time (`NodeThreads` below): Q threads share the node's accelerator (choice): Q node updates together cost
X(b Q), one batch Q times larger, spread evenly (X(b Q) / Q each). The clock draws the Q*m micro-batch times
once per Q node updates, so the compute time follows the data actually consumed (m micro-batches per update).
With a per-call overhead o (`stragglers.overhead_s`) the Q threads' concurrent micro-batches are one call of
Q b/m samples (the accelerator runs one thread's work while another's call is dispatched): X(b Q) =
m o + the Q*m per-sample parts, against m o + m per-sample parts for one batch of b. So a node update costs
m (o / Q + per-sample part), and threads add throughput where the overhead, a small batch's idle
accelerator, dominates (the paper's argument); with o = 0 they add none.
d = max(1, ceil(allreduce(P) / nominal update time)) unless `delay` is set; averaging costs nothing on the
critical path unless the all-reduce takes longer than d updates. LPP partial steps cost `partial_cost` of a
full step (choice, default 1.0: no saving).

Reference: Chatterjee, Kungurtsev, Alistarh, "Local SGD Meets Asynchrony", ICLR 2021 submission (OpenReview).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional, TYPE_CHECKING

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import collectives
from waitless.algorithms import delayed_averaging
from waitless.algorithms import local_sgd
from waitless.algorithms import spec
from waitless.cluster import rules
from waitless.cluster.rules import delayed_average as delayed_rules
from waitless.cluster.rules import synchronous

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


# ---- LPP blocks ----

def block_bounds(total: int, threads: int) -> np.ndarray:
  """int64 (Q + 1,): block j is elements [bounds[j], bounds[j+1]) of the parameters flattened in leaf order."""
  return (np.arange(threads + 1, dtype=np.int64) * total) // threads


def block_masks(tree: Any, thread, threads: int) -> Any:
  """bool tree like `tree`: True on the elements of block `thread` (a traced or Python int in 0..Q-1)."""
  leaves, treedef = jax.tree.flatten(tree)
  sizes = [int(np.prod(np.shape(x), dtype=np.int64)) for x in leaves]
  bounds = jnp.asarray(block_bounds(sum(sizes), threads), jnp.int32)
  lo, hi = bounds[thread], bounds[thread + 1]
  masks, offset = [], 0
  for x, n in zip(leaves, sizes):
    index = offset + jnp.arange(n, dtype=jnp.int32).reshape(np.shape(x))
    masks.append((index >= lo) & (index < hi))
    offset += n
  return jax.tree.unflatten(treedef, masks)


def partial_at(step, threads: int, prepass_steps: Optional[int]):
  """Whether node update `step` is an LPP partial step (ints or traced ints); never without a prepass."""
  if prepass_steps is None:
    return step < 0  # False, of the right type
  return (step >= prepass_steps) & (((step - prepass_steps) // threads) % 2 == 1)


# ---- the math ----

class LapState(NamedTuple):
  count: jax.Array          # int32 (): node updates so far (the same on every worker)
  inner: optax.OptState     # per-thread inner optimizer states, every leaf stacked (Q, ...)
  views: Any                # params stacked (Q, ...): the node model each thread read; () when Q = 1
  snapshot: optax.Params    # like params: the snapshot s whose average is in flight (delayed_averaging buffer)


def _stack(tree: Any, q: int) -> Any:
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (q,) + jnp.shape(x)), tree)


def _index(tree: Any, i) -> Any:
  return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _put(tree: Any, new: Any, i) -> Any:
  return jax.tree.map(lambda x, y: lax.dynamic_update_index_in_dim(x, y.astype(x.dtype), i, 0), tree, new)


def with_schedule_count(state: optax.OptState, count) -> optax.OptState:
  """`state` with the count of every `optax.ScaleByScheduleState` set to `count` (the node counter)."""
  def fix(x):
    if isinstance(x, optax.ScaleByScheduleState):
      return x._replace(count=jnp.asarray(count, jnp.asarray(x.count).dtype))
    return x
  return jax.tree.map(fix, state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))


def thread_params(params: Any, opt_state: LapState, schedule: Any, microbatch: jax.Array) -> Any:
  """The spec's `gradient_params`: the view of the schedule's thread (dynamic index; own params if Q = 1)."""
  del microbatch
  if isinstance(opt_state.views, tuple) and not opt_state.views:
    return params
  return _index(opt_state.views, schedule.thread)


def lap_sgd(inner: optax.GradientTransformation, threads: int, local_steps: int, delay: int = 1,
            pre_post_steps: int = 0, prepass_steps: Optional[int] = None,
            axis_name: collectives.AxisName = None) -> optax.GradientTransformationExtraArgs:
  """Q Hogwild thread views per node, per-thread optimizer state, non-blocking averaging (LPP: partial steps).

  Args:
    inner: the optimizer U; each thread has its own state (momentum), the schedule follows the node counter.
    threads: Q >= 1.
    local_steps: H >= 1, node updates between snapshots (H = 1 while step < pre_post_steps).
    delay: d >= 0, updates between a snapshot and applying its mean; used only without a schedule (a library
      loop; then needs pre_post_steps = 0 and d <= H). The harness's schedule says it instead.
    pre_post_steps: post-local schedule: snapshot after every update before this step.
    prepass_steps: LPP-SGD: partial steps alternate with full ones from this node update on; None: LAP-SGD.
    axis_name: the worker (node) axes; None for one node (averaging is then the identity).

  Returns:
    A transformation whose `update(grads, state, params, *, schedule=None, step=None)` moves the node model.
    `grads` must be taken at `thread_params(...)` (the harness does it through the spec's `gradient_params`).
    `schedule`: a `NodeThreadsSchedule` with uniform `thread`, `partial`, `snapshot`, `apply_average`,
    `average_age` (unbatched: the thread switch is a dynamic index and the average a real conditional when
    workers are vmapped). `step`: the replicated node update number (None: the state's counter).
  """
  inner = optax.with_extra_args_support(inner)
  q = threads

  @spec.owns_its_buffers
  def init_fn(params):
    return LapState(count=jnp.zeros((), jnp.int32), inner=_stack(inner.init(params), q),
                    views=_stack(params, q) if q > 1 else (), snapshot=delayed_averaging.init(params))

  def update_fn(grads, state, params=None, *, schedule=None, step: Optional[jax.Array] = None, **extra):
    del extra
    if params is None:
      raise ValueError('lap_sgd needs params: it averages models, not gradients.')
    t = state.count if step is None else step
    if schedule is None:
      if pre_post_steps or delay > local_steps:
        raise ValueError('without a schedule lap_sgd needs pre_post_steps = 0 and delay <= local_steps')
      thread, partial = t % q, partial_at(t, q, prepass_steps)
      events = delayed_averaging.schedule_at(t, local_steps, delay)
    else:
      thread, partial = schedule.thread, schedule.partial
      events = delayed_averaging.events(schedule)
    own = with_schedule_count(_index(state.inner, thread), t)
    updates, new_own = inner.update(grads, own, params)
    if prepass_steps is not None:  # LPP: a partial step changes block j only, params and thread state
      mask = jax.tree.map(lambda m: m | ~partial, block_masks(params, thread, q))
      updates = jax.tree.map(lambda m, u: jnp.where(m, u, jnp.zeros_like(u)), mask, updates)
      state_mask = optax.tree_utils.tree_map_params(
          inner, lambda _, m: m, new_own, mask, transform_non_params=lambda _: jnp.ones((), bool))
      new_own = jax.tree.map(lambda m, new, old: jnp.where(m, new, old), state_mask, new_own, own)
    stepped = optax.apply_updates(params, updates)
    averaged, snapshot = delayed_averaging.step(stepped, state.snapshot, *events, axis_name=axis_name)
    updates = jax.tree.map(lambda new, old: new - old, averaged, params)
    views = state.views
    if q > 1:  # the thread reads the node model as the harness will hold it
      views = _put(views, optax.apply_updates(params, updates), thread)
    return updates, LapState(count=optax.safe_increment(state.count), inner=_put(state.inner, new_own, thread),
                             views=views, snapshot=snapshot)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ---- the time rule ----

class NodeThreadsSchedule(NamedTuple):
  """Schedule of LAP-SGD / LPP-SGD: the delayed-average events plus the thread and kind of this update."""
  microbatches_done: np.ndarray  # int32 (P,), = m: the micro-batches of the one thread batch applied
  snapshot: np.ndarray           # bool (), snapshot after this update and start the all-reduce
  apply_average: np.ndarray      # bool (), apply the mean of the snapshot in flight
  average_age: np.ndarray        # int32 (), updates between the snapshot applied and this one
  thread: np.ndarray             # int32 (), the thread whose gradient this update applies: t mod Q
  partial: np.ndarray            # bool (), LPP partial step (only the thread's block changes)
  UNIFORM = ('snapshot', 'apply_average', 'average_age', 'thread', 'partial')


@dataclasses.dataclass(frozen=True)
class NodeThreads(rules.TimeRule):
  """LAP-SGD / LPP-SGD (`lap_sgd`, `lpp_sgd`): Q threads per node, non-blocking averaging every H updates.

  One worker = one node; one iteration = one node-level update on every node. Q threads share the node's
  accelerator (choice): the Q updates k Q .. k Q + Q - 1 together consume Q*m micro-batches, whose times the
  clock draws once, at update k Q: X_i(b Q); each of them costs X_i(b Q) / Q (times `partial_cost` for an
  LPP partial step). Compute time thus follows the data consumed: the same data costs the same time for
  every Q, but for the per-call overhead o, paid once per call of the Q threads' concurrent micro-batches
  (`Clock.work(..., per_call=Q)`): X_i(b Q) = m o + the Q*m per-sample parts (times worker i's factor).
  Threads take turns in round-robin order: update t applies thread t mod Q's gradient, computed on the node
  model of update t - Q + 1, staleness min(t, Q - 1) updates (reported as `staleness` and in
  `thread_staleness`).
  Averaging: after update t with `averages_at(t)` the node snapshots and the all-reduce starts; the mean is
  applied d updates later (`cluster.rules.delayed_average`): d = `delay_steps`, or when None
  max(1, ceil(allreduce(P) / nominal update time)), the nominal update being m x the mean micro-batch time
  with Q micro-batches per call, m (o / Q + mean per-sample part) (`Clock.mean_unit_seconds`; fixed for
  the run, computed once). d >= 1 even on the ideal network: d = 0 would make the average a
  barrier, so a faster network would make LAP-SGD slower; `delay_steps=0` asks for it (Q = 1: local SGD's
  `PeriodicAverage`). The node waits at the apply step only for what the d updates did not hide.
  Reference: Chatterjee, Kungurtsev, Alistarh, "Local SGD Meets Asynchrony".

  Schedule: `NodeThreadsSchedule`. Reports `thread_staleness` (mean over a window).
  """
  threads: int                       # Q
  averages_at: Callable[[int], bool]
  microbatches: int = 1
  delay_steps: Optional[int] = None  # d; None: from the network model
  prepass_steps: Optional[int] = None  # LPP: partial steps from here on (see `partial_at`); None: LAP
  partial_cost: float = 1.0          # LPP: a partial step's share of a full step's compute (choice)

  schedule_type = NodeThreadsSchedule
  reports = {'thread_staleness': 'mean'}
  vectorized = True

  def __post_init__(self):
    rules.check_positive_int(self.threads, 'threads')
    rules.check_positive_int(self.microbatches, 'microbatches')
    if self.delay_steps is not None:
      rules.check_positive_int(self.delay_steps, 'delay_steps', minimum=0)
    if self.prepass_steps is not None:
      rules.check_positive_int(self.prepass_steps, 'prepass_steps', minimum=0)
    c = self.partial_cost
    if not isinstance(c, (int, float, np.integer, np.floating)) or isinstance(c, bool) or not 0 < c <= 1:
      raise ValueError(f'partial_cost={c!r} must be in (0, 1]')

  def delay(self, clock: 'Clock') -> int:
    """d: updates between a snapshot and applying its mean."""
    if self.delay_steps is not None:
      return self.delay_steps
    if 'delay_steps' not in clock.rule_state:
      allreduce = clock.network.allreduce(clock.model_bytes, clock.workers)
      update = self.microbatches * clock.mean_unit_seconds(self.threads)
      ratio = allreduce / update if 0 < update < math.inf else 0.0
      clock.rule_state['delay_steps'] = max(1, int(math.ceil(ratio - 1e-9)))
    return int(clock.rule_state['delay_steps'])

  def iterate(self, clock: 'Clock', iteration: int) -> rules.Iteration:
    p, q = clock.workers, self.threads
    delay = self.delay(clock)
    state = clock.rule_state
    if iteration % q == 0 or 'thread_batch_s' not in state:  # the Q threads' batches: one draw of Q*m
      state['thread_batch_s'] = (clock.work(np.arange(p), clock.times, q * self.microbatches, per_call=q)
                                 - clock.times)
    partial = bool(partial_at(iteration, q, self.prepass_steps))
    cost = np.asarray(state['thread_batch_s'], np.float64) / q * (self.partial_cost if partial else 1.0)
    finished = clock.times + cost
    idle, uniform, communicated = delayed_rules.delayed_average_step(
        clock, iteration, finished, bool(self.averages_at(iteration)), delay)
    stale = float(min(iteration, q - 1))
    schedule = NodeThreadsSchedule(microbatches_done=rules.full(p, self.microbatches, np.int32),
                                   thread=np.int32(iteration % q), partial=np.bool_(partial), **uniform)
    return rules.Iteration(schedule=schedule, idle=idle, bytes_communicated=communicated,
                           staleness=np.full(p, stale), measurements={'thread_staleness': stale})

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> Optional[rules.Steps]:
    """n calls of `iterate`: the block's draws of Q*m micro-batches taken at once, each worker's times a
    running sum of its update costs between draws and averaging events (`delayed_average_block`). A draw's
    cost is computed as `iterate` computes it, from the times when it is drawn. Failures: None."""
    if clock.failure is not None:
      return None
    p, q = clock.workers, self.threads
    delay = self.delay(clock)
    state = clock.rule_state
    steps = iteration + np.arange(n)
    draws = np.flatnonzero(steps % q == 0).tolist()
    if 'thread_batch_s' not in state and draws[:1] != [0]:
      draws.insert(0, 0)
    seconds = synchronous.job_seconds(clock, len(draws), q * self.microbatches, per_call=q) if draws else None
    partial = np.asarray(partial_at(steps, q, self.prepass_steps), bool)
    scaled = partial if self.partial_cost != 1.0 else np.zeros(n, bool)  # x * 1.0 == x: skip it
    draws.append(n)
    cursor = [0, None if 0 in draws else np.asarray(state['thread_batch_s'], np.float64)]  # next draw, batch

    def chain(times, begin, end, start):
      a = begin
      while a < end:
        k = cursor[0]
        if draws[k] == a:  # the Q threads' batches: X(b Q) per worker, as `iterate` measures it from `start`
          cursor[1] = (start + seconds[k]) - start
          cursor[0] = k = k + 1
        b = min(draws[k], end)
        cost = cursor[1] / q
        rows = times[a:b]
        rows[:] = cost
        if scaled[a:b].any():
          rows[scaled[a:b]] = cost * self.partial_cost
        rows[0] += start
        if b - a > 1:
          np.add.accumulate(rows, axis=0, out=rows)
        start, a = rows[-1], b

    times = np.empty((n, p))
    snapshot = np.fromiter((self.averages_at(t) for t in steps.tolist()), bool, n)
    idle, uniform, communicated = delayed_rules.delayed_average_block(
        clock, iteration, times, snapshot, delay, chain)
    if len(draws) > 1:
      state['thread_batch_s'] = cursor[1]
    stale = np.minimum(steps, q - 1).astype(np.float64)
    schedule = NodeThreadsSchedule(
        microbatches_done=np.full((n, p), self.microbatches, np.int32), thread=(steps % q).astype(np.int32),
        partial=partial, **uniform)
    return rules.Steps(schedule=schedule, idle=idle, bytes_communicated=communicated, mean_staleness=stale,
                       end_time=times.max(axis=1), times=times, measurements={'thread_staleness': stale})


# ---- config glue ----

def _lpp(config) -> bool:
  return config.algorithm.name == 'lpp_sgd'


def time_rule(config):
  a = config.algorithm
  lpp = _lpp(config)
  return NodeThreads(
      threads=a.threads, averages_at=lambda t: bool(local_sgd.averages_at(t, a.local_steps, a.pre_post_steps)),
      microbatches=config.microbatches, delay_steps=a.delay,
      prepass_steps=a.prepass_steps if lpp else None, partial_cost=float(a.partial_cost) if lpp else 1.0)


def validate(config):
  a = config.algorithm
  errors.require_int(a.threads, 'algorithm.threads', 1)
  errors.require_int(a.local_steps, 'algorithm.local_steps', 1)
  errors.require_int(a.pre_post_steps, 'algorithm.pre_post_steps', 0)
  d = a.delay
  errors.require(d is None or (isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= a.local_steps),
                 'algorithm.delay', d, f'must be an integer in 0..local_steps={a.local_steps} (one average in '
                 'flight), or None: max(1, ceil(allreduce / update)) from the network model')
  if _lpp(config):
    errors.require_int(a.prepass_steps, 'algorithm.prepass_steps', 0)
    c = a.partial_cost
    errors.require(isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c <= 1,
                   'algorithm.partial_cost', c, 'must be in (0, 1] (share of a full step\'s compute)')


def _build(config, inner, axis_name):
  a = config.algorithm
  return lap_sgd(inner, threads=a.threads, local_steps=a.local_steps, delay=1 if a.delay is None else a.delay,
                 pre_post_steps=a.pre_post_steps, prepass_steps=a.prepass_steps if _lpp(config) else None,
                 axis_name=axis_name)


_LAP_DEFAULTS = {
    'threads': 4,          # Q: Hogwild threads per node (the authors: 4)
    'local_steps': 16,     # H: node updates between averages (the authors: 16)
    'pre_post_steps': 0,   # post-local schedule: average after every update before this step
    'delay': None,         # d: updates until the mean is applied; None: max(1, ceil(allreduce / update))
}

SPEC = spec.AlgorithmSpec(
    name='lap_sgd', defaults=_LAP_DEFAULTS, build=_build, time_rule=time_rule, validate=validate,
    gradient_params=thread_params)

LPP = spec.AlgorithmSpec(
    name='lpp_sgd',
    defaults={**_LAP_DEFAULTS,
              'prepass_steps': 0,    # partial steps alternate with full ones from this node update on
              'partial_cost': 1.0},  # a partial step's share of a full step's compute (choice: no saving)
    build=_build, time_rule=time_rule, validate=validate, gradient_params=thread_params)
