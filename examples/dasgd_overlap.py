"""DaSGD in your own loop, one jitted call per round so that the all-reduce overlaps the next local steps.

    python examples/dasgd_overlap.py

DaSGD snapshots the model at the end of each round of tau local steps, all-reduces the snapshots, and applies
their mean d steps into the next round (W <- mean(s) + (W - s)): the all-reduce has d steps of compute to hide
behind. For XLA to overlap them, the round must be one program in which the all-reduce is issued
unconditionally: run the round's tau steps in one jitted function and pass each step its static
`round_position` (0..tau-1); the transformation then emits the all-reduce at position 0 and its use at position
d, without a conditional. With `round_position=None` (one call per step, as below for the check) the same
update runs behind a conditional on `step`, and nothing can overlap. The same recipe holds for local SGD,
DiLoCo and Streaming DiLoCo (`round_position` = step mod H).
"""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from waitless.algorithms import dasgd  # noqa: E402

TAU, DELAY, ROUNDS = 4, 2, 3
mesh = Mesh(np.array(jax.devices()), ('workers',))
n = mesh.size
per_worker = NamedSharding(mesh, P('workers'))
tx = dasgd.dasgd(optax.sgd(0.05), local_steps=TAU, delay=DELAY, axis_name='workers')


def loss(w, x, y):
  return jnp.mean((x @ w - y) ** 2)


def one_step(w, opt_state, x, y, t, position):
  updates, opt_state = tx.update(jax.grad(loss)(w, x, y), opt_state, w, step=t, round_position=position)
  return optax.apply_updates(w, updates), opt_state


def worker_round(w, opt_state, xs, ys, t0):  # xs: (1, TAU, b, 3), this worker's batches of one round
  w, opt_state, xs, ys = jax.tree.map(lambda a: a[0], (w, opt_state, xs, ys))
  for position in range(TAU):  # unrolled: static positions, so the round is one straight-line program
    w, opt_state = one_step(w, opt_state, xs[position], ys[position], t0 + position, position)
  return jax.tree.map(lambda a: a[None], (w, opt_state))


def worker_step(w, opt_state, x, y, t):  # the per-step program, for the check
  w, opt_state, x, y = jax.tree.map(lambda a: a[0], (w, opt_state, x, y))
  return jax.tree.map(lambda a: a[None], one_step(w, opt_state, x, y, t, None))


in_specs = (P('workers'),) * 4 + (P(),)
run_round = jax.jit(jax.shard_map(worker_round, mesh=mesh, in_specs=in_specs, out_specs=P('workers')),
                    donate_argnums=(0, 1))
run_step = jax.jit(jax.shard_map(worker_step, mesh=mesh, in_specs=in_specs, out_specs=P('workers')))

rng = np.random.default_rng(0)
xs = rng.normal(size=(ROUNDS, n, TAU, 16, 3)).astype(np.float32)
ys = xs @ np.array([1.0, -2.0, 0.5], np.float32)
w = jax.device_put(jnp.zeros((n, 3)), per_worker)
opt_state = jax.device_put(jax.vmap(tx.init)(w), per_worker)
w_step = jnp.zeros((n, 3))
state_step = jax.vmap(tx.init)(w_step)
for r in range(ROUNDS):
  w, opt_state = run_round(w, opt_state, xs[r], ys[r], jnp.int32(r * TAU))
  for k in range(TAU):
    w_step, state_step = run_step(w_step, state_step, xs[r][:, k], ys[r][:, k], jnp.int32(r * TAU + k))
np.testing.assert_allclose(np.asarray(w), np.asarray(w_step), rtol=1e-5, atol=1e-6)
print(f'{ROUNDS} rounds of {TAU} steps, the average applied {DELAY} steps late: one call per round equals one per '
      f'step; worker 0: {np.round(np.asarray(w)[0], 3)}')
