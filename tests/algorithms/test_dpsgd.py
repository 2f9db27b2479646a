"""D-PSGD: both orders against a sequential float64 gossip loop, one and several workers per device; the
RingGossip time rule for both orders."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

from waitless.algorithms import dpsgd
from waitless.cluster.rules import dpsgd as dpsgd_rule
from tests import harness
from tests.algorithms import reference
from tests.algorithms import test_nonblocking
from tests.cluster import helpers

X = 0.01
NET = {'kind': 'alpha_beta', 'latency_s': 1e-3, 'bandwidth_gbps': 1.0}


def _f64(arg, **overrides):
  return harness.synthetic_config(arg, **{'model.param_dtype': 'float64', 'model.dtype': 'float64', **overrides})


class DPSGDMathTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('gossip_then_step', 'gossip_then_step', {}),
      ('overlap', 'overlap', {}),
      ('gossip_then_step_momentum_eight_on_two', 'gossip_then_step',
       {'optimizer.momentum': 0.9, 'workers': 8, 'devices': 2, 'microbatches': 2}),
      ('overlap_momentum_eight_on_four', 'overlap', {'optimizer.momentum': 0.9, 'workers': 8, 'devices': 4}),
      ('overlap_two_workers', 'overlap', {'workers': 2, 'devices': 2}),
      ('gossip_then_step_one_worker', 'gossip_then_step', {'workers': 1, 'devices': 1}),
  )
  def test_matches_sequential_gossip_loop(self, order, overrides):
    iterations, block = 9, 3
    with jax.enable_x64(True):
      config = _f64(f'dpsgd,order={order}', **{'stragglers.kind': 'exponential', **overrides})
      traj = harness.run_iterations(config, iterations, block=block)
    p, m = config.workers, config.microbatches
    models = [list(reference.unpack(traj.initial_params, i)) for i in range(p)]
    opts = [reference.MomentumSGD(config.optimizer.learning_rate, config.optimizer.momentum) for _ in range(p)]
    for t in range(iterations):
      np.testing.assert_array_equal(traj.positions[t], t * m)
      grads = []
      for i in range(p):
        per_mb = test_nonblocking._microbatch_gradients(traj.run, i, t * m, m, models[i])
        grads.append([sum(g[k] for g in per_mb) / m for k in range(2)])
      if order == 'gossip_then_step':
        # Params hold the mixed model: a step at it, then a mix of the stepped models.
        stepped = [opts[i].step(models[i], grads[i]) for i in range(p)]
        models = [test_nonblocking.mix(stepped, i) for i in range(p)]
      else:
        # W_i <- mix(W)_i + U(g_i(W_i)), U's update = step(W_i) - W_i.
        mixed = [test_nonblocking.mix(models, i) for i in range(p)]
        moved = [opts[i].step(models[i], grads[i]) for i in range(p)]
        models = [[mixed[i][k] + moved[i][k] - models[i][k] for k in range(2)] for i in range(p)]
      if (t + 1) % block:
        continue
      reference.assert_workers_match(traj.params[t // block], models, f'iteration {t}')
    if p > 2:
      kernel = traj.params[-1]['Dense_0']['kernel']
      self.assertGreater(np.abs(kernel[0] - kernel[1]).max(), 1e-8, 'models never differed')

  def test_nonblocking_ring_without_stragglers_is_dpsgd(self):
    with jax.enable_x64(True):
      nb = harness.run_iterations(_f64('nonblocking,topology=ring', microbatches=2, workers=8, devices=4,
                                       **{'optimizer.momentum': 0.9}), 6, block=3)
      dp = harness.run_iterations(_f64('dpsgd', microbatches=1, workers=8, devices=4,
                                       **{'optimizer.momentum': 0.9}), 6, block=3)
    for a, b in zip(nb.params, dp.params):
      jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14), a, b)

  def test_one_worker_is_the_inner_optimizer(self):
    params = {'w': jnp.array([1.0, -2.0])}
    grads = {'w': jnp.array([0.5, 0.25])}
    inner = optax.sgd(0.1, momentum=0.9)
    want, _ = inner.update(grads, inner.init(params), params)
    for order in dpsgd.ORDERS:
      tx = dpsgd.dpsgd(inner, order=order)
      got, _ = tx.update(grads, tx.init(params), params)
      np.testing.assert_allclose(got['w'], want['w'], rtol=1e-5)

  def test_ring_mix_under_vmap(self):
    x = jnp.arange(5.0)
    mixed = jax.vmap(lambda v: dpsgd.ring_mix(v, 'w'), axis_name='w')(x)
    np.testing.assert_allclose(mixed, (np.roll(x, 1) + x + np.roll(x, -1)) / 3, rtol=1e-6)

  def test_unknown_order(self):
    with self.assertRaisesRegex(ValueError, 'order'):
      dpsgd.dpsgd(optax.sgd(0.1), order='later')


class RingGossipRuleTest(absltest.TestCase):

  def test_overlap_hides_the_exchange_under_compute(self):
    # Constant compute 2X, slow network: gossip_then_step pays 2 exchanges after compute, overlap only what
    # the exchange takes beyond the compute.
    for exchange_bigger in (False, True):
      net = dict(NET, bandwidth_gbps=0.05 if exchange_bigger else 1.0)
      then = helpers.clock(dpsgd_rule.RingGossip(2), workers=8, base_s=X, network=net)
      over = helpers.clock(dpsgd_rule.RingGossip(2, order='overlap'), workers=8, base_s=X, network=net)
      p2p = then.network.p2p(then.model_bytes)
      np.testing.assert_allclose(then.next_block(5).duration, 2 * X + 2 * p2p, rtol=1e-12)
      got = over.next_block(5)
      np.testing.assert_allclose(got.duration, max(2 * X, p2p), rtol=1e-12)
      np.testing.assert_allclose(got.bytes_communicated, 8 * 2 * then.model_bytes)
      self.assertEqual(p2p > 2 * X, exchange_bigger)

  def test_overlap_waits_for_the_neighbours_start(self):
    # Worker 0 is 3x slower. Iteration 0: everyone starts at 0, nobody waits on an ideal network.
    # Iteration 1: workers 1 and 7 start at X but need worker 0's model, sent when it starts (3X).
    net = {'kind': 'alpha_beta', 'latency_s': 1e-3, 'bandwidth_gbps': 1e6}
    clock = helpers.clock(dpsgd_rule.RingGossip(order='overlap'), workers=8, base_s=X, slow_workers=(0,),
                          slow_factor=3.0, network=net)
    a = 1e-3 + clock.model_bytes * 8 / 1e15
    clock.next_block(1)
    np.testing.assert_allclose(clock.times, [3 * X] + [X] * 7)
    block = clock.next_block(1)
    want = np.array([6 * X, 3 * X + a, 2 * X, 2 * X, 2 * X, 2 * X, 2 * X, 3 * X + a])
    np.testing.assert_allclose(clock.times, want, rtol=1e-12)
    np.testing.assert_allclose(block.idle[0], want - np.array([6 * X] + [2 * X] * 7), atol=1e-15)


if __name__ == '__main__':
  absltest.main()
