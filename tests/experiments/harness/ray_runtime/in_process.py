"""The Ray runtime's server and learners in one process, their arrivals ordered by simulated compute times.

`run` drives `server.Server` and `worker.Learner` exactly as the actors do (fetch, compute, push; a push that
must wait for its update waits), with the order of arrivals decided by per-learner compute times drawn from a
seeded generator instead of by real processes: a fast, deterministic stand-in for the actors, for the tests of
the server's rules. `trajectory` turns the server's records into what the float64 replay reads.
"""

import heapq

import jax
import numpy as np

from waitless.experiments.harness.ray_runtime import arrivals
from waitless.experiments.harness.ray_runtime import server as server_lib
from waitless.experiments.harness.ray_runtime import worker
from tests import harness


class SimulatedTime:
  """A clock the test moves: the server's measured time is the simulated one."""

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def run(config, means, seed: int = 0, starts=None):
  """Trains `config` to its num_steps on the in-process server; learner i's jobs take Exp(mean = means[i]) s,
  and it starts (fetches) at `starts[i]` seconds (default: all at 0).

  Returns the `server.Server` (its `records` hold every update), the initial host params (P, ...) and the
  `worker.Learner`s (each holds its view).
  """
  time = SimulatedTime()
  server = server_lib.Server(config, clock=time)
  initial = jax.tree.map(lambda x: np.repeat(x[None], config.workers, axis=0), server.core.current)
  program = worker.Program(config)  # one process hosting every learner, as a learner process hosts several
  learners = [worker.Learner(config, i, program=program) for i in range(config.workers)]
  rng = np.random.default_rng(seed)
  heap, waiting = [], []
  server.start()

  def start(i, fetch=False):
    reply = server.fetch(i) if fetch else server.reply(i)
    job = (reply.version, reply.position, *learners[i].compute(reply.params, reply.position, reply.version))
    heapq.heappush(heap, (time.now + rng.exponential(means[i]), i, job))

  for i in range(config.workers):
    heapq.heappush(heap, (0.0 if starts is None else starts[i], i, None))
  while not server.finished:
    time.now, i, job = heapq.heappop(heap)
    if job is None:
      start(i, fetch=True)
      continue
    before = server.version
    outcome = server.push(i, *job)
    if server.version > before:
      for w in waiting + [i]:
        start(w)
      waiting = []
    elif outcome == arrivals.TAKEN and server.arrivals.policy.waits:
      waiting.append(i)
    else:
      start(i)
  return server, initial, learners


def trajectory(server, initial_params, learners, records=None) -> harness.Trajectory:
  """The replay's view of a Ray run: its schedules and positions per update, the learners' final views (each
  held by its learner) and the server's state."""
  records = server.records if records is None else records
  state = server.core.host_state()
  views = []
  for i, learner in enumerate(learners):
    view = learner.view
    if learner.view_version != server.arrivals.view_version[i]:
      # K-sync, K-batch-sync: a job of the cancelled round, discarded when it arrives; its learner fetches W then,
      # the schedules' view already.
      assert server.arrivals.policy.current_only and server.arrivals.view_version[i] == server.version, i
      view = server.core.current
    views.append(view)
  views = jax.tree.map(lambda *rows: np.stack(rows), *views)
  return harness.Trajectory(
      run=server.core.run, initial_params=initial_params, params=[views],
      positions=[r.update.positions for r in records], schedules=[r.update.schedule for r in records],
      losses=np.zeros((len(records), server.config.workers)), final_state=state)

