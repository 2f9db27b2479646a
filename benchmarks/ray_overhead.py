"""What the Ray layer costs per server update, against the same update called directly and against a hand-written
Ray parameter server.

  python -m benchmarks.ray_overhead [--updates=300 --rounds=5 --models=digits,mnist1d,wide,large --workers=4,64]

For each model and learner count P, one process measures, in interleaved rounds:
  jit     the server's jitted update alone (`ServerCore._step`: `parameter_server.server_step` on the one model W
          the server holds), called back to back on the same inputs;
  direct  one whole server update in process (`Server.push`: the arrival bookkeeping, the gradient added to the
          update's total, the jitted update, the new model copied to the host for the replies);
  ray     the same push sent to a `ServerActor` on a local Ray and its reply received (`ray.get`), as a learner
          sends it: the direct path plus Ray's call, the serialisation of the gradient and of the model;
  plain   the pattern of Ray's parameter-server example, no harness: one `ParameterServer` actor holding W
          whose `apply_gradients(g)` runs a jitted `W - lr * g` and returns W; the same gradient pushed the same
          way (the learners' jitted gradient is the same in both, so only the server side is compared).
Each figure is the median over rounds of the mean seconds per update of `--updates` updates (`async`, K = 1: one
push per update). Prints, per model and P, the four figures, ray / plain (target: <= 1.5), ray / jit, and the
per-update cost of the harness beyond the plain server, ray - plain, in ms; then, per model, the jitted update's
time at the largest P over the smallest (target: <= 1.2, the server holds one model whatever P is).

Models: `digits` (the digits MLP, 9,610 parameters), `mnist1d` (the MNIST-1D CNN of the quickstart), `wide` (an
MLP of 64 -> 1024 -> 1024 -> 10, 1.1 M parameters), `large` (an MLP of 64 -> 4096 -> 4096 -> 1024 -> 10, about
21 M parameters, the size of a ResNet-50's 25 M; lower --updates for it).
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
from waitless.experiments.configs import digits
from waitless.experiments.configs import mnist1d
from waitless.experiments.harness.ray_runtime import driver
from waitless.experiments.harness.ray_runtime import server as server_lib

_UPDATES = flags.DEFINE_integer('updates', 300, 'Server updates per measurement.')
_ROUNDS = flags.DEFINE_integer('rounds', 5, 'Interleaved rounds (the median is printed).')
_MODELS = flags.DEFINE_list('models', ['digits', 'mnist1d', 'wide'], 'Models: digits, mnist1d, wide, large.')
_WORKERS = flags.DEFINE_list('workers', ['4', '64'], 'Learner counts P.')

MODELS = ('digits', 'mnist1d', 'wide', 'large')


def model_config(name: str, workers: int):
  """The `async` config of model `name` on the Ray runtime, P = `workers` learners."""
  if name == 'mnist1d':
    config = mnist1d.get_config(f'async,runtime=ray,workers={workers}')
  else:
    config = digits.get_config(f'async,runtime=ray,workers={workers}')
    if name == 'wide':
      config.model.hidden_sizes = (1024, 1024)
    if name == 'large':
      config.model.hidden_sizes = (4096, 4096, 1024)
  config.num_steps = 10**9  # never finished: the measurement decides how many updates run
  config.eval_every = config.checkpoint_every = config.log_every = 10**9
  return config


def gradient_of(server: server_lib.Server):
  """A gradient sum shaped like the model (host arrays), as a learner pushes it."""
  return jax.tree.map(lambda x: np.full(x.shape, 1e-6, x.dtype), server.core.current)


def time_jit(core: server_lib.ServerCore, gradient, updates: int) -> float:
  """Seconds per call of the jitted update alone on fixed inputs (one learner pushed)."""
  count = np.float32(core.config.microbatches)
  params, inner = core.params, core.inner
  params, inner = core._step(params, inner, gradient, count)
  jax.block_until_ready(params)
  start = time.perf_counter()
  for _ in range(updates):
    params, inner = core._step(params, inner, gradient, count)
  jax.block_until_ready((params, inner))
  core.params, core.inner = params, inner
  return (time.perf_counter() - start) / updates


def time_direct(server: server_lib.Server, gradient, updates: int) -> float:
  """Seconds per whole in-process server update (`Server.push` of the K = 1 gradient)."""
  start = time.perf_counter()
  for _ in range(updates):
    reply = server.reply(0)
    server.push(0, reply.version, reply.position, gradient, 0.0)
  jax.block_until_ready(server.core.params)
  return (time.perf_counter() - start) / updates


def time_ray(actor, gradient, updates: int) -> float:
  """Seconds per update pushed to the server actor and answered, as a learner does."""
  import ray
  reply = ray.get(actor.fetch.remote(0))
  start = time.perf_counter()
  for _ in range(updates):
    reply = ray.get(actor.push.remote(0, reply.version, reply.position, gradient, 0.0, {}, 0.0))
  return (time.perf_counter() - start) / updates


class ParameterServer:
  """Ray's documented parameter-server pattern (docs.ray.io, "Parameter Server"): an actor holding the weights,
  `apply_gradients` steps them with the pushed gradient and returns them; here `W - lr * g`, jitted."""

  def __init__(self, params, lr: float):
    self.params = jax.device_put(params)
    self._step = jax.jit(lambda w, g: jax.tree.map(lambda x, y: x - lr * y, w, g))

  def apply_gradients(self, gradient):
    self.params = self._step(self.params, gradient)
    return jax.device_get(self.params)

  def get_weights(self):
    return jax.device_get(self.params)


def time_plain(actor, gradient, updates: int) -> float:
  """Seconds per gradient pushed to the plain parameter server and its weights received."""
  import ray
  start = time.perf_counter()
  for _ in range(updates):
    ray.get(actor.apply_gradients.remote(gradient))
  return (time.perf_counter() - start) / updates


def main(argv):
  cli.no_positionals(argv)
  sizes = cli.int_list(_WORKERS.value, '--workers', minimum=1)
  for name in _MODELS.value:
    if name not in MODELS:
      cli.refuse(f'--models={",".join(_MODELS.value)} is not allowed: {name} is not one of {", ".join(MODELS)}')
  import ray
  driver.start_local(num_cpus=2)
  print(f'{jax.devices()[0].device_kind}; async (K = 1), {_UPDATES.value} updates per figure, median of '
        f'{_ROUNDS.value} interleaved rounds')
  print('| model | parameters | P | jit (ms) | direct (ms) | ray (ms) | plain Ray PS (ms) | ray / plain | ray / jit | '
        'beyond plain (ms) |')
  print('| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |')
  scaling = []
  for name in _MODELS.value:
    jits = {}
    for workers in sizes:
      config = model_config(name, workers)
      server = server_lib.Server(config)
      gradient = gradient_of(server)
      actor = ray.remote(server_lib.ServerActor).options(num_cpus=0).remote(config)
      plain = ray.remote(ParameterServer).options(num_cpus=0).remote(server.core.current,
                                                                      float(config.optimizer.learning_rate))
      ray.get([actor.ready.remote(), plain.get_weights.remote()])
      time_ray(actor, gradient, 20)  # warm-up: the actors' first updates compile
      time_plain(plain, gradient, 20)
      time_direct(server, gradient, 20)
      figures = {'jit': [], 'direct': [], 'ray': [], 'plain': []}
      for _ in range(_ROUNDS.value):
        figures['jit'].append(time_jit(server.core, gradient, _UPDATES.value))
        figures['direct'].append(time_direct(server, gradient, _UPDATES.value))
        figures['ray'].append(time_ray(actor, gradient, _UPDATES.value))
        figures['plain'].append(time_plain(plain, gradient, _UPDATES.value))
      ray.kill(actor)
      ray.kill(plain)
      jit, direct, remote, hand = (float(np.median(figures[k])) for k in ('jit', 'direct', 'ray', 'plain'))
      jits[workers] = jit
      params = sum(x.size for x in jax.tree.leaves(server.core.current))
      print(f'| {name} | {params:,} | {workers} | {jit * 1e3:.3f} | {direct * 1e3:.3f} | {remote * 1e3:.3f} | '
            f'{hand * 1e3:.3f} | {remote / hand:.2f}x | {remote / jit:.2f}x | {(remote - hand) * 1e3:.3f} |',
            flush=True)
      del server
    if len(sizes) > 1:
      scaling.append(f'{name}: jitted update at P = {sizes[-1]} / P = {sizes[0]}: '
                     f'{jits[sizes[-1]] / jits[sizes[0]]:.2f}x')
  for line in scaling:
    print(line)
  ray.shutdown()


if __name__ == '__main__':
  cli.run(main)
