"""A run on the Ray runtime: `train_and_evaluate(config, workdir)` with `runtime=ray`.

The driver (this process) joins a Ray cluster (`address`; without one it starts a local Ray that stops with the
run), starts the server actor (`server.ServerActor`: the model, the real arrivals, the algorithm's own update)
and the learner processes its plan names (`plan.py`; `worker.LearnerActor`: several learners each, one device),
waits until every actor compiled, starts the measured clock, and lets the learners work. While they do, it
drains the server's records into the run's recorder (`recorder.RunRecorder`, as the lock-step loop does): a
metrics row every `log_every` updates, the evaluation of the server model every `eval_every`, an orbax
checkpoint every `checkpoint_every` (and at the end); and into the event log (`events.py`). The time is
`measured_time`, the measured training seconds (the summary says `"clock": "measured"`, `"runtime": "ray"`):
actor start-up and compilation left out, evaluation and checkpoints included (they run in the driver beside the
training, as a real job's would).

Failures: a learner process that dies is restarted by Ray (`ray.max_restarts` times) and its learners fetch their
views again; the driver says so in one line and the run goes on (a synchronous one waits for them). A process lost
for good stops a run whose update needs more learners than are left (`recorder.ClusterStalled`). SIGTERM / Ctrl-C
checkpoint the server after its last update and raise `preemption.Preempted`; kill -9 of the driver loses what
followed the last checkpoint, and the same command resumes from it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
import warnings
from typing import Any, Optional

import jax
import numpy as np

from waitless import config_errors as errors
from waitless.experiments.harness import checkpointing
from waitless.experiments.harness import evaluation
from waitless.experiments.harness import preemption
from waitless.experiments.harness import recorder as recorder_lib
from waitless.experiments.harness import setup
from waitless.experiments.harness import tasks
from waitless.experiments.harness import workdir as workdir_lib
from waitless.experiments.harness import workdir_lock
from waitless.experiments.harness.ray_runtime import arrivals as arrivals_lib
from waitless.experiments.harness.ray_runtime import events as events_lib
from waitless.experiments.harness.ray_runtime import pieces
from waitless.experiments.harness.ray_runtime import plan as plan_lib
from waitless.experiments.harness.ray_runtime import ray_config
from waitless.experiments.harness.ray_runtime import server as server_lib
from waitless.experiments.harness.ray_runtime import worker as worker_lib

log = logging.getLogger('waitless')

RUNTIME = 'ray'
# What a metrics row reports of the updates since the last one, beyond the recorder's own (their reductions).
REPORTS = {'k': 'mean', 'max_staleness': 'max', 'discarded': 'sum', 'update_s': 'mean'}
CONNECT_TIMEOUT_S = 15.0
POLL_S = 0.05
RAYLET_MESSAGES = 'ray_messages.log'  # the raylet's own error messages (`raylet_messages_to`)
START_TIMEOUT_S = 600.0  # actors start, import JAX and compile: minutes on a busy cluster


# log_to_driver=False: a learner's own errors reach the driver as exceptions; its process's stderr (and the raylet's
# report of a learner it lost, which the driver says in one line) would bury the run's lines.
_OPTIONS = dict(include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False, configure_logging=True)


@contextlib.contextmanager
def _own_signal_handlers():
  """Keeps this process's SIGTERM and SIGINT handlers across `ray.init`, which installs its own SIGTERM handler:
  the run's (`preemption.StopRequests`: checkpoint, then exit 75) must stay the one a scheduler's SIGTERM meets."""
  kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield
  finally:
    if threading.current_thread() is threading.main_thread():
      for sig, handler in kept.items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def raylet_messages_to(path: str):
  """Ray's driver prints the raylet's error messages (a worker that died, 'Task ... failed. There are N retries
  remaining') on its standard streams, beside the driver's own line for the same event: while this is open they
  are appended to `path` instead. Ray's private `print_to_stdstream` is wrapped (looked up by the listener at
  every message); where a Ray version has none, its messages are printed as before."""
  from ray._private import worker as ray_worker
  original = getattr(ray_worker, 'print_to_stdstream', None)
  if original is None:
    yield
    return

  def route(data, ignore_prefix):
    if data.get('pid') != 'raylet':
      return original(data, ignore_prefix)
    try:
      with open(path, 'a') as f:
        f.writelines(f'{time.strftime("%H:%M:%S")} {line}\n' for line in data.get('lines', []))
    except OSError:
      return original(data, ignore_prefix)

  ray_worker.print_to_stdstream = route
  try:
    yield
  finally:
    ray_worker.print_to_stdstream = original


def short_reason(error: BaseException, limit: int = 160) -> str:
  """An exception's message in at most `limit` characters for one line: its first sentence or line, cut at a word
  boundary with '...' (never mid-word: Ray's actor errors run to several lines)."""
  text = ' '.join(str(error).split())
  if not text:
    return type(error).__name__
  sentence = text.split('. ')[0].rstrip('.')
  if len(sentence) <= limit:
    return sentence
  return sentence[:limit - 3].rsplit(' ', 1)[0] + '...'


def start_local(**options) -> None:
  """Starts a local Ray for this process (`ray.init` with `options`): a new cluster of its own (address 'local'),
  even where `ray start` left a cluster, or its address file, behind."""
  import ray
  with warnings.catch_warnings(), _own_signal_handlers():
    warnings.filterwarnings('ignore', message='os.fork', category=RuntimeWarning)  # fork + exec: no JAX in the child
    ray.init(address='local', **{**_OPTIONS, **options})


def connect(address: Optional[str], timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
  """Joins the Ray cluster at `address` (HOST:PORT of its head, or 'auto'), or starts a local one; returns
  whether this process started it (and so stops it). An address that does not answer within `timeout_s`
  raises RayUnavailable, not a hang."""
  import ray  # only a Ray run pays for it
  if ray.is_initialized():
    return False
  if not address:
    start_local()
    return True
  if address != 'auto':
    host, _, port = address.rpartition(':')
    if not port.isdigit() or not 0 < int(port) < 65536:
      raise ray_config.RayUnavailable(f'--ray_address={address} is not allowed: must be HOST:PORT of the Ray '
                                      "cluster's head (e.g. 127.0.0.1:6379), or auto")
    try:
      with socket.create_connection((host or '127.0.0.1', int(port)), timeout=timeout_s):
        pass
    except (OSError, ValueError) as e:
      raise ray_config.RayUnavailable(
          f'--ray_address={address} does not answer within {timeout_s:g} s ({e}): start the cluster with `ray '
          'start --head` and pass its address, or leave --ray_address unset for a local Ray') from e
  try:
    with _own_signal_handlers():
      ray.init(address=address, **_OPTIONS)
  except (ConnectionError, RuntimeError) as e:
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise ray_config.RayUnavailable(f'--ray_address={address}: {reason}') from e
  return False


SERVER_RESOURCE = 'waitless_server'  # a custom Ray resource: the node that has it holds the server actor


def resources(config, processes: int) -> dict[str, float]:
  """What each actor reserves: {'worker_cpus', 'worker_gpus', 'server_cpus'}, per learner process; worker_cpus
  unset shares the cluster's CPUs among the `processes` learner processes (at most 1 each)."""
  import ray
  r = config.ray
  total = ray.cluster_resources()
  cpus = r.worker_cpus
  if cpus is None:
    cpus = min(1.0, max(total.get('CPU', 1.0) - r.server_cpus, 0.0) / processes)
  return {'worker_cpus': float(cpus), 'worker_gpus': float(r.worker_gpus), 'server_cpus': float(r.server_cpus)}


def plan_on_cluster(config, model_bytes: float) -> plan_lib.Plan:
  """`plan.plan` against the joined Ray cluster's CPUs and `memory` resource (one line when it does not fit)."""
  import ray
  total = ray.cluster_resources()
  return plan_lib.plan(config, model_bytes, float(total.get('CPU', 1.0)), total.get('memory') or None,
                       where='the Ray cluster')


def check_resources(config, wanted: dict[str, float], placement: plan_lib.Plan) -> None:
  """Raises errors.ConfigError (naming `workers`) when the cluster cannot place the server and the learner
  processes: their CPUs and GPUs."""
  import ray
  total = ray.cluster_resources()
  p, n = config.workers, placement.processes
  for kind, need in (('CPU', n * wanted['worker_cpus'] + wanted['server_cpus']), ('GPU', n * wanted['worker_gpus'])):
    have = float(total.get(kind, 0.0))
    errors.require(need <= have + 1e-9, 'workers', p,
                   f'{placement.describe()} and the server need {need:g} {kind}s, the Ray cluster has {have:g}: use '
                   f'fewer workers, or smaller ray.worker_{kind.lower()}s / ray.server_cpus (fractions share a device)')


def check_local_machine(config, model_bytes: float, available: Optional[int] = None,
                        cpus: Optional[int] = None) -> plan_lib.Plan:
  """The plan of a local Ray on this machine (`plan.plan`): the learner processes' and the server's memory, with
  Ray's daemons, against what the machine has (`machine.available_memory_bytes`), and their CPUs
  (`machine.cpu_count`, which Ray counts too). Raises errors.ConfigError (one line) before any Ray process
  starts when it does not fit."""
  from waitless import machine
  available = machine.available_memory_bytes() if available is None else available
  cpus = machine.cpu_count() if cpus is None else cpus
  return plan_lib.plan(config, model_bytes, cpus, available, daemons_bytes=plan_lib.RAY_DAEMONS_BYTES)


def _runtime_env() -> dict[str, Any]:
  """Environment variables the actors need: this process's import path, JAX's precision, and no preallocation of
  a GPU's memory (JAX takes 75% of it at start by default: learners sharing a GPU, `ray.worker_gpus` < 1, and a
  server beside them would not fit)."""
  env = {'TF_CPP_MIN_LOG_LEVEL': os.environ.get('TF_CPP_MIN_LOG_LEVEL', '2'), 'XLA_PYTHON_CLIENT_PREALLOCATE': 'false'}
  if os.environ.get('PYTHONPATH'):
    env['PYTHONPATH'] = os.environ['PYTHONPATH']
  if jax.config.jax_enable_x64:
    env['JAX_ENABLE_X64'] = '1'
  return {'env_vars': env}


def update_measurements(record: server_lib.UpdateRecord, previous_time_s: float) -> dict[str, float]:
  """One update's contribution to the metrics window: its loss and gradient norm, K, the mean and largest delay of
  the gradients it took, the pushes it discarded, and its duration."""
  taken = [p.delay for p in record.pushes if p.outcome in (arrivals_lib.TAKEN, arrivals_lib.TAKEN_LAST)]
  return {'iterations': 1.0, 'train_loss': record.train_loss, 'l2_grads': record.l2_grads,
          'k': float(int(record.update.schedule.k)), 'staleness': float(np.mean(taken)) if taken else 0.0,
          'max_staleness': float(max(taken, default=0)),
          'discarded': float(sum(p.outcome == arrivals_lib.DISCARDED for p in record.pushes)),
          'update_s': record.update.time_s - previous_time_s}


class Driver:
  """One Ray run: actors, the drain loop, failures; what it measures goes to its recorder."""

  def __init__(self, config, workdir: str, address: Optional[str], hooks: worker_lib.DebugHooks):
    self.run = pieces.build(config)  # validates the config: before Ray starts
    self.config, self.workdir, self.address, self.hooks = config, workdir, address, hooks
    self.num_steps = self.run.config.num_steps
    self.policy = arrivals_lib.policy_of(self.run.rule)
    self.evaluator = evaluation.make_evaluator(self.run)
    self.recorder = recorder_lib.RunRecorder(workdir, self.run.config, REPORTS, recorder_lib.MEASURED, RUNTIME)
    self.events = self.lock = None
    self.step = 0
    self.num_params = 0
    self.groups: list[list[int]] = []  # the learners of each learner process (`plan.Plan.groups`)
    self.deaths = np.zeros(config.workers, np.int64)  # per learner process
    self.lost: set[int] = set()  # learner processes lost for good

  def prepare_workdir(self, like_state) -> tuple[Any, dict]:
    """Writes config.json and restores the newest readable checkpoint: (state, meta), or (None, {})."""
    checkpointing.check_writable([self.workdir], setup.param_count_and_bytes(like_state)[1])
    recorder_lib.write_config(self.workdir, self.config)
    found = recorder_lib.restore_common_step([self.recorder], like_state)
    if found is None:
      return None, {}
    step, [(state, meta)] = found
    self.recorder.restore(step, meta)
    return state, meta

  def train(self, stop_requests: preemption.StopRequests) -> dict[str, Any]:
    import ray  # only a Ray run pays for it
    workdir_lib.check_workdir(self.workdir, self.config)  # a conflict is news before Ray starts
    model_bytes = float(tasks.model_bytes(self.run.config))  # from shapes: nothing allocated
    placement = None
    if not self.address:  # a local Ray: this machine holds every actor; refused before any Ray process starts
      placement = check_local_machine(self.config, model_bytes)
    self.lock = workdir_lock.WorkdirLock(self.workdir)  # one program per workdir
    started = connect(self.address)
    actors = []
    quiet = contextlib.ExitStack()  # the raylet's messages into the workdir while this run's actors live
    quiet.enter_context(raylet_messages_to(os.path.join(self.workdir, RAYLET_MESSAGES)))
    try:
      placement = placement or plan_on_cluster(self.config, model_bytes)
      self.groups = placement.groups()
      wanted = resources(self.config, placement.processes)
      check_resources(self.config, wanted, placement)  # before the workdir is written: nothing of this run exists yet
      like = server_lib.initial_state(self.run)  # the server's state: one model
      self.num_params = setup.param_count_and_bytes(like.params)[0]
      state, meta = self.prepare_workdir(like)
      self.step = int(meta.get('step', 0))
      self.recorder.open(resumed_step=self.step)
      self.events = events_lib.EventLog(self.workdir, keep_through_step=self.step or None)
      for problem in self.events.problems:  # lost before this resume: said, never silent
        log.warning('%s', problem)
      if self.step >= self.num_steps:  # killed after its last checkpoint, before its summary
        return self.finish()
      env = _runtime_env()
      # A cluster may say where the server goes: a node holding SERVER_RESOURCE (the test bed's host 0); else
      # Ray places it (a 0-CPU actor can land on any node).
      pinned = {'resources': {SERVER_RESOURCE: 1e-3}} if ray.cluster_resources().get(SERVER_RESOURCE) else {}
      server = ray.remote(server_lib.ServerActor).options(
          num_cpus=wanted['server_cpus'], max_restarts=0, max_concurrency=server_lib.concurrency(self.config),
          runtime_env=env, **pinned).remote(
              self.config, state, self.step, meta.get('positions'), meta.get('adasync'), self.recorder.time)
      learners = [ray.remote(worker_lib.LearnerActor).options(
          num_cpus=wanted['worker_cpus'], num_gpus=wanted['worker_gpus'], max_restarts=self.config.ray.max_restarts,
          max_task_retries=0, runtime_env=env).remote(self.config, group, self.hooks)
                  for group in self.groups]
      actors = [server, *learners]
      log.info('%s on Ray: a server and %s (%g CPU, %g GPU each); compiling on every actor',
               self.config.algorithm.name, placement.describe(), wanted['worker_cpus'], wanted['worker_gpus'])
      self.wait_until_ready(server, learners)
      self.evaluator.measure(ray.get(server.snapshot.remote()))  # compiles the evaluation before the clock starts
      ray.get(server.start.remote())
      self.recorder.start_wall = time.time()
      works = {learner.work.remote(server): i for i, learner in enumerate(learners)}
      return self.drive(server, learners, works, stop_requests)
    finally:
      for actor in actors:  # a joined cluster goes on: this run's actors must not hold its resources
        ray.kill(actor, no_restart=True)
      if started:
        ray.shutdown()
      quiet.close()

  def wait_until_ready(self, server, learners, timeout_s: float = START_TIMEOUT_S) -> None:
    """Waits until every actor has started and compiled; one line (exit 2) when the cluster's free resources
    cannot place them within `timeout_s` (other jobs hold them)."""
    import ray
    pending = [server.ready.remote()] + [learner.ready.remote() for learner in learners]
    ready, waiting = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
    ray.get(ready)  # a constructor's error, raised here
    errors.require(not waiting, 'workers', self.config.workers,
                   f'{len(waiting)} of the {len(pending)} actors did not start within {timeout_s:g} s; the Ray '
                   f'cluster has {ray.available_resources()} free: other jobs may hold the rest')
    ray.get([learner.connect.remote(server) for learner in learners])

  def drive(self, server, learners, works: dict, stop_requests: preemption.StopRequests) -> dict[str, Any]:
    """Drains the server until its last update is recorded; watches the learners."""
    import ray
    last_progress = time.time()
    while True:
      self.record(*ray.get(server.drain.remote()))
      if self.step >= self.num_steps:
        break
      if stop_requests.signal_name is not None:
        self.record(*ray.get(server.stop.remote()))  # the updates since the last drain, and a checkpoint
        self.recorder.checkpointer.wait()
        raise preemption.Preempted(self.step, self.workdir, stop_requests.signal_name)
      done, _ = ray.wait(list(works), num_returns=len(works), timeout=POLL_S)
      for ref in done:
        i = works.pop(ref)
        try:
          ray.get(ref)
        except ray.exceptions.RayActorError as e:
          self.learner_died(i, e)
          if i not in self.lost:  # queued until Ray has restarted it
            works[learners[i].work.options(max_task_retries=-1).remote(server)] = i
      if time.time() - last_progress >= self.config.progress_every_s:
        last_progress = time.time()
        log.info('step %d/%d  loss %.4f  measured %.2fs  %.1f updates/s', self.step, self.num_steps,
                 self.recorder.last_train_loss, self.recorder.time, self.step / max(self.recorder.time, 1e-9))
    self.recorder.checkpointer.wait()
    return self.finish()

  def _names(self, i: int) -> str:
    group = self.groups[i]
    learners = f'learner {group[0]}' if len(group) == 1 else f'learners {group[0]}-{group[-1]}'
    return f'{learners} (process {i})'

  def learner_died(self, i: int, error: Exception) -> None:
    """One line; a learner process past its restarts is lost with its learners, and a run that needs more
    learners than are left stops."""
    self.deaths[i] += 1
    reason = short_reason(error)
    names = self._names(i)
    if self.deaths[i] <= self.config.ray.max_restarts:
      waits = ' (the synchronous update waits for them)' if self.policy.waits else ''
      log.warning('%s died at step %d (%s); Ray restarts the process (%d of %d) and each fetches its view again%s',
                  names, self.step, reason, self.deaths[i], self.config.ray.max_restarts, waits)
      return
    self.lost.add(i)
    left = self.config.workers - sum(len(self.groups[j]) for j in self.lost)
    k = arrivals_lib.initial_k(self.run.rule)
    if left == 0 or (self.policy.waits and left < k):
      raise recorder_lib.ClusterStalled(
          f'{names} died {self.deaths[i]} times and are lost for good; {self.config.algorithm.name} needs {k} '
          f'learners per update and {left} are left. Stopped after step {self.step}; rerun to resume from the last '
          'checkpoint')
    log.warning('%s are lost for good (died %d times); %d learners go on', names, self.deaths[i], left)

  def record(self, records, snapshots: dict, checkpoints: dict) -> None:
    """The updates drained from the server: into the event log and the recorder (rows, evaluations,
    checkpoints); a loss that is not finite stops the run."""
    cfg, recorder = self.run.config, self.recorder
    for record in records:
      self.events.write(record.step, record.update, record.pushes)
      recorder.window.add_reduced(update_measurements(record, recorder.time))
      self.step, recorder.time, recorder.last_train_loss = record.step, record.update.time_s, record.train_loss
      if not recorder.check_finite(np.float64(record.train_loss), record.step - 1):
        raise recorder.failure
      evaluates = record.step in snapshots
      if evaluates or record.step % cfg.log_every == 0 or record.step == self.num_steps:
        recorder.log(record.step, self.evaluator.measure(snapshots[record.step]) if evaluates else None)
      if record.step in checkpoints:
        self.save(*checkpoints.pop(record.step))
    for step in sorted(checkpoints):  # a stop's checkpoint of an update drained before (`server.Server.stop`)
      self.save(*checkpoints[step])
    self.events.flush()

  def save(self, step: int, state, meta: dict) -> None:
    """The server's checkpoint of `step` (its state, data positions and AdaSync's K)."""
    self.recorder.checkpoint(step, state, {k: v for k, v in meta.items() if k not in ('step', 'measured_time')},
                             copy=False)

  def finish(self) -> dict[str, Any]:
    return self.recorder.finish(self.step, self.num_params, extra={
        'mean_update_s': self.recorder.time / max(self.step, 1), 'learner_deaths': int(self.deaths.sum())})

  def close(self) -> None:
    self.recorder.close()
    if self.events is not None:
      self.events.close()
    if self.lock is not None:
      self.lock.release()


def train_and_evaluate(config, workdir: str, stop_requests: Optional[preemption.StopRequests] = None,
                       address: Optional[str] = None,
                       hooks: worker_lib.DebugHooks = worker_lib.NO_HOOKS) -> dict[str, Any]:
  """Trains `config` (`runtime=ray`) in `workdir` on Ray actors, resuming from its latest checkpoint.

  Returns:
    The summary (also written to summary.json).

  Raises:
    config_errors.ConfigError, ray_config.RayUnavailable: before any actor starts (one line).
    recorder.TrainingDiverged, recorder.ClusterStalled: the run stopped there; its last good checkpoint is kept.
    preemption.Preempted: SIGTERM or SIGINT arrived; the server's state after its last update is checkpointed.
  """
  stop_requests = preemption.StopRequests() if stop_requests is None else stop_requests
  driver = Driver(config, workdir, address, hooks)
  try:
    stop_requests.install()
    return driver.train(stop_requests)
  finally:
    stop_requests.uninstall()
    driver.close()
