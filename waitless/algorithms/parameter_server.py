"""Emulated parameter server: K-sync, K-batch-sync, K-async, K-batch-async, async SGD and AdaSync.

Every worker holds an identical copy of the server model W (in its algorithm state), changed only by the
same all-reduced update; its `params` are its learner's VIEW, the model its gradients are computed on (stale
for the asynchronous variants). One iteration is one server update t (W_t -> W_{t+1}). With n_i = the
micro-batches learner i contributed (`microbatches_done`: m per pushed mini-batch gradient, 0 if it pushed
nothing) and g_i the mean gradient of those micro-batches:

    g       = (sum_i lambda_i n_i g_i) / (sum_i n_i)      (= 1/K sum of the K pushed mini-batch gradients)
    W_{t+1} = W_t + U(g)                                  (U: the inner optimizer; its state is the server's)
    view_i  <- W_{t+1}  if learner i fetches after the update (`refresh_view`; every learner for the sync rules)
               W_t      if it fetched before it (`fetch_current`, K-batch-async)
               view_i   otherwise (it is still computing on its stale view)

Fresh views (K-sync, K-batch-sync, and AdaSync over them, whose rules declare `fresh_views`): every learner
fetches W_{t+1} after every update, so each view IS the server model. The state then keeps no copy of W
(`server` is None) and U(g) is applied to the view itself: the cost of synchronous SGD, and views that equal
W exactly (W + (W_new - W) would round).

lambda_i = 1 unless the staleness-adaptive learning rate is on (C = `adaptive_lr_c` > 0): then
lambda_i = min(C / ||W_t - view_i||^2, eta_max) / eta, so that with plain SGD of learning rate eta the
gradient of learner i is applied with eta_j = min(C / ||W_j - W_tau(j)||^2, eta_max) (Dutta et al. 2018).

Which learners push how many gradients, and who fetches, comes from the variant's time rule (`cluster/rules/NAME.py`):
the math is the same for every variant; the variants differ only in their schedules. The data contract of the
harness does the rest: a learner's data position advances only by what it pushed, and cancelled work (K-sync,
K-batch-sync) consumes no samples.

What is computed. The real cluster takes one gradient per job, when the job starts, on the learner's view and
the job's micro-batches, and pushes it when it finishes. The emulator takes it when the job is pushed, on the
same view and micro-batches (a learner's view changes only at its own pushes and fetches, its data position
only by what it pushed, so both are still the job's): the step computes a gradient only for the learners that
push in the iteration (`microbatches_done` > 0; `experiments.harness.block_program.make_block_step` skips the
others), one per pushed job, as the cluster does. The cluster also computes work it throws away, which the
emulator does not: the jobs K-sync and K-batch-sync cancel, and Ringmaster's discarded gradients.

A K-batch learner can push several mini-batch gradients in one update: its first is computed on its view, the
later ones on W_t (it fetched W_t after its first push). Ringmaster (`max_delay` on `async` / `kbatch_async`):
a learner whose gradient was discarded (`discarded`) fetched W_t first, so all of its gradients in that update
are computed on W_t, and without a push its view becomes W_t; the discarded gradient is never applied and its
micro-batches are not consumed (`microbatches_done` counts pushed gradients only). The spec's
`gradient_params` hook tells the step where to differentiate each micro-batch (`gradient_params` below):
micro-batches of the first job at the view, later ones at the server copy W_t.

Every variant shares the schedule `ServerSchedule` and this module's math; each variant's module
(`ksync`, `kbatch_sync`, `kasync`, `kbatch_async` with `async`, `adasync`) holds its spec; its time rule is
`cluster/rules/NAME.py`, beside the family's shared rule code (`cluster/rules/parameter_server.py`).

Reference: Dutta, Joshi, Ghosh, Dube, Nagpurkar, "Slow and Stale Gradients Can Win the Race: Error-Runtime
Trade-offs in Distributed SGD", AISTATS 2018; AdaSync: the journal version, arXiv 2003.10579.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import collectives
from waitless.algorithms import spec


class ServerSchedule(NamedTuple):
  """Schedule of one server update t (W_t -> W_{t+1}), shared by every parameter-server rule."""
  microbatches_done: np.ndarray  # int32 (P,), c_i * m: the samples learner i's pushed gradients consumed
  contributions: np.ndarray      # int32 (P,), c_i: mini-batch gradients learner i pushed in this update (0..K;
  #                                at most 1 for K-sync / K-async); sum_i c_i = K. Its first was computed at its
  #                                view, its later ones (K-batch rules) at W_t, fetched in between.
  staleness: np.ndarray          # int32 (P,), server versions between learner i's view and W_t for its first
  #                                gradient in this update (0 if c_i = 0, and for the synchronous rules)
  refresh_view: np.ndarray       # bool (P,), afterwards learner i's view is the new W_{t+1}
  fetch_current: np.ndarray      # bool (P,), afterwards learner i's view is W_t, the model before this update
  #                                (K-batch-async: its last push was not the K-th). Neither flag: view unchanged.
  k: np.ndarray                  # int32 (), the K of this update (W - eta/K * sum of the K gradients)
  discarded: np.ndarray          # bool (P,), learner i's in-flight gradient was discarded (its delay reached
  #                                `max_delay`, Ringmaster) and it fetched W_t: any gradient it pushes in this
  #                                update was computed at W_t; with no push, its view becomes W_t (fetch_current)
  microbatches_total: np.ndarray  # int32 (), sum_i microbatches_done = K m: the divisor, summed on the host
  #                                (`collectives.worker_sum_and_count`)
  UNIFORM = ('k', 'microbatches_total')


class ParameterServerState(NamedTuple):
  """A learner's copy of the server: the model W_t and the optimizer state on it.

  Attributes:
    server: the emulated server model W_t: same tree as params, identical on every worker; None with fresh views
      (the view is W_t).
    inner: the server's inner optimizer state (on W), identical on every worker.
  """
  server: Any
  inner: optax.OptState


def gradient_params(params, opt_state: ParameterServerState, schedule: ServerSchedule, microbatch):
  """Where the step differentiates micro-batch `microbatch` (0-based) of a K-batch learner's batch.

  The first job (mini-batch of m micro-batches) of an update is computed on the learner's view `params`;
  its later jobs in the same update on the server model W_t, which it fetched after its first push.
  """
  if opt_state.server is None:  # fresh views: the view is W_t
    return params
  jobs = jnp.maximum(schedule.contributions, 1)
  later = microbatch * jobs >= schedule.microbatches_done  # microbatch >= m = done / contributions
  later = later | schedule.discarded  # restarted on W_t after a discarded gradient (Ringmaster)
  return jax.tree.map(lambda view, w: jnp.where(later, w, view), params, opt_state.server)


def _sq_distance(a, b) -> jax.Array:
  def sq(x, y):
    wide = jnp.promote_types(x.dtype, jnp.float32)  # bfloat16 params: sum the squares in float32
    return jnp.sum(jnp.square(x.astype(wide) - y.astype(wide)))
  leaves = jax.tree.leaves(jax.tree.map(sq, a, b))
  return sum(leaves) if leaves else jnp.zeros(())


def staleness_factor(server, view, c: float, eta_max: float, learning_rate: float) -> jax.Array:
  """lambda = min(C / ||W - view||^2, eta_max) / eta: eta_max / eta for a fresh view (distance 0)."""
  d2 = _sq_distance(server, view)
  eta_j = jnp.minimum(jnp.where(d2 > 0, c / jnp.where(d2 > 0, d2, 1), jnp.inf), eta_max)
  return eta_j / learning_rate


def server_step(inner: optax.GradientTransformation, total, count, inner_state, model):
  """The server's step on its one model W from the update's gradient total: U((sum_i lambda_i n_i g_i) / count).

  What every form of the server runs: the emulator's per-worker update (after its all-reduce, `total` the worker
  sum) and the Ray runtime's server (`total` summed over the pushes it took, on its one copy of W). Returns
  (updates to W, the inner optimizer's new state).
  """
  g = jax.tree.map(lambda s: s / jnp.maximum(count, 1).astype(s.dtype), total)
  return inner.update(g, inner_state, model)


def parameter_server(inner: optax.GradientTransformation, axis_name: collectives.AxisName = None,
                     adaptive_lr_c: float = 0.0, eta_max: float = 0.0, learning_rate: float = 1.0,
                     gradient_sums: bool = False,
                     fresh_views: bool = False) -> optax.GradientTransformationExtraArgs:
  """One update of an emulated parameter server from the learners the schedule says pushed.

  Update rule (per worker, identical server update on every worker):
    g = sum_i lambda_i n_i g_i / sum_i n_i;   W <- W + U(g);   view_i <- W_new | W_old | view_i (schedule flags)
  with n_i = schedule['microbatches_done'] and lambda_i = 1, or the staleness-adaptive factor when
  `adaptive_lr_c` > 0.

  Args:
    inner: the server's optimizer U (e.g. `optax.sgd(0.01)`), applied to the server copy W.
    axis_name: the worker axes to all-reduce over; None for one worker (no collective).
    adaptive_lr_c: C of eta_j = min(C / ||W_j - W_tau(j)||^2, eta_max); 0 disables (lambda_i = 1).
    eta_max: the cap of eta_j (> 0 when adaptive_lr_c > 0).
    learning_rate: eta of U; lambda_i = eta_j / eta, so that plain SGD applies each gradient with eta_j.
    gradient_sums: `grads` is n_i g_i, the sum over the learner's micro-batches (the harness's step, spec
      `gradient_sums`), not the mean g_i.
    fresh_views: every learner fetches the new model after every update (the schedule's `refresh_view` is
      all true and `fetch_current` all false; not read): no server copy is kept, `params` is W.

  Returns:
    A transformation whose `update(grads, state, params, schedule=...)` takes this learner's gradient (mean
    over its finished micro-batches) and its view `params`, and returns updates that move the view to its
    new value. `schedule` is a `ServerSchedule` (fields read: `microbatches_done`, `microbatches_total`,
    `refresh_view`, `fetch_current`, `discarded`); without one every learner pushes one gradient and fetches
    the new W (synchronous SGD through a server).

  Example:
    >>> tx = parameter_server(optax.sgd(0.01), axis_name='workers')  # inside shard_map over 'workers'
    >>> updates, state = tx.update(grads, state, view, schedule=schedule)
    >>> server_model = state.server

  Reference: Dutta et al., "Slow and Stale Gradients Can Win the Race", AISTATS 2018 (the variants, the
  staleness-adaptive rate); AdaSync (K changed by the time rule): arXiv 2003.10579.
  """
  inner = optax.with_extra_args_support(inner)
  adaptive = adaptive_lr_c > 0
  if adaptive and spec.is_static_number(eta_max) and not eta_max > 0:
    raise ValueError(f'eta_max={eta_max!r} must be > 0 with the staleness-adaptive learning rate')
  if adaptive and fresh_views:
    raise ValueError('the staleness-adaptive learning rate needs stale views, not fresh_views')

  @spec.owns_its_buffers
  def init_fn(params):
    if fresh_views:
      return ParameterServerState(server=None, inner=inner.init(params))
    return ParameterServerState(server=params, inner=inner.init(params))  # copied by owns_its_buffers

  def update_fn(grads, state, params=None, *, schedule: Optional[ServerSchedule] = None, **extra):
    del extra
    if params is None:
      raise ValueError('parameter_server needs params: they are the learner\'s view of the server model.')
    server = state.server
    leaves = jax.tree.leaves(grads)
    dtype = jnp.asarray(leaves[0]).dtype if leaves else jnp.float32  # canonical (float32 unless x64)
    done = (jnp.ones((), dtype) if schedule is None else schedule.microbatches_done.astype(dtype))
    weight = None if gradient_sums else done
    if adaptive:
      view = params  # where the learner's first gradient was computed: W_t after a discard (Ringmaster)
      if schedule is not None:
        view = jax.tree.map(lambda w, v: jnp.where(schedule.discarded, w, v), server, params)
      factor = staleness_factor(server, view, adaptive_lr_c, eta_max, learning_rate).astype(dtype)
      weight = factor if weight is None else weight * factor
    weighted = grads if weight is None else jax.tree.map(lambda g: weight * g, grads)  # n_i g_i (x lambda_i)
    total, count = collectives.worker_sum_and_count(
        weighted, done, axis_name, host_total=None if schedule is None else schedule.microbatches_total)
    if fresh_views:  # the view is W: W + U(g) is the new view
      updates, inner_state = server_step(inner, total, count, state.inner, params)
      return updates, ParameterServerState(server=None, inner=inner_state)
    updates, inner_state = server_step(inner, total, count, state.inner, server)
    new_server = optax.apply_updates(server, updates)

    refresh = True if schedule is None else schedule.refresh_view
    fetch_current = False if schedule is None else schedule.fetch_current
    new_view = jax.tree.map(lambda new, old, view: jnp.where(refresh, new, jnp.where(fetch_current, old, view)),
                            new_server, server, params)
    view_updates = jax.tree.map(lambda new, view: new - view, new_view, params)
    return view_updates, ParameterServerState(server=new_server, inner=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def server_model(params, opt_state):
  """Consensus = the server copy, or with fresh views the views (identical on every worker; worker 0's, so no
  rounding from a mean)."""
  return jax.tree.map(lambda x: x[0], params if opt_state.server is None else opt_state.server)



def schedule(p: int, k: int, m: int, contributions: np.ndarray, staleness=None, refresh_view=None,
             fetch_current=None, discarded=None) -> ServerSchedule:
  """A ServerSchedule (one update, or n stacked when `k` is an (n,) array); defaults: no staleness, nothing
  discarded, every learner fetches the new model (the synchronous rules)."""
  contributions = np.asarray(contributions, np.int32)
  shape = contributions.shape
  done = contributions * np.int32(m)
  return ServerSchedule(
      microbatches_done=done, contributions=contributions, microbatches_total=done.sum(axis=-1, dtype=np.int32),
      staleness=np.zeros(shape, np.int32) if staleness is None else np.asarray(staleness, np.int32),
      refresh_view=np.ones(shape, bool) if refresh_view is None else np.asarray(refresh_view, bool),
      fetch_current=np.zeros(shape, bool) if fetch_current is None else np.asarray(fetch_current, bool),
      k=np.asarray(k, np.int32), discarded=np.zeros(shape, bool) if discarded is None else np.asarray(discarded, bool))


# ---- config -> transformation, validation, spec ----

ADAPTIVE_LR_DEFAULTS = {'adaptive_lr_c': 0.0, 'eta_max': 0.0}  # staleness-adaptive LR off
# The harness hands the learners' gradient sums n_i g_i (the spec's `gradient_sums`), and `build` takes them.
GRADIENT_SUMS = True


def adaptive_lr(config: ml_collections.ConfigDict) -> tuple[float, Any, Any]:
  """(C, eta_max, eta) of the staleness-adaptive learning rate (C = 0: off); eta_max unset is eta."""
  a = config.algorithm
  lr = config.optimizer.learning_rate  # may be a traced replica hyper-parameter (`spec`)
  return float(a.get('adaptive_lr_c', 0.0)), float(a.get('eta_max', 0.0)) or lr, lr


def build(config: ml_collections.ConfigDict, inner, axis_name, fresh_views: bool = False):
  c, eta_max, lr = adaptive_lr(config)
  return parameter_server(inner, axis_name=axis_name, adaptive_lr_c=c, eta_max=eta_max, learning_rate=lr,
                          gradient_sums=GRADIENT_SUMS, fresh_views=fresh_views)


def require_k(value, field: str, workers: int) -> None:
  ok = errors.is_int(value) and 1 <= value <= workers
  errors.require(ok, field, value, f'must be an integer in 1..{workers} (workers)')


def validate_adaptive_lr(a) -> None:
  errors.require_number(a.adaptive_lr_c, 'algorithm.adaptive_lr_c',
                        'must be a number >= 0 (0 disables the staleness-adaptive learning rate)', lambda v: v >= 0)
  errors.require_number(a.eta_max, 'algorithm.eta_max', 'must be a number >= 0 (0: the optimizer\'s learning_rate)',
                        lambda v: v >= 0)


def validate_k(config) -> None:
  require_k(config.algorithm.k, 'algorithm.k', config.workers)


def one_job(config) -> int:
  return config.microbatches


def k_jobs(config) -> int:
  return config.algorithm.k * config.microbatches  # a fast learner may push all K mini-batches


def never_fresh(config) -> bool:
  del config
  return False


def always_fresh(config) -> bool:
  del config
  return True


def make_spec(name, defaults, validate, microbatches_per_iteration, several_jobs: bool,
              fresh_views=never_fresh) -> spec.AlgorithmSpec:
  """A parameter-server variant's spec; `several_jobs`: a learner may push several mini-batches per update.

  `fresh_views(config)`: every learner fetches the new model after every update (the synchronous variants,
  whose time rules declare `fresh_views`): the transformation then keeps no server copy.
  """
  def build_variant(config, inner, axis_name):
    return build(config, inner, axis_name, fresh_views=fresh_views(config))

  return spec.AlgorithmSpec(
      name=name, defaults=defaults, build=build_variant, validate=validate, consensus=server_model,
      microbatches_per_iteration=microbatches_per_iteration,
      gradient_params=gradient_params if several_jobs else spec.at_own_params, gradient_sums=GRADIENT_SUMS)
