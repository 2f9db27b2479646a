"""What the Ray layer costs per server update, against the same update called directly and against a hand-written
Ray parameter server.

  python -m benchmarks.ray_overhead [--updates=300 --rounds=5 --models=digits,mnist1d,wide,large --workers=4,64
                                    --noray]

For each model and learner count P, one process measures, in `--rounds` interleaved rounds (each round times
every figure once, one after another, so a round's figures share the machine's load):
  jit     the server's jitted update alone (`ServerCore._step`: `parameter_server.server_step` on the one model W
          the server holds), called back to back on the same inputs;
  direct  one whole server update in process (`Server.push` of the gradient and its norm, as a learner pushes
          them: the arrival bookkeeping, the gradient added to the update's total, the jitted update, the new
          model copied to the host for the replies);
  ray     the same push sent to a `ServerActor` on a local Ray and its reply received (`ray.get`), as a learner
          sends it: the direct path plus Ray's call, the serialisation of the gradient and of the model;
  plain   the pattern of Ray's parameter-server example, no harness: one `ParameterServer` actor holding W
          whose `apply_gradients(g)` runs a jitted `W - lr * g` and returns W; the same gradient pushed the same
          way (the learners' jitted gradient is the same in both, so only the server side is compared).
and, to say where ray - plain goes, by measurement:
  work    each server's own work in process: `direct` for ours, `ParameterServer.apply_gradients` called directly
          for the plain one;
  call    each server's Ray call with no work: an actor of the same kind (threaded for ours, a plain one for the
          plain) taking the same arguments and returning a reply of the same shape, stored in advance.
Each figure is the mean seconds per update of `--updates` updates (`async`, K = 1: one push per update); ray /
plain is taken per round (the pair measured side by side) and printed as the median over rounds with its
[min, max]. Prints, per model and P, the figures' medians, ray / plain (target: <= 1.5), ray - plain split into
work (ours - plain) and call (ours - plain) and what neither explains. Then, per model, the server's update at the
largest P over the smallest, jitted and whole (target: <= 1.2, the server holds one model whatever P is): in
process, the two servers timed in turn in every round, each figure about `SCALING_S` seconds of updates, the
median [min, max] of the per-round quotients (`--noray`: this alone).

Models, each with SGD without momentum (the plain server's update, so that what differs is what surrounds it):
`digits` (the digits MLP, 9,610 parameters), `mnist1d` (the MNIST-1D CNN of the quickstart), `wide` (an MLP of
64 -> 1024 -> 1024 -> 10, 1.1 M parameters), `large` (an MLP of 64 -> 4096 -> 4096 -> 1024 -> 10, about 21 M
parameters, the size of a ResNet-50's 25 M; lower --updates for it).
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
_RAY = flags.DEFINE_bool('ray', True, 'Measure through Ray (the table); --noray: only the in-process scaling.')

MODELS = ('digits', 'mnist1d', 'wide', 'large')


def model_config(name: str, workers: int):
  """The `async` config of model `name` on the Ray runtime, P = `workers` learners, SGD without momentum."""
  if name == 'mnist1d':
    config = mnist1d.get_config(f'async,runtime=ray,workers={workers}')
  else:
    config = digits.get_config(f'async,runtime=ray,workers={workers}')
    if name == 'wide':
      config.model.hidden_sizes = (1024, 1024)
    if name == 'large':
      config.model.hidden_sizes = (4096, 4096, 1024)
  # The plain server's update, W - lr g (SGD without momentum): what is compared is what surrounds the update.
  config.optimizer.momentum = 0.0
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
  """Seconds per whole in-process server update (`Server.push` of the K = 1 gradient, with its norm)."""
  start = time.perf_counter()
  for _ in range(updates):
    reply = server.reply(0)
    server.push(0, reply.version, reply.position, gradient, 0.0, {}, 0.0)
  jax.block_until_ready(server.core.params)
  return (time.perf_counter() - start) / updates


def time_ray(actor, gradient, updates: int) -> float:
  """Seconds per update pushed to the server actor (or `Echo`) and answered, as a learner does."""
  import ray
  reply = ray.get(actor.fetch.remote(0))
  start = time.perf_counter()
  for _ in range(updates):
    reply = ray.get(actor.push.remote(server_lib.Pushed(0, reply.version, reply.position, gradient, 0.0, {}, 0.0)))
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


class Echo:
  """A server that does no work: the Ray call of each server alone. `fetch` and `push` answer as `ServerActor`
  does (made remote threaded, as the driver makes it), `apply_gradients` as `ParameterServer` does (a plain
  actor), each with a reply stored in advance."""

  def __init__(self, params):
    self.params = params
    self.reply = server_lib.Reply(params, 0, 0, False)

  def fetch(self, learner):
    return self.reply

  def push(self, pushed):
    return self.reply

  def apply_gradients(self, gradient):
    return self.params

  def get_weights(self):
    return self.params


def time_plain(actor, gradient, updates: int) -> float:
  """Seconds per gradient pushed to the plain parameter server (or `Echo`) and its weights received."""
  import ray
  start = time.perf_counter()
  for _ in range(updates):
    ray.get(actor.apply_gradients.remote(gradient))
  return (time.perf_counter() - start) / updates


def time_in_process(plain: ParameterServer, gradient, updates: int) -> float:
  """Seconds per `ParameterServer.apply_gradients` called directly (the plain server's work)."""
  start = time.perf_counter()
  for _ in range(updates):
    plain.apply_gradients(gradient)
  return (time.perf_counter() - start) / updates


FIGURES = ('jit', 'direct', 'ray', 'plain', 'plain_work', 'call', 'plain_call')


def measure(name: str, workers: int, updates: int, rounds: int) -> dict[str, list[float]]:
  """Every figure of model `name` at P = `workers`, once per round: {figure: [seconds per update, per round]}."""
  import ray
  config = model_config(name, workers)
  server = server_lib.Server(config)
  gradient = gradient_of(server)
  lr = float(config.optimizer.learning_rate)
  threaded = {'num_cpus': 0, 'max_concurrency': server_lib.concurrency(config)}
  actor = ray.remote(server_lib.ServerActor).options(**threaded).remote(config)
  plain = ray.remote(ParameterServer).options(num_cpus=0).remote(server.core.current, lr)
  echo = ray.remote(Echo).options(**threaded).remote(server.core.current)
  plain_echo = ray.remote(Echo).options(num_cpus=0).remote(server.core.current)
  in_process = ParameterServer(server.core.current, lr)
  ray.get([actor.ready.remote(), plain.get_weights.remote(), echo.get_weights.remote(),
           plain_echo.get_weights.remote()])
  timers = {'jit': lambda n: time_jit(server.core, gradient, n), 'direct': lambda n: time_direct(server, gradient, n),
            'ray': lambda n: time_ray(actor, gradient, n), 'plain': lambda n: time_plain(plain, gradient, n),
            'plain_work': lambda n: time_in_process(in_process, gradient, n),
            'call': lambda n: time_ray(echo, gradient, n), 'plain_call': lambda n: time_plain(plain_echo, gradient, n)}
  for timer in timers.values():  # warm-up: the first updates compile, the actors' first calls connect
    timer(max(2, min(20, updates // 5)))
  figures = {k: [] for k in FIGURES}
  for _ in range(rounds):
    for k in FIGURES:
      figures[k].append(timers[k](updates))
  for a in (actor, plain, echo, plain_echo):
    ray.kill(a)
  figures['parameters'] = sum(x.size for x in jax.tree.leaves(server.core.current))
  return figures


def main(argv):
  cli.no_positionals(argv)
  sizes = cli.int_list(_WORKERS.value, '--workers', minimum=1)
  for name in _MODELS.value:
    if name not in MODELS:
      cli.refuse(f'--models={",".join(_MODELS.value)} is not allowed: {name} is not one of {", ".join(MODELS)}')
  if _ROUNDS.value < 1 or _UPDATES.value < 1:
    cli.refuse(f'--rounds={_ROUNDS.value} --updates={_UPDATES.value} is not allowed: both must be >= 1')
  if _RAY.value:
    table(sizes)
  if len(sizes) > 1:
    print(f'\nThe server\'s update at P = {sizes[-1]} over P = {sizes[0]}, in process, both servers timed in every '
          f'round ({_ROUNDS.value} rounds of about {SCALING_S:g} s per figure, median [min, max] of the per-round '
          'quotients):')
    for name in _MODELS.value:
      ratios = scaling(name, sizes[0], sizes[-1], _ROUNDS.value)
      print(f'{name}: jitted {cli.spread(ratios["jit"], ".2f")}x, whole (direct) '
            f'{cli.spread(ratios["direct"], ".2f")}x', flush=True)


def table(sizes) -> None:
  """The table of ours against the plain server, each model at each P."""
  import ray
  driver.start_local(num_cpus=2)
  print(f'{jax.devices()[0].device_kind}; async (K = 1), {_UPDATES.value} updates per figure, {_ROUNDS.value} '
        'interleaved rounds: median [min, max] over rounds, ray / plain paired per round')
  print('| model | parameters | P | jit (ms) | direct (ms) | ray (ms) | plain Ray PS (ms) | ray / plain | '
        'ray - plain (ms) | of which work (ms) | of which call (ms) | rest (ms) |')
  print('| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |')
  for name in _MODELS.value:
    for workers in sizes:
      f = measure(name, workers, _UPDATES.value, _ROUNDS.value)
      med = {k: float(np.median(f[k])) * 1e3 for k in FIGURES}
      ratio = np.asarray(f['ray']) / np.asarray(f['plain'])
      beyond = med['ray'] - med['plain']
      work = med['direct'] - med['plain_work']
      call = med['call'] - med['plain_call']
      print(f'| {name} | {f["parameters"]:,} | {workers} | {med["jit"]:.3f} | {med["direct"]:.3f} | '
            f'{cli.spread(f["ray"], ".3f", 1e3)} | {cli.spread(f["plain"], ".3f", 1e3)} | '
            f'{cli.spread(ratio, ".2f")}x | {beyond:.3f} | '
            f'{work:.3f} | {call:.3f} | {beyond - work - call:.3f} |', flush=True)
  ray.shutdown()


SCALING_S = 0.3  # seconds per figure of the in-process scaling: an update of a small model is tens of us


def scaling(name: str, low: int, high: int, rounds: int) -> dict[str, list[float]]:
  """The in-process server's update at P = `high` over P = `low` for model `name`, jitted and whole: both
  servers timed in every round (minutes apart, one P's figure and the other's met different loads), each figure
  about SCALING_S seconds of updates."""
  servers = {p: server_lib.Server(model_config(name, p)) for p in (low, high)}
  gradient = gradient_of(servers[low])
  for server in servers.values():
    time_direct(server, gradient, 3)
  updates = max(3, int(SCALING_S / time_direct(servers[low], gradient, 5)))
  ratios = {'jit': [], 'direct': []}
  for _ in range(rounds):
    t = {(p, k): (time_jit(server.core, gradient, updates) if k == 'jit' else time_direct(server, gradient, updates))
         for p, server in servers.items() for k in ('jit', 'direct')}
    for k in ratios:
      ratios[k].append(t[high, k] / t[low, k])
  return ratios


if __name__ == '__main__':
  cli.run(main)
