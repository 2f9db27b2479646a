"""`cluster.slow_hosts`: a slow worker's factor slows its host work per iteration too (a slower host CPU, as the
test bed's quotas make), not only its compute; off by default (a slower accelerator on an equal host)."""

from absl.testing import absltest
from absl.testing import parameterized

from waitless.experiments import simulate
from waitless.experiments.configs import digits

HOST_S = 0.01


def _mean_iteration_s(name: str, slow_hosts, factors=(1.0, 2.0)) -> float:
  config = digits.get_config(f'{name},workers=2,devices=2')
  config.stragglers.worker_factors = factors
  config.cluster.host_s = HOST_S
  config.cluster.slow_hosts = slow_hosts
  return simulate.simulate(config, iterations=50, nbytes=4e4)['mean_iteration_time']


class SlowHostsTest(parameterized.TestCase):

  @parameterized.parameters('sync', 'local_sgd')
  def test_the_slow_host_pays_its_factor_of_host_time(self, name):
    # Lock-step: the iteration waits for the slow worker, whose host work is 2 x HOST_S instead of HOST_S.
    self.assertAlmostEqual(_mean_iteration_s(name, True) - _mean_iteration_s(name, False), HOST_S, places=9)

  def test_equal_hosts_are_unchanged(self):
    self.assertAlmostEqual(_mean_iteration_s('sync', True, (1.0, 1.0)), _mean_iteration_s('sync', False, (1.0, 1.0)),
                           places=12)


if __name__ == '__main__':
  absltest.main()
