"""The structured collective model (`cluster/stacks.py`): each library's formulas against hand computations, where
the library switches algorithm, the limits (P = 1, P = 2), and version 1 profiles giving the times they gave."""

import copy
import dataclasses
import json
import math
import os

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from waitless import config_errors as errors
from waitless.cluster import calibration
from waitless.cluster import network
from waitless.cluster import profiles
from waitless.cluster import stacks

GB = 1e9 / 8  # bytes per second of one Gbit/s


def mpich(**kw) -> stacks.Stack:
  base = dict(library='mpich', gpus_per_node=1, inter=network.AlphaBeta(2e-6, 80.0),
              p2p_link=network.AlphaBeta(2e-6, 80.0), reduce_gbps=32.0)
  base.update(kw)
  return stacks.Stack(**base)


def nccl(**kw) -> stacks.Stack:
  base = dict(library='nccl', gpus_per_node=1, inter=network.AlphaBeta(2e-6, 80.0),
              p2p_link=network.AlphaBeta(2e-6, 80.0))
  base.update(kw)
  return stacks.Stack(**base)


class MpichTest(parameterized.TestCase):

  def test_short_messages_take_recursive_doubling(self):
    s, m = mpich(), 2048.0
    algorithm, seconds = s.choose(m, 8)
    self.assertEqual(algorithm, 'recursive_doubling')
    self.assertAlmostEqual(seconds, 3 * (2e-6 + m / (80 * GB) + m / (32 * GB)))

  def test_above_the_switch_rabenseifner(self):
    s, m = mpich(), 2049.0
    self.assertEqual(s.choose(m, 8)[0], 'rabenseifner')
    m = 1e8
    expected = 2 * 3 * 2e-6 + 2 * 7 / 8 * m / (80 * GB) + 7 / 8 * m / (32 * GB)
    self.assertAlmostEqual(s.choose(m, 8)[1], expected)
    # A switch point of the profile's choosing (MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE).
    self.assertEqual(mpich(short_msg_bytes=1e6).choose(5e5, 8)[0], 'recursive_doubling')

  def test_not_a_power_of_two_folds_the_others_in(self):
    s, m = mpich(), 1e8
    pof2 = 2 * 3 * 2e-6 + 2 * 7 / 8 * m / (80 * GB) + 7 / 8 * m / (32 * GB)
    extra = 2 * (2e-6 + m / (80 * GB)) + m / (32 * GB)
    self.assertAlmostEqual(s.choose(m, 12)[1], pof2 + extra)

  def test_limits(self):
    s = mpich()
    self.assertEqual(s.allreduce(1e6, 1), 0.0)
    self.assertEqual(s.allreduce(0.0, 8), 0.0)
    m = 1e6  # P = 2: one exchange each way of half the vector, one reduction of half
    self.assertAlmostEqual(s.allreduce(m, 2), 2 * 2e-6 + m / (80 * GB) + m / 2 / (32 * GB))

  def test_host_staging_is_charged_both_ways(self):
    m = 1e8
    staged = mpich(host=stacks.Host(pcie_gbps=80.0))
    self.assertAlmostEqual(staged.allreduce(m, 8) - mpich().allreduce(m, 8), 2 * m / (80 * GB))
    self.assertAlmostEqual(staged.p2p(m) - mpich().p2p(m), 2 * m / (80 * GB))

  def test_gpus_in_a_node_reduce_first(self):
    intra = network.AlphaBeta(1e-6, 400.0)
    s, m = mpich(gpus_per_node=4, intra=intra), 1e8
    inside = 2 * (1e-6 + m / (400 * GB)) + m / (32 * GB)
    self.assertAlmostEqual(s.allreduce(m, 4), inside)
    self.assertAlmostEqual(s.allreduce(m, 16), inside + mpich().allreduce(m, 4))

  def test_congestion_beyond_the_free_nodes(self):
    m = 1e8
    congested = mpich(congestion=stacks.Congestion(free_nodes=4, shared_fraction=0.5))
    self.assertEqual(congested.allreduce(m, 4), mpich().allreduce(m, 4))
    slow = mpich(inter=network.AlphaBeta(2e-6, 40.0))
    self.assertAlmostEqual(congested.allreduce(m, 8), slow.allreduce(m, 8))



