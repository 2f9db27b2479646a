"""WAGMA-SGD and D-PSGD in your own loop: each worker averages with partners only, not with everyone.

    python examples/partner_exchange.py

D-PSGD averages each worker's model with its two ring neighbours after every local step: two point-to-point
exchanges instead of an all-reduce, and the workers' mean model moves exactly as the mean of their local steps.
WAGMA averages within groups of S workers (partners change each step, so information spreads in log2(P/S)
steps), and over all workers every `sync_every`-th step. Its default rule is its authors' (Shigangli/WAGMA-SGD):
worker i averages the group's models W(t), its own counted twice (divisor S + 1), then applies the step of the
gradient it took at W_i(t), so the exchange need not wait for the gradient. Without the simulator's schedule every
WAGMA group averages synchronously; what carries over to real hardware is that a group exchange talks to S - 1
partners, not to all P workers. P must be a power of two for WAGMA.
"""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from waitless.algorithms import dpsgd  # noqa: E402
from waitless.algorithms import wagma  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ('workers',))
n = mesh.size
per_worker = NamedSharding(mesh, P('workers'))
SYNC_EVERY = 4


def loss(w, x, y):
  return jnp.mean((x @ w - y) ** 2)


def make_step(tx):
  def worker_step(w, opt_state, x, y, t):
    w, opt_state, x, y = jax.tree.map(lambda a: a[0], (w, opt_state, x, y))
    updates, opt_state = tx.update(jax.grad(loss)(w, x, y), opt_state, w, step=t)
    return jax.tree.map(lambda a: a[None], (optax.apply_updates(w, updates), opt_state))
  return jax.jit(jax.shard_map(worker_step, mesh=mesh, in_specs=(P('workers'),) * 4 + (P(),),
                               out_specs=P('workers')))


rng = np.random.default_rng(0)
batches = [rng.normal(size=(n, 16, 3)).astype(np.float32) for _ in range(8)]
targets = [x @ np.array([1.0, -2.0, 0.5], np.float32) for x in batches]

# D-PSGD (order='gossip_then_step': the local step, then the mix with both neighbours): the mean model moves by
# the mean local step, since the mix keeps the mean.
tx = dpsgd.dpsgd(optax.sgd(0.05), axis_name='workers')
step = make_step(tx)
w = jax.device_put(jnp.asarray(rng.normal(size=(n, 3)), jnp.float32), per_worker)  # different starting points
opt_state = jax.device_put(jax.vmap(tx.init)(w), per_worker)
for t, (x, y) in enumerate(zip(batches, targets)):
  grads = np.stack([np.asarray(jax.grad(loss)(w[i], x[i], y[i])) for i in range(n)])
  want = np.asarray(w).mean(axis=0) - 0.05 * grads.mean(axis=0)
  w, opt_state = step(w, opt_state, jax.device_put(x, per_worker), jax.device_put(y, per_worker), jnp.int32(t))
  np.testing.assert_allclose(np.asarray(w).mean(axis=0), want, rtol=1e-5, atol=1e-5)
spread_dpsgd = float(np.ptp(np.asarray(w), axis=0).max())

# WAGMA, groups of 2 (partner i XOR mask, the mask moving every step), the authors' rule: W_i <- (2 W_i + W_j) / 3
# - lr g_i(W_i), and every SYNC_EVERY-th step W_i <- mean(W) - lr g_i(W_i).
tx = wagma.wagma(optax.sgd(0.05), group_size=2, sync_every=SYNC_EVERY, axis_name='workers')
step = make_step(tx)
w = jax.device_put(jnp.asarray(rng.normal(size=(n, 3)), jnp.float32), per_worker)
opt_state = jax.device_put(jax.vmap(tx.init)(w), per_worker)
for t, (x, y) in enumerate(zip(batches, targets)):
  before = np.asarray(w)
  grads = np.stack([np.asarray(jax.grad(loss)(w[i], x[i], y[i])) for i in range(n)])
  if (t + 1) % SYNC_EVERY == 0:
    average = np.broadcast_to(before.mean(axis=0), before.shape)
  else:
    (mask,) = wagma.group_masks(t, n, 2)
    average = (2 * before + before[np.arange(n) ^ mask]) / 3
  w, opt_state = step(w, opt_state, jax.device_put(x, per_worker), jax.device_put(y, per_worker), jnp.int32(t))
  np.testing.assert_allclose(np.asarray(w), average - 0.05 * grads, rtol=1e-5, atol=1e-5)
print(f'D-PSGD: the mean model moves by the mean local step (spread across workers {spread_dpsgd:.3f}); '
      f'WAGMA: each worker moved to its group average of W(t) plus its own step, the average over everyone '
      f'every {SYNC_EVERY}th step')
