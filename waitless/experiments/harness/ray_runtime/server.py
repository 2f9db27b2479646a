"""The parameter server of the Ray runtime: the model, the real arrivals, and the algorithm's own update.

`ServerCore` holds the model, not P models: W_t, the inner optimizer's state on it, and each learner's latest
batch statistics (models with batch norm; nothing otherwise). A learner's view lives on the learner: every reply
is the server's current W with its version, and by the schedule's rules that is the learner's view from then on
(`refresh_view`: W_{t+1}; `fetch_current` or a discarded push: W_t); the server only counts versions
(`arrivals.Arrivals.view_version`), and the event log records them, which is all the float64 replay needs.

An update is the family's own server step (`algorithms.parameter_server.server_step`, the function the
emulator's per-worker update calls after its all-reduce) on the one copy of W, fed the sum of the gradients the
update took: (sum over taken pushes of lambda_i G_i) / (K m). The sum grows push by push on the host, so the
jitted update costs one optimizer step whatever P is. lambda_i is 1, or with the staleness-adaptive learning
rate (`adaptive_lr_c` > 0) `parameter_server.staleness_factor(W_t, view_i)`, the emulator's own function, taken
at learner i's first push of the update (its later ones in the same update, K-batch, reuse it, as the emulator
applies one factor per learner and update). Only then does the server keep the models of the versions some
learner's view still is (at most min(P, distinct versions in flight) copies; none without the adaptive rate).
K-batch learners compute their later gradients of an update at the W_t they fetched: on the learner, so the
spec's `gradient_params` hook (the emulator's) has nothing to do here.

`ServerActor` is the Ray actor around it (threaded: a push that must wait for its update, K-sync's and K-async's,
waits for it while the other pushes are served). Updates run one at a time, under the actor's lock.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from waitless.algorithms import optimizers
from waitless.algorithms import parameter_server as ps
from waitless.cluster.rules import adasync as adasync_rule
from waitless.experiments.harness import setup
from waitless.experiments.harness import step as step_lib
from waitless.experiments.harness.ray_runtime import arrivals as arrivals_lib
from waitless.experiments.harness.ray_runtime import pieces


class Reply(NamedTuple):
  """What a learner gets back from a fetch or a push."""
  params: Any        # the server's current model W (host arrays): the learner's view from now on
  version: int       # its version t
  position: int      # the learner's data position (micro-batches) for its next job
  stop: bool         # the run has all its updates: the learner stops


class Pushed(NamedTuple):
  """One job as a learner pushes it: one argument of the Ray call (each argument of a call is serialised on its
  own; docs/results/real_hardware.md measures what seven cost against one)."""
  learner: int
  version: int             # the server version of the model the gradient was computed at
  position: int            # the data position the job read
  grad_sum: Any            # the gradient summed over the job's micro-batches (host arrays)
  loss_sum: float
  model_state: Any = None  # the batch statistics after the job (empty without batch norm)
  l2_grad: Optional[float] = None


class UpdateRecord(NamedTuple):
  """One applied update, for the metrics, the event log and the replay."""
  step: int                 # updates applied so far, this one included
  update: arrivals_lib.Update
  pushes: list              # the `arrivals.Push`es that arrived during it (taken and discarded)
  train_loss: float         # mean over its taken gradients of their mean micro-batch loss
  l2_grads: float


def initial_state(run) -> step_lib.TrainState:
  """The server's state at step 0 on the host: W_0 (`params`, one copy), the inner optimizer's state on it
  (`opt_state`), and every learner's batch statistics (`model_state`, (P, ...); empty without batch norm)."""
  params, model_state = jax.device_get(setup.init_model(run))
  inner = optimizers.make_optimizer(run.config.optimizer, run.config.num_steps)
  rows = jax.tree.map(lambda x: np.repeat(np.asarray(x)[None], run.config.workers, axis=0), model_state)
  return step_lib.TrainState(params=params, opt_state=jax.device_get(inner.init(params)), model_state=rows)