class PizDaintCongestionTest(absltest.TestCase):
  """Piz Daint's congestion is the osu_alltoall measurement the profiles cite (eth-cscs/sarus doc/cookbook/osu_mb):
  1 MB per pair at 2-128 nodes, one rank per node, Cray MPT 7.7.2."""

  # Microseconds per call, native, read from the figure's vector data; a node moves (N - 1) MB each way.
  ALLTOALL_US = {2: 245, 4: 721, 8: 1727, 16: 3905, 32: 10426, 64: 26552, 128: 51687}

  def ratio(self, nodes):
    rate = lambda n: (n - 1) / self.ALLTOALL_US[n]
    return rate(nodes) / (sum(rate(n) for n in (2, 4, 8)) / 3)

  def test_the_profiles_charge_the_measured_ratio(self):
    self.assertGreater(self.ratio(16), 0.93)  # within the small jobs' rate up to 16 nodes
    self.assertLess(self.ratio(32), 0.75)
    for name in ('piz_daint', 'piz_daint_nccl', 'piz_daint_wagma'):
      with open(profiles.path_of(name)) as f:
        figure = json.load(f)['network']['congestion']
      congestion = profiles.load(name).network.congestion
      self.assertEqual(congestion.free_nodes, 16, name)
      self.assertAlmostEqual(congestion.shared_fraction, self.ratio(128), delta=0.005, msg=name)
      self.assertAlmostEqual(figure['shared_fraction']['range'][0], min(self.ratio(n) for n in (32, 64, 128)),
                             delta=0.005, msg=name)
      self.assertEqual(figure['shared_fraction']['range'][1], 1.0, name)

  def test_rabenseifner_beyond_16_nodes_at_the_shared_bandwidth(self):
    m = 1e8
    daint = profiles.load('piz_daint').network
    free = dataclasses.replace(daint, congestion=None)
    self.assertEqual(daint.allreduce(m, 16), free.allreduce(m, 16))
    byte_s = daint.inter.bandwidth_gbps * GB
    extra = 2 * (31 / 32) * m / byte_s * (1 / daint.congestion.shared_fraction - 1)
    self.assertAlmostEqual(daint.collective(m, 32) - free.collective(m, 32), extra)

class GlooTest(absltest.TestCase):

  def test_gloo_ring_is_version_1s_ring_without_a_host_reduction(self):
    link = network.AlphaBeta(5e-5, 8.0)
    gloo = stacks.Stack(library='gloo', gpus_per_node=1, inter=link, p2p_link=link)
    v1 = network.Collectives(link, link, 'ring')
    for m, n in ((21e3, 8), (1e8, 2), (1e6, 64)):
      self.assertAlmostEqual(gloo.allreduce(m, n), v1.allreduce(m, n), delta=1e-15 * v1.allreduce(m, n) + 1e-18)
    with_reduction = stacks.Stack(library='gloo', gpus_per_node=1, inter=link, p2p_link=link, reduce_gbps=32.0)
    self.assertAlmostEqual(with_reduction.allreduce(1e8, 8) - gloo.allreduce(1e8, 8), 7 / 8 * 1e8 / (32 * GB))


class ParameterServerTest(absltest.TestCase):

  def test_busiest_node_by_hand(self):
    s, m = mpich(host=stacks.Host(pcie_gbps=80.0)), 1e8
    staging = 2 * m / (80 * GB)
    self.assertEqual(s.ps_exchange(m, 1, 1), 0.0)
    # One server for 4 workers: it receives 3 pushes of the whole model.
    self.assertAlmostEqual(s.ps_exchange(m, 4, 1), 2 * 2e-6 + 3 * m / (80 * GB) + staging)
    # As many servers as workers: each moves 2 (N-1)/N M, a ring all-reduce's volume.
    self.assertAlmostEqual(s.ps_exchange(m, 4, 4), 2 * 2e-6 + 2 * 3 / 4 * m / (80 * GB) + staging)

  def test_whole_variables_load_the_busiest_server(self):
    s, m = mpich(host=stacks.Host(pcie_gbps=80.0)), 1e8
    staging = 2 * m / (80 * GB)
    # An even split (or a shard smaller than M / k) is the line above, exactly.
    self.assertEqual(s.ps_exchange(m, 4, 4, 0.0), s.ps_exchange(m, 4, 4))
    self.assertEqual(s.ps_exchange(m, 4, 4, m / 8), s.ps_exchange(m, 4, 4))
    # A server holding 60% of the model: 3 other workers push it 0.6 M, its own worker pulls the other 0.4 M.
    self.assertAlmostEqual(s.ps_exchange(m, 4, 4, 0.6 * m), 2 * 2e-6 + (3 * 0.6 + 0.4) * m / (80 * GB) + staging)

  def test_round_robin_placement(self):
    # Kernels and biases alternate: on two servers every kernel lands on one of them.
    sizes = [8.0, 400.0, 4.0, 900.0, 4.0, 100.0, 2.0]
    self.assertEqual(stacks.busiest_shard(sizes, 2), 400.0 + 900.0 + 100.0)
    self.assertEqual(stacks.busiest_shard(sizes, 3), max(8 + 900 + 2, 400 + 4.0, 4 + 100.0))
    self.assertEqual(stacks.busiest_shard(sizes[1:], 2), 400.0 + 900.0 + 100.0)  # which server starts: the same
    self.assertEqual(stacks.busiest_shard(sizes, 100), 900.0)
    with self.assertRaisesRegex(ValueError, 'servers'):
      stacks.busiest_shard(sizes, 0)


