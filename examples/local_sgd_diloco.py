"""DiLoCo and local SGD in your own `shard_map` loop: H local steps, then one model all-reduce.

    python examples/local_sgd_diloco.py

Each worker steps its own copy of the model with the inner optimizer; every H-th step the copies are averaged
(local SGD) or their average is an outer step W_outer <- W_outer + OuterOpt(W_outer - mean W_i) that every worker
restarts from (DiLoCo; outer SGD at rate 1 without momentum is local SGD again, checked below). This saving is
real on any hardware: one all-reduce per H steps instead of one per step. The model to evaluate is the
algorithm's `consensus` (here the mean of the workers' parameters; the registry's spec says which for each
algorithm). `update` returns each worker's updates (new params - params), like any optax transformation.
"""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from waitless.algorithms import diloco  # noqa: E402
from waitless.algorithms import local_sgd  # noqa: E402
from waitless.cluster import registry  # noqa: E402

H = 4
mesh = Mesh(np.array(jax.devices()), ('workers',))  # one worker per device: check_vma stays on
n = mesh.size
per_worker = NamedSharding(mesh, P('workers'))


def loss(w, x, y):
  return jnp.mean((x @ w - y) ** 2)


def make_step(tx):
  def worker_step(w, opt_state, x, y, t):  # each block has a leading worker axis of 1
    w, opt_state, x, y = jax.tree.map(lambda a: a[0], (w, opt_state, x, y))
    # step: the replicated iteration number, so "average now?" is one real conditional for every worker.
    updates, opt_state = tx.update(jax.grad(loss)(w, x, y), opt_state, w, step=t)
    return jax.tree.map(lambda a: a[None], (optax.apply_updates(w, updates), opt_state))
  return jax.jit(jax.shard_map(worker_step, mesh=mesh, in_specs=(P('workers'),) * 4 + (P(),),
                               out_specs=P('workers')), donate_argnums=(0, 1))


def train(tx, steps=24):
  step = make_step(tx)
  w = jax.device_put(jnp.zeros((n, 3)), per_worker)
  opt_state = jax.device_put(jax.vmap(tx.init)(w), per_worker)
  rng = np.random.default_rng(0)
  for t in range(steps):
    x = rng.normal(size=(n, 16, 3)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], np.float32) + rng.normal(size=(n, 16)).astype(np.float32)
    w, opt_state = step(w, opt_state, jax.device_put(x, per_worker), jax.device_put(y, per_worker), jnp.int32(t))
    if t % H == H - 1:  # a round ended: every worker restarts from the same model
      np.testing.assert_allclose(np.asarray(w), np.broadcast_to(np.asarray(w)[0], w.shape), rtol=1e-6)
  return w, opt_state


inner = optax.sgd(0.05)
w, opt_state = train(diloco.diloco(inner, diloco.outer_optimizer(0.7, 0.9, nesterov=True), H, axis_name='workers'))
model = registry.get('diloco').consensus(w, opt_state)  # the model to evaluate
w_local, _ = train(local_sgd.local_sgd(inner, H, axis_name='workers'))
w_plain, _ = train(diloco.diloco(inner, optax.sgd(1.0), H, axis_name='workers'))
np.testing.assert_allclose(np.asarray(w_plain), np.asarray(w_local), rtol=1e-5, atol=1e-6)
x = np.random.default_rng(1).normal(size=(256, 3)).astype(np.float32)
y = x @ np.array([1.0, -2.0, 0.5], np.float32)
before, after = float(loss(jnp.zeros(3), x, y)), float(loss(model, x, y))
assert after < 0.5 * before, (before, after)
print(f'DiLoCo consensus after {24 // H} rounds: loss {before:.3f} -> {after:.3f}; outer SGD at rate 1 equals '
      'local SGD')