class ServerCore:
  """The server's state and its update (no Ray): what `ServerActor` serves, and what the tests drive directly."""

  def __init__(self, config, state: Optional[step_lib.TrainState] = None):
    self.run = run = pieces.build(config)
    self.config = config = run.config
    inner = optimizers.make_optimizer(config.optimizer, config.num_steps)
    self._c, self._eta_max, self._lr = ps.adaptive_lr(config)
    state = initial_state(run) if state is None else jax.device_get(state)
    self.params = jax.device_put(state.params)
    self.inner = jax.device_put(state.opt_state)
    self.model_state = jax.tree.map(np.array, state.model_state)  # (P, ...) host rows, written by pushes

    def step(params, inner_state, total, count):
      updates, inner_state = ps.server_step(inner, total, count, inner_state, params)
      return optax.apply_updates(params, updates), inner_state

    self._step = jax.jit(step, donate_argnums=1)
    self._factor = jax.jit(lambda w, view: ps.staleness_factor(w, view, self._c, self._eta_max, self._lr))
    self._norm = jax.jit(step_lib.tree_l2)
    self.current = jax.device_get(self.params)
    self.versions: dict[int, Any] = {}  # version -> W of that version, for the adaptive rate only
    self._begin()
    self._compile()

  @property
  def adaptive(self) -> bool:
    return self._c > 0

  def _compile(self) -> None:
    """Compiles the update before the clock starts (on copies: the result is thrown away)."""
    zeros = jax.tree.map(np.zeros_like, self.current)
    copy = jax.tree.map(jnp.copy, self.inner)
    jax.block_until_ready(self._step(self.params, copy, zeros, np.float32(1)))
    if self.adaptive:
      jax.block_until_ready(self._factor(self.params, self.current))

  def _begin(self) -> None:
    """Empties the update's sums."""
    self._total = None
    self._factors: dict[int, float] = {}
    self._losses: list[float] = []
    self._norms: list[float] = []

  def add(self, learner: int, version: int, grad_sum, loss_sum: float, model_state=None,
          l2_grad: Optional[float] = None) -> None:
    """A taken gradient computed at `version`: its sum over the job's micro-batches, times lambda (the
    staleness-adaptive factor of the learner's first push in this update), joins the update's total."""
    if self.adaptive:
      if learner not in self._factors:
        self._factors[learner] = float(self._factor(self.params, self.versions[version]))
      factor = self._factors[learner]
      grad_sum = jax.tree.map(lambda g: np.asarray(g) * np.asarray(factor, np.asarray(g).dtype), grad_sum)
    if self._total is None:
      self._total = grad_sum  # not written in place: a pushed array may be read-only (Ray's object store)
    else:
      self._total = jax.tree.map(np.add, self._total, grad_sum)
    self._losses.append(float(loss_sum) / self.config.microbatches)
    if l2_grad is None:
      l2_grad = float(self._norm(grad_sum)) / self.config.microbatches
    self._norms.append(l2_grad)
    if model_state is not None and jax.tree.leaves(model_state):
      for row, value in zip(jax.tree.leaves(self.model_state), jax.tree.leaves(model_state)):
        row[learner] = value

  def keep_versions(self, version: int, view_versions) -> None:
    """The adaptive rate's models: W of `version` (the current one) and of the learners' `view_versions`."""
    if self.adaptive:
      self.versions[version] = self.current
      live = {int(v) for v in view_versions} | {version}
      self.versions = {v: w for v, w in self.versions.items() if v in live}

  def apply(self, schedule: ps.ServerSchedule) -> dict[str, float]:
    """Applies one update from the gradients `add`ed since the last one; returns its measurements."""
    count = np.asarray(schedule.microbatches_total, np.float32)
    self.params, self.inner = self._step(self.params, self.inner, self._total, count)
    self.current = jax.device_get(self.params)
    # Python's sum, not np.mean: a K = 1 update's lists hold one number, and np.mean of a list costs 10 us.
    loss = sum(self._losses) / len(self._losses) if self._losses else math.nan
    l2 = sum(self._norms) / len(self._norms) if self._norms else 0.0
    self._begin()
    return {'train_loss': loss, 'l2_grads': l2}

  def snapshot(self):
    """The model, the learners' mean batch statistics and the model's norm on the host: what the evaluation
    reads (`evaluation.Evaluator.measure`)."""
    mean = jax.tree.map(lambda x: np.mean(x, axis=0).astype(x.dtype), self.model_state)
    return self.current, mean, np.asarray(self._norm(self.params))

  def host_state(self) -> step_lib.TrainState:
    """The whole state on the host (a checkpoint): W, the inner state, the batch statistics."""
    return step_lib.TrainState(self.current, jax.device_get(self.inner),
                               jax.tree.map(np.copy, self.model_state))