class FrameworkTest(absltest.TestCase):

  def test_fusion_buffers_and_cycles(self):
    f = stacks.Framework(fusion_bytes=64e6, cycle_s=5e-3)
    s, m = mpich(framework=f), 1e8  # two buffers of 50 MB
    per_call = mpich().allreduce(m / 2, 8) + 2.5e-3 + 2 * 3 * 2e-6
    self.assertAlmostEqual(s.allreduce(m, 8), 2 * per_call)

  def test_the_coordinator_handles_every_ranks_request_for_every_tensor(self):
    f = stacks.Framework(fusion_bytes=64e6, cycle_s=5e-3, tensors=161, request_s=1e-6)
    plain = mpich(framework=dataclasses.replace(f, request_s=0.0))
    self.assertAlmostEqual(mpich(framework=f).allreduce(1e8, 128) - plain.allreduce(1e8, 128), 128 * 161 * 1e-6)
    self.assertEqual(mpich(framework=f).allreduce(1e8, 1), 0.0)

  def test_one_message_per_tensor(self):
    f = stacks.Framework(fusion_bytes=0.0, cycle_s=0.0, tensors=161)
    s, m = mpich(framework=f), 1.61e8
    self.assertAlmostEqual(s.allreduce(m, 8), 161 * mpich().allreduce(1e6, 8))  # no cycles: no negotiation
    self.assertGreater(s.allreduce(1e4, 8), 161 * 3 * 2e-6)  # small is not free: 161 messages' latencies


class NcclTest(parameterized.TestCase):

  def test_two_gpus_in_a_node_ring_simple_by_hand(self):
    # One node of 2 GPUs over NVLink at 1000 Gbit/s bus bandwidth, a large message: ring/Simple,
    # latency base 8.4 + 2 steps x 3.4 us, bandwidth bus x 2 / 2.
    s = nccl(gpus_per_node=2, intra=network.AlphaBeta(1e-6, 1000.0), intra_kind='nvlink')
    m = 1e9
    algorithm, seconds = s.choose(m, 2)
    self.assertEqual(algorithm, 'ring/Simple')
    self.assertAlmostEqual(seconds, (8.4 + 2 * 3.4) * 1e-6 + m / (1000 * GB))

  def test_across_nodes_small_takes_the_tree_large_the_ring(self):
    s = nccl()  # one GPU per node, 128 nodes
    self.assertTrue(s.choose(1e3, 128)[0].startswith('tree'))
    self.assertTrue(s.choose(1e9, 128)[0].startswith('ring'))
    # The ring's latency grows with P, the tree's with log2 P: at a mid size the choice flips with P.
    self.assertTrue(s.choose(1e6, 4)[0].startswith('ring'))
    self.assertTrue(s.choose(1e6, 256)[0].startswith('tree'))

  def test_large_multinode_ring_by_hand(self):
    s, m, n = nccl(), 1e9, 16
    lat = (8.4 + 2 * 15 * 9.6) * 1.9  # every step across the network; the ring's plateau factor
    expected = lat * 1e-6 + m / (80 * GB * n / (2 * (n - 1)))
    self.assertEqual(s.choose(m, n)[0], 'ring/Simple')
    self.assertAlmostEqual(s.choose(m, n)[1], expected)

  def test_tree_bandwidth_capped_and_corrected(self):
    # A tree on 1 GB: busbw min(0.9 B, 80 GB/s) / 2, no correction (beyond 128 MB), latency 2 log2 N x 50 us.
    s = nccl(inter=network.AlphaBeta(2e-6, 8000.0))  # 1000 GB/s: the cap binds
    _, seconds = stacks.Stack._nccl(s, 1e9, 4)
    tree = 2 * 2 * 50e-6 + 1e9 / (80e9 * 0.5)
    ring = (8.4 + 6 * 9.6) * 1.9 * 1e-6 + 1e9 / (1000e9 * 4 / 6)
    self.assertAlmostEqual(seconds, min(tree, ring))

  def test_limits(self):
    s = nccl()
    self.assertEqual(s.allreduce(1e6, 1), 0.0)
    self.assertGreater(s.allreduce(1e6, 2), 0.0)


