"""Cluster profiles: the shipped files load, the clock charges their figures, explicit fields win, bad input."""

import copy
import json
import math
import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from waitless import config_errors as errors
from waitless.cluster import calibration
from waitless.cluster import factory
from waitless.cluster import network
from waitless.cluster import profiles
from waitless.cluster import registry
from waitless.cluster.rules import sync
from waitless.experiments.configs import arguments
from waitless.experiments.configs import mnist1d

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Round figures, so that the closed forms are easy to read.
PROFILE = {
    'version': 1, 'name': 'round',
    'compute': {'mnist1d/cnn1d': {'per_sample_s': {'value': 1e-4, 'source': 'test'},
                                  'overhead_s': {'value': 2e-3, 'source': 'test'}}},
    'network': {'allreduce': {'form': 'ring', 'latency_s': {'value': 1e-4, 'source': 'test'},
                              'bandwidth_gbps': {'value': 8.0, 'source': 'test'}},
                'p2p': {'latency_s': {'value': 5e-5, 'source': 'test'},
                        'bandwidth_gbps': {'value': 4.0, 'source': 'test'}}},
    'host_s': {'value': 3e-3, 'source': 'test'},
}


class ProfilesTest(parameterized.TestCase):

  def write(self, doc) -> str:
    path = os.path.join(self.create_tempdir().full_path, 'profile.json')
    with open(path, 'w') as f:
      json.dump(doc, f)
    return path

  def config(self, profile: str, arg: str = 'sync'):
    config = mnist1d.get_config(arg)
    config.cluster.profile = profile
    return config

  def test_shipped_profiles_load_and_cite_sources(self):
    self.assertContainsSubset(['dgx_h100', 'multinode_a100_hdr', 'commodity_10gbe'], profiles.names())
    for name in profiles.names():
      profile = profiles.load(name)  # every figure has a value and a source (parse checks both)
      self.assertIn('mnist1d/cnn1d', profile.compute, name)
      self.assertIn('digits/mlp', profile.compute, name)

  def test_sync_iteration_on_a_profile_is_the_closed_form(self):
    # One sync iteration: m calls of o + b s, the ring all-reduce of M bytes among P, then the host's time.
    config = self.config(self.write(PROFILE), 'sync,microbatches=2')
    p, m, b, nbytes = config.workers, 2, config.batch_size // 2, 1e5
    factory.validate(config)
    block = factory.make_clock(config, sync.Barrier(m), nbytes).next_block(20)
    allreduce = 2 * (p - 1) * 1e-4 + 2 * (p - 1) / p * nbytes * 8 / 8e9
    np.testing.assert_allclose(block.duration, m * (2e-3 + b * 1e-4) + allreduce + 3e-3, rtol=1e-12)

  def test_host_time_is_charged_once_per_iteration_for_a_vectorised_rule(self):
    # local SGD (vectorised) with host time runs one iteration at a time: H local steps, then one all-reduce.
    config = self.config(self.write(PROFILE), 'local_sgd,local_steps=4')
    rule = registry.time_rule(config)
    self.assertTrue(rule.vectorized)
    clock = factory.make_clock(config, rule, 1e5)
    self.assertGreater(clock.host_s, 0)
    block = clock.next_block(8)
    step = 2e-3 + config.batch_size * 1e-4 + 3e-3
    allreduce = network.Collectives(network.AlphaBeta(1e-4, 8.0), network.AlphaBeta(5e-5, 4.0)).allreduce(
        1e5, config.workers)
    np.testing.assert_allclose(block.duration, [step] * 3 + [step + allreduce] + [step] * 3 + [step + allreduce],
                               rtol=1e-12)

  def test_no_profile_is_the_ideal_network(self):
    config = self.config('')
    cost = factory.effective(config)
    self.assertIsInstance(cost.network, network.Ideal)
    self.assertEqual(cost.host_s, 0.0)
    self.assertEqual(cost.stragglers.base_s, config.stragglers.base_s)

  def test_profile_replaces_the_workload_files_values(self):
    config = self.config('dgx_h100')  # mnist1d.py sets base_s = 10 ms by hand: the profile replaces it
    figures = profiles.load('dgx_h100').compute['mnist1d/cnn1d']
    cost = factory.effective(config)
    self.assertAlmostEqual(cost.stragglers.base_s, config.batch_size * figures.per_sample_s)
    self.assertEqual(cost.stragglers.overhead_s, figures.overhead_s)
    self.assertEqual(cost.network, profiles.load('dgx_h100').network)

  def test_explicit_fields_win(self):
    # The config argument's pairs are explicit (arguments.apply_arg records them), as the programs record flags.
    config = self.config(self.write(PROFILE), 'sync,stragglers.overhead_s=0.001')
    arguments.mark_explicit(config, ['cluster.host_s', 'network.kind', 'optimizer.learning_rate'])
    config.cluster.host_s = 0.25
    config.network.kind = 'alpha_beta'
    self.assertEqual(config.cluster.explicit, ('stragglers.overhead_s', 'cluster.host_s', 'network.kind'))
    cost = factory.effective(config)
    self.assertEqual(cost.stragglers.overhead_s, 0.001)
    self.assertAlmostEqual(cost.stragglers.base_s, config.batch_size * 1e-4)  # the profile's per-sample part
    self.assertEqual(cost.host_s, 0.25)
    self.assertIsInstance(cost.network, network.AlphaBeta)

  def test_a_ray_config_charges_the_ray_push_where_the_profile_has_it(self):
    # network.ray_p2p (calibrate --ray_p2p_only) is the point-to-point link of runtime=ray; gloo's stays for
    # everything else, and an explicit network field still wins.
    doc = copy.deepcopy(PROFILE)
    doc['network']['ray_p2p'] = {'latency_s': {'value': 2e-3, 'source': 'test'},
                                 'bandwidth_gbps': {'value': 1.0, 'source': 'test'}}
    path = self.write(doc)
    ray = factory.effective(self.config(path, 'kasync,k=1,runtime=ray,workers=4'))
    self.assertAlmostEqual(ray.network.p2p(1e6), 2e-3 + 8e6 / 1e9)
    self.assertAlmostEqual(ray.network.allreduce(1e6, 4), profiles.load(path).network.allreduce(1e6, 4))
    spmd = factory.effective(self.config(path, 'kasync,k=1'))
    self.assertAlmostEqual(spmd.network.p2p(1e6), 5e-5 + 8e6 / 4e9)
    without = factory.effective(self.config(self.write(PROFILE), 'kasync,k=1,runtime=ray,workers=4'))
    self.assertAlmostEqual(without.network.p2p(1e6), 5e-5 + 8e6 / 4e9)
    config = self.config(path, 'kasync,k=1,runtime=ray,workers=4')
    config.network.kind, config.cluster.explicit = 'ideal', ['network.kind']
    self.assertEqual(factory.effective(config).network.p2p(1e6), 0.0)
    doc['network']['ray_p2p']['bandwidth_gbps']['value'] = -1.0
    with self.assertRaisesRegex(errors.ConfigError, 'ray_p2p.bandwidth_gbps'):
      profiles.load(self.write(doc))

  def test_the_ray_learners_share_is_charged_as_its_compute_at_its_hosts_factor(self):
    # ray_p2p.learner_s (calibrate --ray_learner_only): that much of a cycle's push and reply is the learner's own
    # CPU work; it leaves the two transfers (half each) and joins the job, so a slow learner pays it at its factor.
    doc = copy.deepcopy(PROFILE)
    doc['network']['ray_p2p'] = {'latency_s': {'value': 0.02, 'source': 'test'},
                                 'bandwidth_gbps': {'value': 0.1, 'source': 'test'},
                                 'learner_s': {'value': 0.03, 'source': 'test'}}
    path = self.write(doc)
    pairs = 'kasync,k=1,runtime=ray,workers=2,microbatches=2,batch_size=64'
    cost = factory.effective(self.config(path, pairs))
    self.assertAlmostEqual(cost.network.p2p(1e6), 0.02 - 0.015 + 8e6 / 1e8)
    self.assertAlmostEqual(cost.stragglers.overhead_s, 2e-3 + 0.03 / 2)  # per call, two calls a job
    plain = factory.effective(self.config(path, 'kasync,k=1,workers=2,microbatches=2,batch_size=64'))
    self.assertAlmostEqual(plain.stragglers.overhead_s, 2e-3)  # not a Ray config: nothing moved
    # A learner's cycle (its job of two calls, its push, its reply): with equal hosts what the link alone charged
    # (2 x (job + 2 x the link's p2p) of the two learners), with one at factor 2 learner_s longer for that one.
    def cycles(slow):
      config = self.config(path, pairs)
      config.stragglers.worker_factors = (1.0, slow)
      clock = factory.make_clock(config, registry.time_rule(config), 1e6)
      return clock.work(np.arange(2), 0.0, 2) + 2 * clock.network.p2p(1e6)
    job, link = 2 * (2e-3 + 32 * 1e-4), 2 * (0.02 + 8e6 / 1e8)
    np.testing.assert_allclose(cycles(1.0), [job + link] * 2)
    np.testing.assert_allclose(cycles(2.0), [job + link, 2 * job + link + 0.03])
    doc['network']['ray_p2p']['learner_s']['value'] = -0.01
    with self.assertRaisesRegex(errors.ConfigError, 'ray_p2p.learner_s'):
      profiles.load(self.write(doc))

  def test_explicit_distribution_keeps_its_scale(self):
    config = self.config(self.write(PROFILE), 'sync,stragglers.kind=exponential,stragglers.rate=50.0')
    cost = factory.effective(config)
    self.assertEqual((cost.stragglers.rate, cost.stragglers.overhead_s), (50.0, 2e-3))

  def test_a_distribution_is_rescaled_to_the_profiles_mean(self):
    config = self.config(self.write(PROFILE), 'sync')
    config.stragglers.kind = 'exponential'  # a workload file's choice, not explicit: the profile sets the scale
    cost = factory.effective(config)
    self.assertAlmostEqual(1 / cost.stragglers.rate, config.batch_size * 1e-4)

  def test_a_delay_in_calls_follows_the_profiles_call(self):
    # stragglers=heterogeneous delays one worker per iteration by three calls: 30 ms on mnist1d.py's hand-set
    # 10 ms, three of the profile's calls (o + b s) on a profile, not 30 ms against a sub-millisecond call.
    config = self.config(self.write(PROFILE), 'sync,stragglers=heterogeneous')
    factory.validate(config)
    cost = factory.effective(config)
    call = cost.stragglers.overhead_s + cost.stragglers.base_s
    self.assertAlmostEqual(factory.delay_seconds(cost.stragglers, config.workers), 3 * call, places=12)
    clock = factory.make_clock(config, sync.Barrier(), 1e5)
    self.assertAlmostEqual(clock.delay.delay_s, 3 * call, places=12)
    no_profile = mnist1d.get_config('sync,stragglers=heterogeneous')
    self.assertEqual(factory.make_clock(no_profile, sync.Barrier(), 1e5).delay.delay_s, 0.03)
    # A delay in seconds stays what it says on every profile.
    seconds = self.config(self.write(PROFILE), 'sync,stragglers=heterogeneous,stragglers.delay_s=0.03')
    self.assertEqual(factory.make_clock(seconds, sync.Barrier(), 1e5).delay.delay_s, 0.03)

  def bad(self, edit):
    doc = copy.deepcopy(PROFILE)
    edit(doc)
    return self.write(doc)

  @parameterized.named_parameters(
      ('missing_field', lambda d: d['network']['p2p'].pop('latency_s'), r'network\.p2p\.latency_s=.missing'),
      ('negative_field', lambda d: d['host_s'].update(value=-1.0), r'host_s\.value=-1\.0 .*>= 0'),
      ('zero_bandwidth', lambda d: d['network']['allreduce']['bandwidth_gbps'].update(value=0),
       r'network\.allreduce\.bandwidth_gbps\.value=0 .*>= 0\.001'),
      # Issue 59: a node of the wrong type, figures past physical bounds, a bool for the version.
      ('allreduce_a_list', lambda d: d['network'].update(allreduce=[1, 2]),
       r'network\.allreduce=\[1, 2\] .*JSON object'),
      ('allreduce_a_string', lambda d: d['network'].update(allreduce='ring'),
       r"network\.allreduce='ring' .*JSON object"),
      ('network_a_list', lambda d: d.update(network=[]), r'network=\[\] .*JSON object'),
      ('huge_host_time', lambda d: d['host_s'].update(value=1e308), r'host_s\.value=1e\+308 .*<= 3600'),
      ('tiny_bandwidth', lambda d: d['network']['p2p']['bandwidth_gbps'].update(value=1e-320),
       r'network\.p2p\.bandwidth_gbps\.value=1e-320 .*>= 0\.001'),
      ('huge_latency', lambda d: d['network']['p2p']['latency_s'].update(value=50.0),
       r'network\.p2p\.latency_s\.value=50\.0 .*<= 1'),
      ('version_a_bool', lambda d: d.update(version=True), r'version=True .*versions 1 and 2'),
      ('no_source', lambda d: d['host_s'].pop('source'), r'host_s\.source=None .*cites'),
      ('unknown_version', lambda d: d.update(version=7), r'version=7 .*versions 1 and 2'),
      ('unknown_form', lambda d: d['network']['allreduce'].update(form='star'),
       r'network\.allreduce\.form=.star.*ring, tree'),
      ('another_model', lambda d: d.update(compute={'digits/mlp': d['compute']['mnist1d/cnn1d']}),
       r"compute='mnist1d/cnn1d' .*written for digits/mlp"),
  )
  def test_bad_profile_file(self, edit, message):
    config = self.config(self.bad(edit))
    with self.assertRaisesRegex(errors.ConfigError, r'^cluster\.profile\[.*\]\.' + message):
      factory.validate(config)

  @parameterized.named_parameters(
      ('missing_field', lambda d: d['network']['p2p'].pop('latency_s'), r'network\.p2p\.latency_s=.missing'),
      ('negative_field', lambda d: d['host_s'].update(value=-1.0), r'host_s\.value=-1\.0 .*>= 0'),
      ('another_model', lambda d: d.update(compute={'digits/mlp': d['compute']['mnist1d/cnn1d']}),
       r"compute='mnist1d/cnn1d' .*written for digits/mlp"),
  )
  def test_a_program_given_a_bad_profile_file_says_one_line_and_exits_2(self, edit, message):
    path = self.bad(edit)
    out = subprocess.run([sys.executable, '-m', 'waitless.experiments.simulate',
                          '--config=experiments/configs/mnist1d.py:sync', f'--config.cluster.profile={path}',
                          '--iterations=5', '--model_bytes=10'], cwd=ROOT, capture_output=True, text=True,
                         check=False, env=dict(os.environ, PYTHONPATH=ROOT))
    self.assertEqual(out.returncode, 2, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    self.assertLen(lines, 1, out.stderr)
    self.assertRegex(lines[0], r'^error: cluster\.profile\[.*\]\.' + message)

  def test_deeply_nested_json_is_one_line(self):
    path = os.path.join(self.create_tempdir().full_path, 'deep.json')
    with open(path, 'w') as f:
      f.write('[' * 100000 + ']' * 100000)
    with self.assertRaisesRegex(errors.ConfigError, r'^cluster\.profile=.*nests too deeply'):
      factory.validate(self.config(path))

  def test_unknown_name_lists_the_shipped_ones(self):
    with self.assertRaisesRegex(errors.ConfigError, r"cluster\.profile='nowhere' .*shipped: .*dgx_h100"):
      factory.validate(self.config('nowhere'))

  def test_missing_file(self):
    with self.assertRaisesRegex(errors.ConfigError, 'file not found'):
      factory.validate(self.config('/no/such/profile.json'))

  def test_refused_with_measured_time_and_calibrate(self):
    config = self.config('dgx_h100', 'sync,stragglers.kind=measured')
    with self.assertRaisesRegex(errors.ConfigError, 'real devices'):
      factory.validate(config)
    config = self.config('dgx_h100', 'sync,stragglers.calibrate=True')
    with self.assertRaisesRegex(errors.ConfigError, 'stragglers.calibrate'):
      factory.validate(config)

  def test_per_cpu_gives_a_slow_hosts_measured_factor(self):
    # Issue 56: a host at half the quota was 2.2x slower, not 2x; calibrate measures each quota's compute.
    doc = copy.deepcopy(PROFILE)
    doc['compute']['mnist1d/cnn1d']['per_cpu'] = {'0.4': {'value': 2.2e-4, 'source': 'test'},
                                                  '0.8': {'value': 1e-4, 'source': 'test'}}
    compute = profiles.load(self.write(doc)).compute_for('mnist1d/cnn1d')
    self.assertEqual(compute.per_cpu, ((0.8, 1e-4), (0.4, 2.2e-4)))
    self.assertSequenceAlmostEqual(profiles.quota_factors(compute, [0.8, 0.4]), (1.0, 2.2))
    self.assertSequenceAlmostEqual(profiles.quota_factors(compute, [0.4, 0.4]), (1.0, 1.0))
    self.assertIsNone(profiles.quota_factors(compute, [0.8, 0.2]))  # 0.2 not measured: the caller's fallback
    self.assertIsNone(profiles.quota_factors(profiles.load(self.write(PROFILE)).compute_for('mnist1d/cnn1d'),
                                             [0.8, 0.4]))

  @parameterized.named_parameters(
      ('bad_cores', {'fast': {'value': 1e-4, 'source': 'test'}}, r'per_cpu=.fast. .*cores'),
      ('zero_cores', {'0': {'value': 1e-4, 'source': 'test'}}, r'per_cpu=.0. .*cores'),
      ('no_source', {'0.8': {'value': 1e-4}}, r'per_cpu\.0\.8\.source=None'),
      ('not_an_object', [1], r'per_cpu=\[1\] .*JSON object'),
  )
  def test_bad_per_cpu(self, per_cpu, message):
    doc = copy.deepcopy(PROFILE)
    doc['compute']['mnist1d/cnn1d']['per_cpu'] = per_cpu
    with self.assertRaisesRegex(errors.ConfigError, message):
      profiles.load(self.write(doc))

  def test_negative_host_time(self):
    config = self.config('')
    config.cluster.host_s = -1.0
    with self.assertRaisesRegex(errors.ConfigError, 'cluster.host_s'):
      factory.validate(config)


class CollectivesTest(absltest.TestCase):

  def test_ring_tree_and_p2p(self):
    ar, pp = network.AlphaBeta(1e-5, 80.0), network.AlphaBeta(2e-5, 40.0)
    ring, tree = network.Collectives(ar, pp, 'ring'), network.Collectives(ar, pp, 'tree')
    nbytes, n = 1e6, 8
    volume = 2 * (n - 1) / n * nbytes * 8 / 80e9
    self.assertAlmostEqual(ring.allreduce(nbytes, n), 14 * 1e-5 + volume)
    self.assertAlmostEqual(tree.allreduce(nbytes, n), 2 * math.ceil(math.log2(n)) * 1e-5 + volume)
    self.assertEqual(ring.allreduce(nbytes, 1), 0.0)
    self.assertAlmostEqual(ring.p2p(nbytes), 2e-5 + nbytes * 8 / 40e9)
    self.assertEqual(ring.latency(), 2e-5)

  def test_fit_alpha_beta_recovers_the_ring(self):
    n = np.array([2, 2, 2, 4, 4, 4])
    m = np.array([1e3, 1e6, 1e7] * 2)
    t = 2 * (n - 1) * 3e-4 + 2 * (n - 1) / n * m * 2e-9
    alpha, per_byte = calibration.fit_alpha_beta(2 * (n - 1), 2 * (n - 1) / n * m, t)
    self.assertAlmostEqual(alpha / 3e-4, 1.0)
    self.assertAlmostEqual(per_byte / 2e-9, 1.0)
    with self.assertRaisesRegex(ValueError, 'two or more volumes'):
      calibration.fit_alpha_beta([2, 2], [1e3, 1e3], [1e-3, 1e-3])

  def test_fit_alpha_beta_weighs_relative_errors(self):
    # 10% noise on the 64 MB time moves the latency little: a relative fit, not the largest size's absolute noise.
    m = np.array([4e3, 6.4e4, 1e6, 1.6e7, 6.4e7])
    t = 1e-3 + m * 1e-9
    t[-1] *= 1.1
    alpha, _ = calibration.fit_alpha_beta(np.ones(5), m, t)
    self.assertBetween(alpha, 0.9e-3, 1.1e-3)


if __name__ == '__main__':
  absltest.main()