class Server:
  """A server's bookkeeping around `ServerCore`: arrivals, AdaSync's K, records, snapshots, the measured clock.

  Not thread-safe: `ServerActor` calls it under its lock, the tests from one thread.
  """

  def __init__(self, config, state=None, version: int = 0, positions=None, adasync_state: Optional[dict] = None,
               time_offset_s: float = 0.0, clock: Callable[[], float] = time.perf_counter):
    self.core = ServerCore(config, state)
    self._clock = clock  # seconds; the tests pass a simulated one
    config = self.core.config
    self.config, self.rule = config, self.core.run.rule
    self.adasync = self.rule if isinstance(self.rule, adasync_rule.AdaSync) else None
    k = arrivals_lib.initial_k(self.rule)
    self.adasync_state = {'k': k, 'next_adjust_s': None if self.adasync is None else self.adasync.period_s,
                          'initial_loss': None, 'latest_loss': None, **(adasync_state or {})}
    self.arrivals = arrivals_lib.Arrivals(config.workers, config.microbatches, arrivals_lib.policy_of(self.rule),
                                          int(self.adasync_state['k']), version, positions)
    self.core.keep_versions(version, [])
    self.time_offset_s = time_offset_s
    self.stopped = False
    self._t0: Optional[float] = None
    self._pushes: list = []
    self.records: list[UpdateRecord] = []
    self.snapshots: dict[int, Any] = {}
    self.checkpoints: dict[int, tuple] = {}

  @property
  def version(self) -> int:
    return self.arrivals.version

  @property
  def finished(self) -> bool:
    return self.stopped or self.version >= self.config.num_steps

  def stop(self) -> tuple[list[UpdateRecord], dict, dict]:
    """Stops the run after its last applied update (a preemption): every later push is told to stop, and the
    drained records come with a checkpoint of that update."""
    self.stopped = True
    records, snapshots, checkpoints = self.drain()
    return records, snapshots, {**checkpoints, self.version: self.checkpoint()}

  def start(self) -> None:
    """Starts the measured clock (after every learner compiled its gradient)."""
    self._t0 = self._clock()

  def now(self) -> float:
    """Measured seconds of training so far (those before a resume included)."""
    return self.time_offset_s + (0.0 if self._t0 is None else self._clock() - self._t0)

  def reply(self, learner: int) -> Reply:
    return Reply(self.core.current, self.version, int(self.arrivals.positions[learner]), self.finished)

  def fetch(self, learner: int) -> Reply:
    """A learner that starts or restarts: the current model (recorded when it changes the learner's view)."""
    event = self.arrivals.fetch(learner, self.now())
    if event is not None:
      self._pushes.append(event)
    return self.reply(learner)

  def push(self, learner: int, version: int, position: int, grad_sum, loss_sum: float, model_state=None,
           l2_grad: Optional[float] = None) -> str:
    """One arrival: taken (its gradient added), taken as the K-th (the update applied now) or discarded."""
    event = self.arrivals.push(learner, version, position, self.now())
    self._pushes.append(event)
    if event.outcome != arrivals_lib.DISCARDED:
      self.core.add(learner, version, grad_sum, loss_sum, model_state, l2_grad)
    if event.outcome == arrivals_lib.TAKEN_LAST:
      self._apply()
    return event.outcome

  def _apply(self) -> None:
    update = self.arrivals.close_update(self.now())
    measured = self.core.apply(update.schedule)
    step = self.version
    self.core.keep_versions(step, self.arrivals.view_version)
    self.records.append(UpdateRecord(step, update, self._pushes, measured['train_loss'], measured['l2_grads']))
    self._pushes = []
    self._adapt_k(measured['train_loss'], update.time_s)
    config = self.config
    if step % config.eval_every == 0 or step == config.num_steps:
      self.snapshots[step] = self.core.snapshot()
    if step % config.checkpoint_every == 0 or step == config.num_steps:
      self.checkpoints[step] = self.checkpoint()

  def _adapt_k(self, loss: float, now: float) -> None:
    """AdaSync: K <- adapted_k(...) at the first update that ends at or after each multiple of t0 (measured)."""
    if self.adasync is None:
      return
    state = self.adasync_state
    if math.isfinite(loss):
      if state['initial_loss'] is None:
        state['initial_loss'] = loss
      state['latest_loss'] = loss
    period = self.adasync.period_s
    if now >= state['next_adjust_s']:
      state['next_adjust_s'] += (math.floor((now - state['next_adjust_s']) / period) + 1) * period
      state['k'] = adasync_rule.adapted_k(self.adasync.k0, state['initial_loss'], state['latest_loss'],
                                          self.config.workers, state['k'])
      self.arrivals.set_k(int(state['k']))

  def checkpoint(self) -> tuple:
    """(step, host state, meta) after the last applied update: the pushes taken since are not in it (their
    learners' data positions are those at the update)."""
    meta = {'step': self.version, 'measured_time': self.now(), 'positions': self.arrivals.start_positions.tolist(),
            'adasync': dict(self.adasync_state)}
    return self.version, self.core.host_state(), meta

  def drain(self) -> tuple[list[UpdateRecord], dict, dict]:
    """The records, evaluation snapshots and checkpoints made since the last drain."""
    out = (self.records, self.snapshots, self.checkpoints)
    self.records, self.snapshots, self.checkpoints = [], {}, {}
    return out