class VersionsTest(absltest.TestCase):

  def test_a_version_1_profile_gives_the_times_it_gave(self):
    # The shipped profiles are version 2 now; version 1 documents (calibrate writes them) still load as
    # `network.Collectives`, charging the closed forms of network.py exactly.
    doc = {'version': 1, 'name': 'v1', 'compute': {'a/b': {'per_sample_s': {'value': 1e-4, 'source': 't'},
                                                           'overhead_s': {'value': 0.0, 'source': 't'}}},
           'network': {'allreduce': {'form': 'tree', 'latency_s': {'value': 1e-5, 'source': 't'},
                                     'bandwidth_gbps': {'value': 80.0, 'source': 't'}},
                       'p2p': {'latency_s': {'value': 2e-5, 'source': 't'},
                               'bandwidth_gbps': {'value': 40.0, 'source': 't'}}},
           'host_s': {'value': 1e-4, 'source': 't'}}
    net = profiles.parse(doc, 'v1').network
    self.assertIsInstance(net, network.Collectives)
    m, n = 1e6, 8
    self.assertEqual(net.allreduce(m, n), 2 * math.ceil(math.log2(n)) * 1e-5 + 2 * (n - 1) / n * m * 8 / 80e9)
    self.assertEqual(net.p2p(m), 2e-5 + m * 8 / 40e9)

  def test_a_version_2_profile_builds_its_stack(self):
    doc = _v2()
    stack = profiles.parse(doc, 'v2').network
    self.assertIsInstance(stack, stacks.Stack)
    self.assertEqual(stack, mpich(host=stacks.Host(pcie_gbps=96.0),
                                  framework=stacks.Framework(fusion_bytes=64e6, cycle_s=5e-3),
                                  congestion=stacks.Congestion(free_nodes=64, shared_fraction=0.5)))

  def test_version_2_errors_name_the_field(self):
    cases = [
        (lambda d: d['network'].update(library='mpi'), r"network\.library='mpi' .*nccl, mpich, gloo"),
        (lambda d: d['network']['gpus_per_node'].update(value=2.5), r'network\.gpus_per_node\.value=2\.5 .*integer'),
        (lambda d: d['network']['gpus_per_node'].update(value=4), r'network\.intra=.missing'),
        (lambda d: d['network'].update(host='yes'), r"network\.host='yes' .*JSON object"),
        (lambda d: d['network']['congestion']['shared_fraction'].update(value=1.5),
         r'network\.congestion\.shared_fraction\.value=1\.5 .*<= 1'),
        (lambda d: d['network'].update(ll128='no'), r"network\.ll128='no' .*true or false"),
        (lambda d: d['network']['reduce_gbps'].update(range=[40.0, 80.0]),
         r'network\.reduce_gbps\.range=\[40\.0, 80\.0\] .*low <= value \(32\.0\) <= high'),
        (lambda d: d['network']['reduce_gbps'].update(range='wide'), r"network\.reduce_gbps\.range='wide'"),
    ]
    for edit, message in cases:
      doc = _v2()
      edit(doc)
      with self.assertRaisesRegex(errors.ConfigError, r'^cluster\.profile\[v2\]\.' + message):
        profiles.parse(doc, 'v2')

  def test_shipped_profiles_are_version_2_stacks(self):
    for name in profiles.names():
      with open(os.path.join(profiles.DIRECTORY, name + '.json')) as f:
        doc = json.load(f)
      if doc['version'] == profiles.STRUCTURED:
        self.assertIsInstance(profiles.load(name).network, stacks.Stack, name)


def _fig(value):
  return {'value': value, 'source': 'test'}


