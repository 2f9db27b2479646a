"""The parameter server of the Ray runtime: the model, the real arrivals, and the algorithm's own update.

`ServerCore` holds what the emulator holds for the family (`algorithms.parameter_server`): every learner's view
as `params` (P, ...), the server copy W_t and the inner optimizer state in `opt_state`. An update is the
lock-step program's per-worker update (`experiments.harness.step.make_worker_update` around the algorithm's
transformation), vmapped over the P learners on the server's one device exactly as the simulated run maps its
workers onto a device: the same functions, fed the gradient sums that really arrived and the schedule that
`arrivals.Arrivals` made of their arrival order. No second copy of the math.

Every reply to a learner is the server's current model W (after the update, when its push completed one) with
its version and the learner's data position: by the schedule's rules that is the learner's view from then on
(`refresh_view`: W_{t+1}; `fetch_current` or a discarded push: W_t), so the learners compute on exactly the
views the server keeps.

`ServerActor` is the Ray actor around it (asyncio: a push that must wait for its update, K-sync's and K-async's,
awaits it while the other pushes are served). Updates run one at a time on the actor's event loop.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from waitless.algorithms import parameter_server as ps
from waitless.cluster import schedules
from waitless.cluster.rules import adasync as adasync_rule
from waitless.experiments.harness import evaluation
from waitless.experiments.harness import setup
from waitless.experiments.harness import step as step_lib
from waitless.experiments.harness import workers as workers_lib
from waitless.experiments.harness import xla_cpu
from waitless.experiments.harness.ray_runtime import arrivals as arrivals_lib
from waitless.experiments.harness.ray_runtime import pieces


class Reply(NamedTuple):
  """What a learner gets back from a fetch or a push."""
  params: Any        # the server's current model W (host arrays): the learner's view from now on
  version: int       # its version t
  position: int      # the learner's data position (micro-batches) for its next job
  stop: bool         # the run has all its updates: the learner stops


class UpdateRecord(NamedTuple):
  """One applied update, for the metrics, the event log and the replay."""
  step: int                 # updates applied so far, this one included
  update: arrivals_lib.Update
  pushes: list              # the `arrivals.Push`es that arrived during it (taken and discarded)
  train_loss: float         # mean over its taken gradients of their mean micro-batch loss
  l2_grads: float


class ServerCore:
  """The server's state and its update (no Ray): what `ServerActor` serves, and what the tests drive directly."""

  def __init__(self, config, state: Optional[step_lib.TrainState] = None):
    self.run = run = pieces.build(config)
    self.config = config = run.config
    layout = run.layout
    self.state = setup.init_state(run) if state is None else jax.device_put(state, layout.sharding())
    update = step_lib.make_worker_update(run.tx, run.microbatches, run.spec.gradient_sums,
                                         xla_cpu.norm(layout.platform))  # the lock-step program's norms
    uniform_fields = ps.ServerSchedule.UNIFORM
    worker = PartitionSpec(workers_lib.DEVICE_AXIS)

    def device_update(state, grad_sums, loss_sums, per_worker, uniform):
      def one(state, grad_sum, loss_sum, own):
        schedule = ps.ServerSchedule(**own, **uniform)
        return update(state, grad_sum, loss_sum, state.model_state, schedule, jnp.zeros((), jnp.int32))
      return layout.per_worker(one)(state, grad_sums, loss_sums, per_worker)

    mapped = layout.shard_map(device_update, in_specs=(worker, worker, worker, worker, PartitionSpec()),
                              out_specs=(worker, worker))
    self._update = jax.jit(mapped, donate_argnums=0)
    self._uniform_fields = uniform_fields
    self._consensus = jax.jit(lambda s: run.spec.consensus(s.params, s.opt_state))
    self._evaluator = evaluation.make_evaluator(run)
    self.current = jax.device_get(self._consensus(self.state))
    self._zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), jax.device_get(self.state.params))
    self._grad_sums = jax.tree.map(np.copy, self._zeros)  # (P, ...) host buffers of the update's gradient sums
    self._rows: set[int] = set()
    self._begin()
    self._compile()

  def _compile(self) -> None:
    """Compiles the update before the clock starts (on a copy of the state: the result is thrown away)."""
    nobody = ps.schedule(self.config.workers, 1, self.config.microbatches, np.zeros(self.config.workers, np.int32))
    jax.block_until_ready(self.run_update(jax.tree.map(jnp.copy, self.state), nobody))

  def run_update(self, state, schedule: ps.ServerSchedule):
    """The jitted update of `state` (donated) from this update's gradient and loss sums and `schedule`:
    (new state, measurements)."""
    per_worker, uniform = schedules.split(schedule)
    return self._update(state, self._grad_sums, self._loss_sums.astype(np.float32), per_worker,
                        {k: np.asarray(v) for k, v in uniform.items()})

  def _begin(self) -> None:
    """Empties the update's sums: the rows its pushes wrote (the (P, ...) buffers are kept, not reallocated)."""
    for total in jax.tree.leaves(self._grad_sums):
      total[sorted(self._rows)] = 0
    self._rows: set[int] = set()
    self._loss_sums = np.zeros(self.config.workers, np.float64)
    self._losses: list[float] = []
    self._model_states: dict[int, Any] = {}

  def add(self, learner: int, grad_sum, loss_sum: float, model_state) -> None:
    """A taken gradient: its sum over the job's micro-batches joins the learner's row of this update."""
    for total, g in zip(jax.tree.leaves(self._grad_sums), jax.tree.leaves(grad_sum)):
      if learner in self._rows:
        total[learner] += np.asarray(g, total.dtype)
      else:
        total[learner] = g
    self._rows.add(learner)
    self._loss_sums[learner] += float(loss_sum)
    self._losses.append(float(loss_sum) / self.config.microbatches)
    if jax.tree.leaves(model_state):
      self._model_states[learner] = model_state

  def apply(self, schedule: ps.ServerSchedule) -> dict[str, float]:
    """Applies one update from the gradients `add`ed since the last one; returns its measurements."""
    state = self.state
    if self._model_states:  # models with batch statistics: a learner's latest pushed ones
      rows = jax.device_get(state.model_state)
      for i, ms in self._model_states.items():
        for row, value in zip(jax.tree.leaves(rows), jax.tree.leaves(ms)):
          row[i] = value
      state = state._replace(model_state=jax.device_put(rows, self.run.layout.sharding()))
    self.state, measured = self.run_update(state, schedule)
    self.current = jax.device_get(self._consensus(self.state))
    pushed = schedule.contributions > 0
    l2 = np.asarray(measured['l2_grads'])[pushed]
    loss = float(np.mean(self._losses)) if self._losses else math.nan
    self._begin()
    return {'train_loss': loss, 'l2_grads': float(l2.mean()) if l2.size else 0.0}

  def snapshot(self):
    """The consensus model, its model state and norm on the host: what the evaluation reads."""
    return jax.device_get(self._evaluator.consensus(self.state))

  def host_state(self) -> step_lib.TrainState:
    """The whole state on the host (a checkpoint)."""
    return jax.device_get(self.state)


