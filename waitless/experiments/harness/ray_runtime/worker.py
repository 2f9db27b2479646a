"""The learners of the Ray runtime; each: fetch the model, compute one job's gradient on its own data, push, repeat.

A job is one mini-batch of m micro-batches read at the learner's data position (the position the server gave
it: the server counts the learner's taken pushes, so a discarded job is read again, as the emulator does). Its
gradient is the harness's own per-worker gradient (`experiments.harness.step.make_worker_gradient`, jitted once):
the sum over the m micro-batches, taken at the model the learner fetched, with the sum of their losses.

The learner keeps no state the run needs but its view (the server holds one model, not P): a learner process
that died and that Ray restarted has each of its learners fetch the current model and its position again, and
they go on. A process hosts several learners (`LearnerActor`, `plan.py`), so that hundreds fit one machine.

TEST-ONLY hooks (`DebugHooks`; `--debug_slow_process=I:S`, `--debug_delay=K:S` as for the multi-process runs,
and `--debug_crash_learner=I:T`): learner I sleeps S seconds per micro-batch it computes (a slower device);
each job, each learner sleeps S once with probability K / P (transient delays, seeded by the run's seed, the
learner and its job count); learner I's process exits (as a kill -9 would end it) once it holds a model of
version >= T, in its first life only (Ray restarts it).
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from waitless.algorithms import spec as spec_lib
from waitless.experiments.harness import setup
from waitless.experiments.harness import step as step_lib
from waitless.experiments.harness.ray_runtime import pieces
from waitless.experiments.harness.ray_runtime import server as server_lib


class _Job(NamedTuple):
  microbatches_done: jax.Array  # every micro-batch of the job counts


class Computed(NamedTuple):
  """One job's result, as a learner pushes it."""
  grad_sum: Any        # the gradient summed over the job's m micro-batches (host arrays)
  loss_sum: float      # their losses summed
  model_state: Any     # the model state after them (batch statistics; empty without)
  l2_grad: float       # the norm of the job's mean gradient (the metrics' `l2_grads`)


class DebugHooks(NamedTuple):
  """TEST-ONLY real delays and a crash of a learner (module docstring)."""
  slow_learner: int = -1       # I of --debug_slow_process (-1: none)
  slow_s: float = 0.0          # S: seconds per micro-batch of learner I
  delayed_per_job: int = 0     # K of --debug_delay: expected learners delayed per job round
  delay_s: float = 0.0         # S of --debug_delay
  crash_learner: int = -1      # I of --debug_crash_learner (-1: none)
  crash_at_version: int = 0    # T: it exits once it holds a model of version >= T
  base_s: float = 0.0          # every learner sleeps this per micro-batch (emulated compute, benchmarks)


NO_HOOKS = DebugHooks()


class Program:
  """What the learners of one process share: the run's pieces (its data streams), the initial model and the
  jitted gradient, compiled once for all of them."""

  def __init__(self, config):
    self.run = run = pieces.build(config)
    m = run.config.microbatches
    gradient = step_lib.make_worker_gradient(run.task, run.model, m, gradient_params=spec_lib.at_own_params)
    job = _Job(jnp.asarray(m, jnp.int32))

    def with_norm(params, model_state, batch, rng):
      grad_sum, loss_sum, model_state = gradient(params, None, model_state, batch, job, rng)
      return grad_sum, loss_sum, model_state, step_lib.tree_l2(grad_sum) / m

    self.gradient = jax.jit(with_norm)
    self.example, self.model_state = jax.device_get(setup.init_model(run))


