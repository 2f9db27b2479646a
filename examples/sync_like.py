"""Synchronous SGD as an optax transformation in your own `shard_map` loop, two workers per device.

    python examples/sync_like.py

`sync_sgd` all-reduces the gradients over the worker axes itself (do not average them again). Workers that share
a device are a `jax.vmap` axis inside the `shard_map`: pass both axis names, and `check_vma=False` to
`jax.shard_map` (JAX's varying-axes check does not know vmap axes; a collective over one fails under it). Outside
the simulator `ksync`, `kbatch_sync`, `kasync`, `kbatch_async`, `async`, `ringmaster` and `nonblocking` compute
exactly this update (see examples/parameter_server.py): their savings exist in simulated time only.
"""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')  # 8 CPU devices on a laptop

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from waitless.algorithms import sync  # noqa: E402

LOCAL = 2  # workers per device
mesh = Mesh(np.array(jax.devices()), ('workers',))
n = mesh.size * LOCAL  # worker w lives on device w // LOCAL
tx = sync.sync_sgd(optax.sgd(0.1), axis_name=('workers', 'local'))


def loss(w, x, y):
  return jnp.mean((x @ w - y) ** 2)


def worker_step(w, opt_state, x, y):  # one worker: no leading axis
  updates, opt_state = tx.update(jax.grad(loss)(w, x, y), opt_state, w)
  return optax.apply_updates(w, updates), opt_state


step = jax.jit(jax.shard_map(jax.vmap(worker_step, axis_name='local'), mesh=mesh, in_specs=P('workers'),
                             out_specs=P('workers'), check_vma=False), donate_argnums=(0, 1))
per_worker = NamedSharding(mesh, P('workers'))
w = jax.device_put(jnp.zeros((n, 3)), per_worker)
opt_state = jax.device_put(jax.vmap(tx.init)(w), per_worker)
reference = np.zeros(3)  # plain SGD on the workers' mean gradient
rng = np.random.default_rng(0)
for _ in range(20):
  x = rng.normal(size=(n, 16, 3)).astype(np.float32)
  y = x @ np.array([1.0, -2.0, 0.5], np.float32)
  w, opt_state = step(w, opt_state, jax.device_put(x, per_worker), jax.device_put(y, per_worker))
  grads = [2 / 16 * x[i].T @ (x[i] @ reference - y[i]) for i in range(n)]
  reference = reference - 0.1 * np.mean(grads, axis=0)

w = np.asarray(w)
np.testing.assert_allclose(w, np.broadcast_to(w[0], w.shape), rtol=1e-6)  # the copies stay identical
np.testing.assert_allclose(w[0], reference, rtol=1e-4, atol=1e-5)
print(f'{n} workers on {mesh.size} devices; w = {np.round(w[0], 4)}, equal to SGD on the mean gradient')