def concurrency(config) -> int:
  """The server actor's threads (Ray's `max_concurrency`): every learner's one call in flight, each of which may
  wait for an update, and the driver's calls beside them."""
  return config.workers + 4


class ServerActor:
  """The Ray actor of `Server` (made remote by `driver.py`: `ray.remote(ServerActor)` with `max_concurrency` from
  `concurrency`), threaded.

  A learner calls `fetch` when it starts (or restarts) and then only `push`: each returns its next `Reply`.
  Every call holds the actor's lock while it reads or changes the server, so updates run one at a time; a push
  that must wait for its update (K-sync, K-async) waits on a condition of that lock, releasing it, while the
  other calls are served; so does the fetch of a restarted learner whose last push was taken into the update in
  progress. Threads, not asyncio: Ray's asyncio actor costs more per call than a threaded one, about as
  much as the whole update of a small model (docs/results/real_hardware.md).
  """

  def __init__(self, config, state=None, version: int = 0, positions=None, adasync_state=None,
               time_offset_s: float = 0.0):
    self.server = Server(config, state, version, positions, adasync_state, time_offset_s)
    self._lock = threading.Lock()
    self._applied = threading.Condition(self._lock)
    self._waiters: dict[int, int] = {}  # update version -> calls waiting for it to be applied
    self._released: dict[int, tuple] = {}  # update version -> (W after it, its version), until its waiters left

  def ready(self) -> int:
    with self._lock:
      return self.server.version

  def start(self) -> None:
    with self._lock:
      self.server.start()

  def _reply_after_update(self, learner: int) -> Reply:
    """The learner's reply once the update in progress is applied (the lock held): the model of that version, even
    if more updates followed before this thread woke (its view is W_{t+1}, not the newest)."""
    version = self.server.version
    self._waiters[version] = self._waiters.get(version, 0) + 1
    self._applied.wait_for(lambda: version in self._released)
    params, new_version = self._released[version]
    self._waiters[version] -= 1
    if not self._waiters[version]:
      del self._waiters[version], self._released[version]
    position = int(self.server.arrivals.positions[learner])  # moves only with its own pushes: it waited
    return Reply(params, new_version, position, self.server.finished)

  def _release(self, every: bool = False) -> None:
    """Hands the model just applied to the calls that waited for its update (`every`: to all that wait)."""
    done = (self.server.core.current, self.server.version)
    for version in self._waiters:
      if (every or version < self.server.version) and version not in self._released:
        self._released[version] = done
    self._applied.notify_all()

  def fetch(self, learner: int) -> Reply:
    with self._lock:
      server = self.server
      if not server.finished and server.arrivals.policy.waits and server.arrivals.contributions[learner] > 0:
        return self._reply_after_update(learner)
      return server.fetch(learner)

  def push(self, pushed: Pushed) -> Reply:
    learner = pushed.learner
    with self._lock:
      server = self.server
      if server.finished:
        return server.reply(learner)
      before = server.version
      outcome = server.push(*pushed)
      if server.version > before:
        self._release()
      elif outcome == arrivals_lib.TAKEN and server.arrivals.policy.waits:
        return self._reply_after_update(learner)
      return server.reply(learner)

  def drain(self):
    with self._lock:
      return self.server.drain()

  def snapshot(self):
    """The evaluation's snapshot of the current model (`ServerCore.snapshot`)."""
    with self._lock:
      return self.server.core.snapshot()

  def stop(self):
    """`Server.stop`; the pushes that wait for an update get their stop now."""
    with self._lock:
      out = self.server.stop()
      self._release(every=True)
      return out

  def status(self) -> dict[str, Any]:
    with self._lock:
      return {'version': self.server.version, 'measured_time': self.server.now(),
              'k': int(self.server.arrivals.k)}