class Learner:
  """One learner: its data stream, view, position and random stream (no Ray); what `LearnerActor` hosts, several
  per process, and what the tests call directly. `program`: the process's shared `Program` (a new one if None)."""

  def __init__(self, config, learner: int, hooks: DebugHooks = NO_HOOKS, program: Program | None = None):
    self.program = program = Program(config) if program is None else program
    self.run = run = program.run
    self.config, self.learner, self.hooks = run.config, learner, hooks
    self._gradient = program.gradient
    self._key = jax.random.fold_in(jax.random.key(self.config.seed), learner)
    self.jobs = 0
    self._example, self.model_state = program.example, program.model_state
    self.view = self._example  # the model its next gradient is computed on: W_0, then the last reply's
    self.view_version = 0

  def warm_up(self) -> None:
    """Compiles the gradient (on the initial model and the first job's data) before the clock starts."""
    jax.block_until_ready(self._compute(self._example, 0))

  def batch(self, position: int) -> dict[str, np.ndarray]:
    """The job at `position`: (m, b/m, ...) of this learner's stream (`data.base.WorkerStreams.read`)."""
    examples = self.run.dataset.train.read(np.asarray([self.learner]), np.asarray([[position]], np.int64),
                                           self.config.microbatches)
    return {k: v[0, 0] for k, v in examples.items()}

  def _compute(self, params, position: int):
    rng = jax.random.fold_in(self._key, self.jobs)
    return self._gradient(params, self.model_state, self.batch(position), rng)

  def compute(self, params, position: int, version: int = 0) -> Computed:
    """One job's gradient at `params` (the learner's view from now on, of server `version`) and data
    `position`, on the host."""
    self.view, self.view_version = params, version
    grad_sum, loss_sum, model_state, l2 = jax.device_get(self._compute(params, position))
    self._sleep(self.jobs)
    self.jobs += 1
    self.model_state = model_state
    return Computed(grad_sum, float(loss_sum), model_state, float(l2))

  def _sleep(self, job: int) -> None:
    s, m = self.hooks, self.config.microbatches
    seconds = s.base_s * m + (s.slow_s * m if self.learner == s.slow_learner else 0.0)
    if s.delayed_per_job:  # the same draw on every learner: K of the P learners' job `job` are delayed
      chosen = np.random.default_rng([self.config.seed, 7, job]).choice(self.config.workers, s.delayed_per_job,
                                                                         replace=False)
      seconds += s.delay_s if self.learner in chosen else 0.0
    if seconds > 0:
      time.sleep(seconds)


class LearnerActor:
  """The Ray actor of one learner process (made remote by `driver.py`): it hosts `learners`, each its own
  `Learner` (data stream, view, position, random stream) on the process's one `Program`.

  `work(server)` loops until the run stops: every learner has one call to the server in flight (its fetch, then
  its pushes); the learners whose replies have come compute their next jobs, each once per round, the one that
  waited longest first (one at a time: the process's device), and push them. Learners of one process therefore
  share its CPU as learners of one machine would.
  """

  def __init__(self, config, learners, hooks: DebugHooks = NO_HOOKS):
    learners = [learners] if isinstance(learners, int) else list(learners)
    program = Program(config)
    self.learners = {i: Learner(config, i, hooks, program) for i in learners}
    next(iter(self.learners.values())).warm_up()  # one compile serves them all
    import ray  # only inside a Ray worker process
    first_life = not ray.get_runtime_context().was_current_actor_reconstructed
    crashes = hooks.crash_learner in self.learners and first_life
    self._crash = (hooks.crash_learner, hooks.crash_at_version) if crashes else None

  def ready(self) -> list[int]:
    return list(self.learners)

  def connect(self, server) -> int:
    """One call to the server before the clock starts: its first call opens the connection (tens of ms)."""
    import ray
    return ray.get(server.ready.remote())

  def work(self, server) -> int:
    """Fetch, compute, push for every hosted learner until the server says stop; returns the jobs computed."""
    import ray  # only inside a Ray worker process
    pending = {server.fetch.remote(i): i for i in self.learners}  # oldest call first
    while pending:
      ray.wait(list(pending), num_returns=1)
      ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
      ready = set(ready)
      for ref in [ref for ref in pending if ref in ready]:  # each ready learner once, longest waiting first
        i = pending.pop(ref)
        reply = ray.get(ref)
        if reply.stop:
          continue
        if self._crash is not None and i == self._crash[0] and reply.version >= self._crash[1]:
          os._exit(1)  # TEST-ONLY (--debug_crash_learner): the process dies as a kill -9 would end it
        job = self.learners[i].compute(reply.params, reply.position, reply.version)
        pending[server.push.remote(server_lib.Pushed(i, reply.version, reply.position, *job))] = i
    return sum(learner.jobs for learner in self.learners.values())
