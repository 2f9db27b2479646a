"""What the Ray layer costs per server update: a push through a Ray actor against the same update called directly.

  python -m benchmarks.ray_overhead [--updates=300 --rounds=5 --models=digits,wide]

For each model, one process measures, in interleaved rounds:
  jit     the server's jitted update alone (`ServerCore._update`: the algorithm's vmapped per-learner update on
          one device, P = 4 learners, `async`), called back to back on the same inputs;
  direct  one whole server update in process (`Server.push`: the arrival bookkeeping, the gradient added to
          its learner's row, the jitted update, the new model copied to the host for the replies);
  ray     the same push sent to a `ServerActor` on a local Ray and its reply received (`ray.get`), as a learner
          sends it: the direct path plus Ray's call, the serialisation of the gradient and of the model.
Each figure is the median over rounds of the mean seconds per update of `--updates` updates. Prints, per
model, the three figures, ray / jit and ray / direct (target: ray / jit <= 1.5 on CPU), and the per-update
overhead of the Ray layer, ray - direct, in ms.

Models: `digits` (the digits MLP, 9,610 parameters), `wide` (an MLP of 64 -> 1024 -> 1024 -> 10, 1.1 M
parameters), `mnist1d` (the MNIST-1D CNN of the quickstart).
"""

from __future__ import annotations

import os
import sys
import time

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags
import jax
import numpy as np

from benchmarks import cli
from waitless.cluster import schedules
from waitless.experiments.configs import digits
from waitless.experiments.configs import mnist1d
from waitless.experiments.harness.ray_runtime import driver
from waitless.experiments.harness.ray_runtime import server as server_lib

_UPDATES = flags.DEFINE_integer('updates', 300, 'Server updates per measurement.')
_ROUNDS = flags.DEFINE_integer('rounds', 5, 'Interleaved rounds (the median is printed).')
_MODELS = flags.DEFINE_list('models', ['digits', 'wide', 'mnist1d'], 'Models: digits, wide, mnist1d.')

WORKERS = 4


def model_config(name: str):
  """The `async` config of model `name` on the Ray runtime, P = 4 learners."""
  if name == 'mnist1d':
    config = mnist1d.get_config('async,runtime=ray,workers=4')
  else:
    config = digits.get_config('async,runtime=ray,workers=4')
    if name == 'wide':
      config.model.hidden_sizes = (1024, 1024)
  config.num_steps = 10**9  # never finished: the measurement decides how many updates run
  config.eval_every = config.checkpoint_every = config.log_every = 10**9
  return config


def gradient_of(server: server_lib.Server):
  """A gradient sum shaped like the model (host arrays), as a learner pushes it."""
  return jax.tree.map(lambda x: np.full(x.shape, 1e-6, x.dtype), server.core.current)


def time_jit(core: server_lib.ServerCore, updates: int) -> float:
  """Seconds per call of the jitted update alone on fixed inputs (one learner pushed)."""
  schedule = server_lib.ps.schedule(WORKERS, 1, 1, np.eye(WORKERS, dtype=np.int32)[0])
  per_worker, uniform = schedules.split(schedule)
  uniform = {k: np.asarray(v) for k, v in uniform.items()}
  grads = jax.tree.map(np.zeros_like, core._zeros)
  losses = np.zeros(WORKERS, np.float32)
  state = core.state
  state, _ = core._update(state, grads, losses, per_worker, uniform)
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(updates):
    state, out = core._update(state, grads, losses, per_worker, uniform)
  jax.block_until_ready((state, out))
  core.state = state
  return (time.perf_counter() - start) / updates


def time_direct(server: server_lib.Server, gradient, updates: int) -> float:
  """Seconds per whole in-process server update (`Server.push` of the K = 1 gradient)."""
  start = time.perf_counter()
  for _ in range(updates):
    reply = server.reply(0)
    server.push(0, reply.version, reply.position, gradient, 0.0)
  jax.block_until_ready(server.core.state)
  return (time.perf_counter() - start) / updates


def time_ray(actor, gradient, updates: int) -> float:
  """Seconds per update pushed to the server actor and answered, as a learner does."""
  import ray
  reply = ray.get(actor.fetch.remote(0))
  start = time.perf_counter()
  for _ in range(updates):
    reply = ray.get(actor.push.remote(0, reply.version, reply.position, gradient, 0.0, {}))
  return (time.perf_counter() - start) / updates


def main(argv):
  cli.no_positionals(argv)
  import ray
  driver.start_local(num_cpus=2)
  print(f'{jax.devices()[0].device_kind}; P = {WORKERS} learners (async), {_UPDATES.value} updates per figure, '
        f'median of {_ROUNDS.value} interleaved rounds')
  print('| model | parameters | jit (ms) | direct (ms) | ray (ms) | ray / jit | ray / direct | Ray layer (ms) |')
  print('| --- | --- | --- | --- | --- | --- | --- | --- |')
  for name in _MODELS.value:
    config = model_config(name)
    server = server_lib.Server(config)
    gradient = gradient_of(server)
    actor = ray.remote(server_lib.ServerActor).options(num_cpus=0).remote(config)
    ray.get(actor.ready.remote())
    time_ray(actor, gradient, 20)  # warm-up: the actor's first update compiles
    time_direct(server, gradient, 20)
    figures = {'jit': [], 'direct': [], 'ray': []}
    for _ in range(_ROUNDS.value):
      figures['jit'].append(time_jit(server.core, _UPDATES.value))
      figures['direct'].append(time_direct(server, gradient, _UPDATES.value))
      figures['ray'].append(time_ray(actor, gradient, _UPDATES.value))
    ray.kill(actor)
    jit, direct, remote = (float(np.median(figures[k])) for k in ('jit', 'direct', 'ray'))
    params = sum(x.size for x in jax.tree.leaves(server.core.current))
    print(f'| {name} | {params:,} | {jit * 1e3:.3f} | {direct * 1e3:.3f} | {remote * 1e3:.3f} | '
          f'{remote / jit:.2f}x | {remote / direct:.2f}x | {(remote - direct) * 1e3:.3f} |')
  ray.shutdown()


if __name__ == '__main__':
  cli.run(main)
