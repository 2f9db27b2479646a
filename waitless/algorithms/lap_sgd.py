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

Time (`NodeThreads`, `cluster/rules/lap_sgd.py`): Q threads share the node's accelerator (choice): Q node updates
together cost X(b Q), one batch Q times larger, spread evenly (X(b Q) / Q each). The clock draws the Q*m micro-batch
times once per Q node updates, so the compute time follows the data actually consumed (m micro-batches per update).
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

from typing import Any, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import collectives
from waitless.algorithms import delayed_averaging
from waitless.algorithms import spec


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
  """State of `lap_sgd` on one worker.

  Attributes:
    count: int32 (): node updates so far (the same on every worker).
    inner: per-thread inner optimizer states, every leaf stacked (Q, ...).
    views: params stacked (Q, ...): the node model each thread read; () when Q = 1.
    snapshot: like params: the snapshot s whose average is in flight (delayed_averaging buffer).
  """
  count: jax.Array
  inner: optax.OptState
  views: Any
  snapshot: optax.Params


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


# ---- config glue ----

def _lpp(config) -> bool:
  return config.algorithm.name == 'lpp_sgd'


def validate(config):
  a = config.algorithm
  errors.require_int(a.threads, 'algorithm.threads', 1)
  errors.require_int(a.local_steps, 'algorithm.local_steps', 1)
  errors.require_int(a.pre_post_steps, 'algorithm.pre_post_steps', 0)
  d = a.delay
  errors.require(d is None or (errors.is_int(d) and 0 <= d <= a.local_steps),
                 'algorithm.delay', d, f'must be an integer in 0..local_steps={a.local_steps} (one average in '
                 'flight), or None: max(1, ceil(allreduce / update)) from the network model')
  if _lpp(config):
    errors.require_int(a.prepass_steps, 'algorithm.prepass_steps', 0)
    c = a.partial_cost
    errors.require(errors.is_number(c) and 0 < c <= 1,
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
    name='lap_sgd', defaults=_LAP_DEFAULTS, build=_build, validate=validate,
    gradient_params=thread_params)

LPP = spec.AlgorithmSpec(
    name='lpp_sgd',
    defaults={**_LAP_DEFAULTS,
              'prepass_steps': 0,    # partial steps alternate with full ones from this node update on
              'partial_cost': 1.0},  # a partial step's share of a full step's compute (choice: no saving)
    build=_build, validate=validate, gradient_params=thread_params)