class Server:
  """A server's bookkeeping around `ServerCore`: arrivals, AdaSync's K, records, snapshots, the measured clock.

  Single-threaded: `ServerActor` calls it from its event loop, the tests from theirs.
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

  def push(self, learner: int, version: int, position: int, grad_sum, loss_sum: float, model_state=None) -> str:
    """One arrival: taken (its gradient added), taken as the K-th (the update applied now) or discarded."""
    event = self.arrivals.push(learner, version, position, self.now())
    self._pushes.append(event)
    if event.outcome != arrivals_lib.DISCARDED:
      self.core.add(learner, grad_sum, loss_sum, model_state if model_state is not None else {})
    if event.outcome == arrivals_lib.TAKEN_LAST:
      self._apply()
    return event.outcome

  def _apply(self) -> None:
    update = self.arrivals.close_update(self.now())
    measured = self.core.apply(update.schedule)
    step = self.version
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


class ServerActor:
  """The Ray actor of `Server` (made remote by `driver.py`: `ray.remote(ServerActor)`), asyncio.

  A learner calls `fetch` when it starts (or restarts) and then only `push`: each returns its next `Reply`.
  A push that must wait for its update (K-sync, K-async) awaits it; so does the fetch of a restarted learner
  whose last push was taken into the update in progress.
  """

  def __init__(self, config, state=None, version: int = 0, positions=None, adasync_state=None,
               time_offset_s: float = 0.0):
    self.server = Server(config, state, version, positions, adasync_state, time_offset_s)
    self._waiting: dict[int, asyncio.Future] = {}  # update version -> resolved when it is applied

  def ready(self) -> int:
    return self.server.version

  def start(self) -> None:
    self.server.start()

  async def _reply_after_update(self, learner: int) -> Reply:
    """The learner's reply once the update in progress is applied: the model of that version, even if more
    updates followed before this coroutine resumed (its view is W_{t+1}, not the newest)."""
    version = self.server.version
    if version not in self._waiting:
      self._waiting[version] = asyncio.get_running_loop().create_future()
    params, new_version = await self._waiting[version]
    position = int(self.server.arrivals.positions[learner])  # moves only with its own pushes: it waited
    return Reply(params, new_version, position, self.server.finished)

  def _release(self) -> None:
    """Hands the model just applied to the pushes and fetches that waited for its update."""
    done = (self.server.core.current, self.server.version)
    for version in [v for v in self._waiting if v < self.server.version]:
      self._waiting.pop(version).set_result(done)

  async def fetch(self, learner: int) -> Reply:
    server = self.server
    if server.arrivals.policy.waits and server.arrivals.contributions[learner] > 0:
      return await self._reply_after_update(learner)
    return server.fetch(learner)

  async def push(self, learner: int, version: int, position: int, grad_sum, loss_sum: float,
                 model_state=None) -> Reply:
    server = self.server
    if server.finished:
      return server.reply(learner)
    before = server.version
    outcome = server.push(learner, version, position, grad_sum, loss_sum, model_state)
    if server.version > before:
      self._release()
    elif outcome == arrivals_lib.TAKEN and server.arrivals.policy.waits:
      return await self._reply_after_update(learner)
    return server.reply(learner)

  def drain(self):
    return self.server.drain()

  def snapshot(self):
    """The evaluation's snapshot of the current model (`ServerCore.snapshot`)."""
    return self.server.core.snapshot()

  def stop(self):
    """`Server.stop`; the pushes that wait for an update get their stop now."""
    out = self.server.stop()
    done = (self.server.core.current, self.server.version)
    for version in list(self._waiting):
      self._waiting.pop(version).set_result(done)
    return out

  def status(self) -> dict[str, Any]:
    return {'version': self.server.version, 'measured_time': self.server.now(),
            'k': int(self.server.arrivals.k)}
