"""A learner of the Ray runtime: fetch the model, compute one job's gradient on its own data, push, repeat.

A job is one mini-batch of m micro-batches read at the learner's data position (the position the server gave
it: the server counts the learner's taken pushes, so a discarded job is read again, as the emulator does). Its
gradient is the harness's own per-worker gradient (`experiments.harness.step.make_worker_gradient`, jitted once):
the sum over the m micro-batches, taken at the model the learner fetched, with the sum of their losses.

The learner keeps no state the run needs: a learner actor that died and that Ray restarted fetches its view
and position again and goes on.

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


class _Job(NamedTuple):
  microbatches_done: jax.Array  # every micro-batch of the job counts


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


class Learner:
  """One learner's gradient computation (no Ray): what `LearnerActor` runs, and what the tests call directly."""

  def __init__(self, config, learner: int, hooks: DebugHooks = NO_HOOKS):
    self.run = run = pieces.build(config)
    self.config, self.learner, self.hooks = run.config, learner, hooks
    m = self.config.microbatches
    gradient = step_lib.make_worker_gradient(run.task, run.model, m, gradient_params=spec_lib.at_own_params)
    job = _Job(jnp.asarray(m, jnp.int32))
    self._gradient = jax.jit(lambda params, model_state, batch, rng: gradient(params, None, model_state, batch,
                                                                               job, rng))
    self._key = jax.random.fold_in(jax.random.key(self.config.seed), learner)
    self.jobs = 0
    initial = setup.init_state(run)
    self.model_state = jax.device_get(jax.tree.map(lambda x: x[learner], initial.model_state))
    self._example = jax.device_get(jax.tree.map(lambda x: x[learner], initial.params))

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

  def compute(self, params, position: int) -> tuple[Any, float, Any]:
    """(gradient sum over the job's micro-batches, their loss sum, the model state after them) on the host."""
    grad_sum, loss_sum, model_state = jax.device_get(self._compute(params, position))
    self._sleep(self.jobs)
    self.jobs += 1
    self.model_state = model_state
    return grad_sum, float(loss_sum), model_state

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
  """The Ray actor of a `Learner` (made remote by `driver.py`). `work(server)` loops until the run stops."""

  def __init__(self, config, learner: int, hooks: DebugHooks = NO_HOOKS):
    self.learner = Learner(config, learner, hooks)
    self.learner.warm_up()
    import ray  # only inside a Ray worker process
    first_life = not ray.get_runtime_context().was_current_actor_reconstructed
    self._crash_at = hooks.crash_at_version if hooks.crash_learner == learner and first_life else None

  def ready(self) -> int:
    return self.learner.learner

  def connect(self, server) -> int:
    """One call to the server before the clock starts: its first call opens the connection (tens of ms)."""
    import ray
    return ray.get(server.ready.remote())

  def work(self, server) -> int:
    """Fetch, compute, push until the server says stop; returns the jobs this actor computed."""
    import ray  # only inside a Ray worker process
    me = self.learner.learner
    reply = ray.get(server.fetch.remote(me))
    while not reply.stop:
      if self._crash_at is not None and reply.version >= self._crash_at:
        os._exit(1)  # TEST-ONLY (--debug_crash_learner): the process dies as a kill -9 would end it
      grad_sum, loss_sum, model_state = self.learner.compute(reply.params, reply.position)
      reply = ray.get(server.push.remote(me, reply.version, reply.position, grad_sum, loss_sum, model_state))
    return self.learner.jobs
