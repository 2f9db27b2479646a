"""`python -m waitless.experiments.calibrate`: a profile measured on this machine, readable by every program."""

import json
import os
import subprocess
import sys

from unittest import mock

from absl.testing import absltest
import numpy as np
import pytest

from waitless import config_errors as errors
from waitless.cluster import network as network_lib
from waitless.cluster import profiles
from waitless.cluster import stacks
from waitless.experiments import calibrate
from waitless.experiments import simulate
from waitless.experiments.harness import measure
from waitless.experiments.configs import digits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args):
  return subprocess.run([sys.executable, '-m', 'waitless.experiments.calibrate', *args], cwd=ROOT,
                        capture_output=True, text=True, check=False, env=dict(os.environ, PYTHONPATH=ROOT))


class CalibrateTest(absltest.TestCase):

  def test_one_process_cannot_measure_collectives(self):
    out = run('--config=experiments/configs/digits.py:sync', '--processes=1', '--out=/tmp/never.json')
    self.assertEqual(out.returncode, 2)
    self.assertRegex(out.stderr.strip(), r'^error: --processes=1 is not allowed: .*2 or more real processes')
    self.assertNotIn('Traceback', out.stderr)

  def test_bad_flags_are_refused_before_any_measurement(self):
    # Issue 59: a missing --out directory was a FileNotFoundError after minutes of measurements, one collective
    # size a ValueError after 80 s.
    tmp = self.create_tempdir().full_path
    for flags_, message in (
        ((f'--out={tmp}/missing/profile.json',), f'--out=.*{tmp}/missing does not exist'),
        ((f'--out={tmp}',), '--out=.* is not allowed: is a directory'),
        ((f'--out={tmp}/p.json', '--collective_sizes=4096'), r'--collective_sizes=.4096. .*two or more distinct'),
        ((f'--out={tmp}/p.json', '--collective_sizes=4096,abc'), r'--collective_sizes=.4096,abc. .*integers'),
        ((f'--out={tmp}/p.json', '--collective_sizes=0,4096'), r'--collective_sizes=.0,4096. .*integers >= 4'),
        ((f'--out={tmp}/p.json', '--processes=100000'), r'--processes=100000 is not allowed: .* JAX processes need'),
        ((f'--out={tmp}/p.json', 'extra'), r"unexpected argument\(s\) 'extra'"),
        ((f'--out={tmp}/p.json', '--config='), "--config='' is not allowed: name a config file")):
      out = run('--config=experiments/configs/digits.py:sync', *flags_)
      self.assertEqual(out.returncode, 2, out.stderr[-2000:])
      self.assertRegex(out.stderr.strip(), f'^error: {message}')
      self.assertNotIn('Traceback', out.stderr)
      self.assertLen(out.stderr.strip().splitlines(), 1)

  def test_the_docs_example_is_a_profile_every_program_reads(self):
    path = os.path.join(ROOT, 'docs', 'examples', 'this_machine.json')
    self.assertNotIn('this_machine', profiles.names())  # an example of calibrate's output, not a shipped cluster
    profile = profiles.load(path)
    config = digits.get_config('sync')
    config.cluster.profile = path
    result = simulate.simulate(config, iterations=10, nbytes=1e4)
    self.assertEqual(result['host_s'], profile.host_s)

  def test_process_counts_are_checked_before_any_measurement(self):
    self.assertEqual(calibrate.check_process_counts([]), [])  # the default: --processes alone, version 1
    self.assertEqual(calibrate.check_process_counts([4, 2, 3]), [2, 3, 4])
    for counts, message in (([1, 2], 'integers >= 2'), ([2, 2, 3], 'distinct'), ([3], 'two or more counts'),
                            ([2, 100000], 'JAX processes need')):
      with self.assertRaisesRegex(errors.ConfigError, f'^--process_counts=.* is not allowed: .*{message}'):
        calibrate.check_process_counts(counts)
    with mock.patch.object(calibrate.placement, 'hosts', return_value=3):  # the test bed: process i on host i
      self.assertEqual(calibrate.check_process_counts([2, 3]), [2, 3])
      with self.assertRaisesRegex(errors.ConfigError, r'^--process_counts=.2,3,4. .*test bed has 3 hosts'):
        calibrate.check_process_counts([2, 3, 4])
    with self.assertRaisesRegex(errors.ConfigError, '^--process_counts=.2,x. .*integers'):
      calibrate.parse_process_counts(['2', 'x'])
    # The program: one line naming the flag, status 2, before anything is measured.
    tmp = self.create_tempdir().full_path
    out = run('--config=experiments/configs/digits.py:sync', f'--out={tmp}/p.json', '--process_counts=2,1')
    self.assertEqual(out.returncode, 2, out.stderr[-2000:])
    self.assertRegex(out.stderr.strip(), r'^error: --process_counts=.2,1. is not allowed: .*>= 2')
    self.assertLen(out.stderr.strip().splitlines(), 1)
    self.assertFalse(os.path.exists(f'{tmp}/p.json'))
    out = run('--config=experiments/configs/digits.py:sync', f'--out={tmp}/p.json', '--process_counts=3,4')
    self.assertEqual(out.returncode, 2, out.stderr[-2000:])
    self.assertRegex(out.stderr.strip(), r'^error: --processes=2 is not allowed: must be one of --process_counts=3,4')

  def test_structured_network_from_several_counts_is_a_profile_every_program_reads(self):
    truth = stacks.Stack(library='gloo', gpus_per_node=1, inter=network_lib.AlphaBeta(8e-5, 3.0),
                         p2p_link=network_lib.AlphaBeta(6e-5, 5.0))
    sizes, rounds = (65536, 1048576, 4194304), 3
    noise = np.random.default_rng(0)
    # As collective_timing writes them: the run on n processes times the sub-meshes 2..n too (left out of the fit,
    # here made 10x slower so that a row of the wrong mesh would show).
    rows = {n: {'allreduce': [[r, k, m, truth.allreduce(m, k) * (1 + 0.02 * noise.standard_normal()) * (k == n or 10)]
                              for r in range(rounds) for k in range(2, n + 1) for m in sizes],
                'p2p': [[r, m, truth.p2p(m) * (1 + 0.02 * noise.standard_normal())]
                        for r in range(rounds) for m in sizes]}
            for n in (2, 3, 4)}
    harness = measure.HarnessRounds(loads=[0.5] * rounds, single_s=np.ones((rounds, 2)),
                                    collectives=[measure.HarnessTimes(2e-3, 1e-3, 1e-2)] * rounds)
    for counts in ((2, 3), (2, 3, 4)):
      network = calibrate.structured_network({n: rows[n] for n in counts}, rounds, 2, harness, 4e5, 'digits/mlp')
      self.assertEqual(network['library'], 'gloo')
      for figure in (network['inter']['latency_s'], network['inter']['bandwidth_gbps'],
                     network['p2p']['latency_s'], network['p2p']['bandwidth_gbps'], network['gpus_per_node']):
        self.assertIn('measured by experiments.calibrate', figure['source'])
      self.assertIn(f'{list(counts)} processes', network['inter']['bandwidth_gbps']['source'])
      path = os.path.join(self.create_tempdir().full_path, 'several.json')
      doc = {'version': profiles.STRUCTURED, 'name': 'several', 'network': network, 'host_s': {'value': 1e-4,
             'source': 'test'}, 'compute': {'digits/mlp': {'per_sample_s': {'value': 1e-6, 'source': 'test'},
                                                          'overhead_s': {'value': 1e-5, 'source': 'test'}}}}
      with open(path, 'w') as f:
        json.dump(doc, f)
      profile = profiles.load(path)
      self.assertIsInstance(profile.network, stacks.Stack)
      # The loaded all-reduce gives the fitted rows (each count's and size's median) within the fit's error.
      fitted = network['fit']
      bound = np.max(np.abs(fitted['relative_errors']))
      self.assertLess(bound, 0.05)
      self.assertLen(fitted['rows'], len(counts) * len(sizes))  # one per count and size: its own mesh's median
      for (n, m, seconds), error in zip(fitted['rows'], fitted['relative_errors']):
        self.assertIn(n, counts)
        self.assertAlmostEqual(profile.network.allreduce(m, int(n)) / seconds - 1, error, places=9)
      self.assertAlmostEqual(network['inter']['bandwidth_gbps']['value'], 3.0, delta=0.3)
      if len(counts) == 2:
        self.assertNotIn('holdout', network)
        self.assertIsNone(calibrate.holdout_line(network))
      else:
        holdout = network['holdout']
        self.assertEqual((holdout['held_out'], holdout['fitted_on']), (4, [2, 3]))
        self.assertEqual(sorted(holdout['relative_errors'], key=int), [str(m) for m in sizes])
        self.assertLess(holdout['mean_abs_error'], 0.05)
        self.assertAlmostEqual(holdout['mean_abs_error'],
                               np.mean(np.abs(list(holdout['relative_errors'].values()))))
        self.assertRegex(calibrate.holdout_line(network), r'^calibrate: hold-out: fitted on \[2, 3\] processes, 4 '
                         r'predicted within [0-9.]+% on average')
      config = digits.get_config('sync')
      config.cluster.profile = path
      result = simulate.simulate(config, iterations=10, nbytes=1e4)
      self.assertEqual(result['host_s'], profile.host_s)

  @pytest.mark.slow
  def test_writes_a_profile_every_program_reads(self):
    path = os.path.join(self.create_tempdir().full_path, 'here.json')
    out = run('--config=experiments/configs/digits.py:sync,microbatches=2', '--processes=2', f'--out={path}',
              '--rounds=1', '--repeats=3', '--harness_steps=20', '--harness_microbatches=2',
              '--collective_sizes=4096,4194304')
    self.assertEqual(out.returncode, 0, out.stderr[-3000:])
    with open(path) as f:
      doc = json.load(f)
    self.assertEqual(doc['version'], profiles.VERSION)
    entry = doc['compute']['digits/mlp']
    for figure in (entry['per_sample_s'], entry['overhead_s'], doc['host_s'], doc['network']['p2p']['latency_s'],
                   doc['network']['allreduce']['bandwidth_gbps']):
      self.assertContainsSubset(['value', 'spread', 'rounds', 'dropped', 'source'], figure)
      self.assertIn('measured by experiments.calibrate', figure['source'])
    self.assertLen(doc['network']['allreduce']['latency_s']['load'], 1)  # the load when the round started
    self.assertIn('2-process local SGD', doc['host_s']['source'])  # the host as the processes pay it
    profile = profiles.load(path)
    config = digits.get_config('sync')
    config.cluster.profile = path
    result = simulate.simulate(config, iterations=10, nbytes=1e4)
    self.assertEqual(result['host_s'], profile.host_s)


  def test_per_cpu_pools_the_hosts_of_one_quota(self):
    fits = [np.array([[1.0e-5, 1e-4], [1.1e-5, 1e-4]]), np.array([[1.2e-5, 1e-4]]), np.array([[2.4e-5, 2e-4]])]
    got = calibrate.per_cpu_figures(fits, [0.8, 0.8, 0.4], 512)
    self.assertEqual(list(got), ['0.8', '0.4'])
    self.assertEqual(got['0.8']['rounds'], [1.0e-5, 1.1e-5, 1.2e-5])  # hosts 0 and 1 pooled
    self.assertAlmostEqual(got['0.8']['value'], 1.1e-5)
    self.assertAlmostEqual(got['0.4']['value'], 2.4e-5)
    self.assertIn('host(s) [2] of 0.4 CPU', got['0.4']['source'])

  def test_host_compute_only_needs_the_test_bed(self):
    path = os.path.join(self.create_tempdir().full_path, 'p.json')
    with open(os.path.join(ROOT, 'docs', 'examples', 'testbed_174.json')) as f, open(path, 'w') as g:
      g.write(f.read())
    out = run('--config=experiments/configs/digits.py:sync', '--host_compute_only', f'--out={path}')
    self.assertEqual(out.returncode, 2, out.stderr[-2000:])
    self.assertRegex(out.stderr.strip(), r'^error: --host_compute_only=True is not allowed: needs the test bed')
    self.assertLen(out.stderr.strip().splitlines(), 1)
    out = run('--config=experiments/configs/digits.py:sync', '--host_compute_only', f'--out={path}.missing')
    self.assertEqual(out.returncode, 2, out.stderr[-2000:])
    self.assertRegex(out.stderr.strip(), r'^error: --out=.* must be an existing profile')

  def test_ray_p2p_fits_the_round_trip_to_two_messages_each_way(self):
    # Round trips of 2 x (1 ms + M / 10 MB/s): one direction 1 ms and 0.08 Gbit/s.
    sizes = [4096, 65536, 1048576]
    rows = [[2 * (1e-3 + s / 1e7) for s in sizes]] * 2
    got = calibrate.ray_p2p_figures(rows, sizes, 'here')
    self.assertAlmostEqual(got['latency_s']['value'], 1e-3)
    self.assertAlmostEqual(got['bandwidth_gbps']['value'], 0.08)
    self.assertIn('through Ray', got['latency_s']['source'])
    # With the runtime's own run: two learners, 0.1 s per update (a learner's cycle 0.2 s), jobs of 0.01 s: per
    # transfer 0.095 s, of which the 1 MB at 10 MB/s are 0.1048576 s -> 0; at 4096 bytes 0.0945904 s.
    got = calibrate.ray_p2p_figures(rows, sizes, 'here', [0.1, 0.1], 2, 0.01, 4096, [1.0, 1.0], 'm')
    self.assertAlmostEqual(got['latency_s']['value'], 0.095 - 4096 / 1e7)
    self.assertAlmostEqual(got['microbenchmark_latency_s']['value'], 1e-3)
    self.assertIn('cycle', got['latency_s']['source'])

  def test_ray_learner_share_is_what_slows_with_the_learners_quota(self):
    # Transfers of 0.17 s a cycle at the base quota, 0.02 s of it the learner's own work; at a quota twice as slow
    # (factor 2) a cycle is 2 x 0.0064 s of compute + 0.15 + 2 x 0.02 s: two learners, an update every half cycle.
    cycle = 2 * 0.0064 + 0.15 + 2 * 0.02
    got = calibrate.ray_learner_figure([cycle / 2] * 3, 2, 0.0064, 2.0, 0.17, [1.0] * 3, 'm', 'here', 0.4, 0.8)
    self.assertAlmostEqual(got['value'], 0.02)
    self.assertIn('0.4 CPU', got['source'])
    with self.assertRaisesRegex(errors.ConfigError, 'slower measured quota'):
      calibrate.ray_learner_figure([0.1], 2, 0.0064, 1.0, 0.17)

  def test_ray_p2p_only_adds_the_link_every_program_reads(self):
    # Off the bed, a local Ray: the figure a runtime=ray config's pushes are then charged (simulate).
    path = os.path.join(self.create_tempdir().full_path, 'p.json')
    with open(os.path.join(ROOT, 'docs', 'examples', 'testbed_174.json')) as f:
      doc = json.load(f)
    doc['network'].pop('ray_p2p', None)
    with open(path, 'w') as g:
      json.dump(doc, g)
    out = run('--config=experiments/configs/digits.py:sync', '--ray_p2p_only', '--rounds=1', '--ray_repeats=3',
              '--ray_sizes=4096,1048576', f'--out={path}')
    self.assertEqual(out.returncode, 0, out.stderr[-2000:])
    profile = profiles.load(path)
    self.assertIsNotNone(profile.ray_p2p)
    self.assertGreater(profile.ray_p2p.bandwidth_gbps, 0)
    self.assertEqual(profile.network, profiles.load(os.path.join(ROOT, 'docs', 'examples', 'testbed_174.json')).network)
    out = run('--config=experiments/configs/digits.py:sync', '--ray_p2p_only', '--ray_sizes=4096',
              f'--out={path}')
    self.assertEqual(out.returncode, 2, out.stderr[-2000:])
    self.assertRegex(out.stderr.strip(), r'^error: --ray_sizes=.* two distinct sizes')

  def test_allreduce_only_refits_an_existing_profile(self):
    out = run('--config=experiments/configs/digits.py:sync', '--allreduce_only', '--out=/nonexistent/p.json')
    self.assertEqual(out.returncode, 2, out.stderr[-2000:])
    self.assertRegex(out.stderr.strip(), r'^error: --out=')
    self.assertLen(out.stderr.strip().splitlines(), 1)

  def test_host_compute_fits_one_process_per_host(self):
    # Off the bed the processes run here; on it, process i in host i's cgroup (test_testbed checks the quotas).
    tmp = self.create_tempdir().full_path
    fits = measure.host_compute_fits('experiments/configs/digits.py:sync,batch_size=64', [], 2, 2, tmp)
    self.assertLen(fits, 2)
    for fit in fits:
      self.assertEqual(fit.shape, (2, 2))
      self.assertGreater(fit[0, 0], 0)


if __name__ == '__main__':
  absltest.main()
