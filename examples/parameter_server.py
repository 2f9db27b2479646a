"""The parameter-server family (K-sync, K-async, K-batch, async, Ringmaster, AdaSync) in your own loop.

    python examples/parameter_server.py

These algorithms differ only in who pushes a gradient into each server update and who fetches the new model:
facts of time, which the simulator's time rule writes into a `ServerSchedule` for every iteration. The
transformation (`parameter_server.parameter_server`) keeps an identical copy of the server model W in every
worker's state (`state.server`, the model to evaluate: the registry's `consensus`), applies
W <- W + U(sum_i n_i g_i / sum_i n_i) over the learners that pushed, and moves each worker's params (its view)
to W_{t+1}, W_t or leaves it stale as the schedule says.

Outside the simulator nobody writes that schedule. Without one (`schedule=None`) every learner pushes and
fetches: synchronous SGD through a server, checked first below. To run, say, K-async on real hardware you pass
your own schedule each step, built on the host from measured times (here: a fixed choice of K learners); the
others keep their stale views. In one lock-step program every device still computes a gradient at every step and
waits for the all-reduce, so there is no saving in wall-clock time: that exists in simulated time only.
"""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from waitless.algorithms import parameter_server as ps  # noqa: E402
from waitless.cluster import schedules  # noqa: E402

K, LR = 4, 0.1
mesh = Mesh(np.array(jax.devices()), ('workers',))
n = mesh.size
per_worker, replicated = NamedSharding(mesh, P('workers')), NamedSharding(mesh, P())
tx = ps.parameter_server(optax.sgd(LR), axis_name='workers')


def loss(w, x, y):
  return jnp.mean((x @ w - y) ** 2)


def worker_step(w, opt_state, x, y, fields, uniform):
  w, opt_state, x, y, fields = jax.tree.map(lambda a: a[0], (w, opt_state, x, y, fields))
  schedule = None if fields is None else ps.ServerSchedule(**fields, **uniform)
  updates, opt_state = tx.update(jax.grad(loss)(w, x, y), opt_state, w, schedule=schedule)
  return jax.tree.map(lambda a: a[None], (optax.apply_updates(w, updates), opt_state))


step = jax.jit(jax.shard_map(worker_step, mesh=mesh, in_specs=(P('workers'),) * 5 + (P(),),
                             out_specs=P('workers')))
rng = np.random.default_rng(0)


def batch():
  x = rng.normal(size=(n, 16, 3)).astype(np.float32)
  return x, x @ np.array([1.0, -2.0, 0.5], np.float32)


def gradients(views, x, y):
  return np.stack([2 / 16 * x[i].T @ (x[i] @ views[i] - y[i]) for i in range(n)])


# No schedule: every learner pushes and fetches, which is synchronous SGD.
w = jax.device_put(jnp.zeros((n, 3)), per_worker)
opt_state = jax.device_put(jax.vmap(tx.init)(w), per_worker)
server = np.zeros(3)
for _ in range(3):
  x, y = batch()
  server = server - LR * gradients(np.asarray(w), x, y).mean(axis=0)
  w, opt_state = step(w, opt_state, jax.device_put(x, per_worker), jax.device_put(y, per_worker), None, {})
  np.testing.assert_allclose(np.asarray(w), np.broadcast_to(server, (n, 3)), rtol=1e-5, atol=1e-6)

# Your schedule: K learners push (and fetch the new model); the others keep computing on their stale views.
for t in range(6):
  pushed = np.zeros(n, np.int32)
  pushed[(np.arange(K) + t) % n] = 1  # the host's choice: e.g. the first K to finish, by measured time
  fields, uniform = schedules.split(ps.schedule(n, K, 1, pushed, refresh_view=pushed.astype(bool)))
  x, y = batch()
  views = np.asarray(w)
  server = server - LR * gradients(views, x, y)[pushed == 1].mean(axis=0)
  w, opt_state = step(w, opt_state, jax.device_put(x, per_worker), jax.device_put(y, per_worker),
                      jax.device_put(fields, per_worker), jax.device_put(uniform, replicated))
  np.testing.assert_allclose(np.asarray(opt_state.server)[0], server, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(w)[pushed == 0], views[pushed == 0])  # stale views stay
stale = int((np.asarray(w) != np.asarray(opt_state.server)).any(axis=1).sum())
print(f'server model after six {K}-of-{n} updates: {np.round(server, 3)}; {stale} learners hold stale views')