_V2 = {
    'version': 2, 'name': 'v2',
    'compute': {'a/b': {'per_sample_s': _fig(1e-4), 'overhead_s': _fig(0.0)}},
    'network': {'library': 'mpich', 'gpus_per_node': _fig(1),
                'inter': {'latency_s': _fig(2e-6), 'bandwidth_gbps': _fig(80.0)},
                'p2p': {'latency_s': _fig(2e-6), 'bandwidth_gbps': _fig(80.0)},
                'reduce_gbps': _fig(32.0), 'host': {'pcie_gbps': _fig(96.0)},
                'framework': {'fusion_bytes': _fig(64e6), 'cycle_s': _fig(5e-3)},
                'congestion': {'free_nodes': _fig(64), 'shared_fraction': _fig(0.5)}},
    'host_s': _fig(0.0),
}


def _v2():
  return copy.deepcopy(_V2)


if __name__ == '__main__':
  absltest.main()


class FitStackTest(parameterized.TestCase):
  """`calibration.fit_stack` on synthetic rows: a known stack's times (times noise), fitted through the
  skeleton's structure; the largest process count held out (the rows are synthetic, not measured: the test is
  of the fit, not of a machine)."""

  SIZES = (4e3, 6.4e4, 1e6, 1.6e7, 6.4e7)

  def rows(self, stack, counts, noise, seed=0):
    rng = np.random.default_rng(seed)
    return [[n, m, stack.allreduce(m, n) * float(np.exp(rng.normal(0, noise)))]
            for n in counts for m in self.SIZES]

  @parameterized.named_parameters(
      ('mpich_host', mpich(host=stacks.Host(pcie_gbps=97.8))),
      ('nccl', nccl()),
      ('gloo', stacks.Stack(library='gloo', gpus_per_node=1, inter=network.AlphaBeta(5e-5, 8.0),
                            p2p_link=network.AlphaBeta(5e-5, 8.0))),
      ('nccl_8_per_node', nccl(gpus_per_node=8, intra=network.AlphaBeta(1e-6, 1880.0), intra_kind='nvlink',
                               inter=network.AlphaBeta(5e-6, 1440.0))),
  )
  def test_exact_rows_give_back_the_terms(self, truth):
    # The skeleton starts from other terms: latency x 3, bandwidth / 2.
    skeleton = dataclasses.replace(truth, inter=network.AlphaBeta(truth.inter.latency_s * 3,
                                                                  truth.inter.bandwidth_gbps / 2))
    counts = (2, 4, 8, 16, 32) if truth.gpus_per_node == 1 else (8, 16, 32, 64)
    fit = calibration.fit_stack(skeleton, self.rows(truth, counts, 0.0))
    self.assertAlmostEqual(fit.bandwidth_gbps / truth.inter.bandwidth_gbps, 1.0, places=6)
    if truth.library != 'nccl':  # NCCL's latencies are its own: the fit keeps the skeleton's
      self.assertAlmostEqual(fit.latency_s / truth.inter.latency_s, 1.0, places=6)
    self.assertLess(np.max(np.abs(fit.relative_errors)), 1e-6)

  @parameterized.named_parameters(
      ('mpich_host', mpich(host=stacks.Host(pcie_gbps=97.8))),
      ('nccl', nccl()),
  )
  def test_holdout_of_the_largest_count(self, truth):
    skeleton = dataclasses.replace(truth, inter=network.AlphaBeta(1e-5, 10.0))
    rows = self.rows(truth, (2, 4, 8, 16, 32), noise=0.03, seed=1)
    fit, errors_held = calibration.holdout_error(skeleton, rows)
    truth_held = np.array([fit.stack.allreduce(m, 32) / truth.allreduce(m, 32) - 1 for m in self.SIZES])
    # The extrapolation to 32 processes, fitted on 2..16 with 3% noise per row, against the held-out rows (their
    # own noise included) and against the noiseless truth: the targets, 15% per cell and 5% on the mean.
    print(f'{self._testMethodName}: hold-out P = 32, predicted / measured - 1 = {np.round(errors_held, 4).tolist()}'
          f' (against the truth {np.round(truth_held, 4).tolist()}); fitted {fit.latency_s:.3g} s, '
          f'{fit.bandwidth_gbps:.4g} Gbit/s')
    self.assertLess(np.max(np.abs(errors_held)), 0.15)
    self.assertLess(abs(np.mean(errors_held)), 0.05)
    self.assertLess(np.max(np.abs(truth_held)), 0.05)

  def test_too_few_sizes(self):
    with self.assertRaisesRegex(ValueError, 'two or more sizes'):
      calibration.fit_stack(mpich(), [[2, 1e6, 1e-3], [4, 1e6, 2e-3]])
