"""The held-out validation (`benchmarks/scale_validation.py`): every table is predicted or says why not, the base
cell sets only the compute, and a cell's prediction is the formula by hand."""

import dataclasses
import json

from absl.testing import absltest

from benchmarks import scale_validation as v
from waitless.cluster import profiles
from waitless.cluster import stacks
from waitless.cluster import step


class ScaleValidationTest(absltest.TestCase):

  def test_every_table_is_predicted_or_says_why_not(self):
    with open(v.TABLES) as f:
      tables = json.load(f)
    rows, skipped = v.validate(tables)
    predicted = {r.table for r in rows}
    for table in tables:
      self.assertTrue(table['id'] in predicted or any(t == table['id'] and why for t, why, _ in skipped),
                      table['id'])
    # The base cell of a table is never among its predicted rows (it set the compute).
    self.assertEqual(len(rows) + sum(n for *_, n in skipped), sum(len(t['cells']) - 1 for t in tables))
    self.assertGreater(v.summary(rows)['cells'], 100)

  def test_one_cell_by_hand(self):
    # Horovod 0.15 over Cray MPICH on piz_daint: base 2 nodes, predicted 4 nodes.
    table = {'id': 'sarus_hvd015_nonccl_x', 'setting': {'gradient_bytes': 1e8, 'batch_per_gpu': 64},
             'cells': [{'nodes': 2, 'gpus': 2, 'throughput': 460.0, 'unit': 'images/s'},
                       {'nodes': 4, 'gpus': 4, 'throughput': 900.0, 'unit': 'images/s'}]}
    rows, _ = v.validate([table])
    stack = dataclasses.replace(profiles.load('piz_daint').network, framework=v.HOROVOD_015)
    share, cv = step.BACKWARD_SHARE.value, step.STEP_CV.value

    def seconds(micro, n):  # the slowest of n computes, then what the all-reduce leaves after the backward pass
      return step.slowest(micro, n, cv) + step.exposed(stack, 1e8, n, share * micro)
    micro = v.solve_micro(v.plan(table)[0], table, table['cells'][0], 1e8, 1, 64 / 230.0, v.NOMINAL)
    self.assertAlmostEqual(seconds(micro, 2), 64 / 230.0)  # the base cell sets the compute, nothing else
    self.assertAlmostEqual(rows[0].predicted, 4 * 64 / seconds(micro, 4))

  def test_accumulation_and_parameter_servers_do_not_overlap(self):
    table = {'id': 'dle_tf1_bert_dgx2h_x', 'setting': {}, 'cells': []}
    p, _ = v.plan(table)
    cell = {'gpus': 64, 'nodes': 4}
    with_accum = v.step_seconds(p, table, cell, 1e9, 0.1, 4, v.NOMINAL)
    self.assertAlmostEqual(with_accum, 4 * step.slowest(0.1, 64, v.NOMINAL.cv) + p.stack.allreduce(1e9, 64))
    self.assertLess(v.step_seconds(p, table, cell, 1e9, 0.4, 1, v.NOMINAL),
                    step.slowest(0.4, 64, v.NOMINAL.cv) + p.stack.allreduce(1e9, 64))

  def test_bounds_put_each_estimate_at_its_ranges_ends(self):
    table = {'id': 'sarus_hvd016_nccl_x', 'setting': {}, 'cells': []}
    p, _ = v.plan(table)
    slow, fast = v.bounds(p)
    # piz_daint_nccl's socket bandwidth: an estimate of 24 Gbit/s in [12, 75.85].
    self.assertEqual((slow.inter.bandwidth_gbps, p.stack.inter.bandwidth_gbps, fast.inter.bandwidth_gbps),
                     (12.0, 24.0, 75.85))
    self.assertEqual(slow.congestion.shared_fraction, 0.58)  # the lowest ratio osu_alltoall measured
    self.assertEqual(fast.framework, p.stack.framework)  # the table's Horovod version is kept
    # The step's own estimates: the least overlap and the most variation at the slow end.
    self.assertEqual((v.SLOW.backward_share, v.SLOW.cv), (step.BACKWARD_SHARE.low, step.STEP_CV.high))
    self.assertEqual((v.FAST.backward_share, v.FAST.cv), (step.BACKWARD_SHARE.high, step.STEP_CV.low))


if __name__ == '__main__':
  absltest.main()


class RoundRobinTest(absltest.TestCase):

  def test_inception3_variables(self):
    x = v.INCEPTION3_VARIABLES
    # The global step, then 94 convolutions' kernels and biases, then the classifier's weights and biases.
    self.assertLen(x, 1 + 2 * 94 + 2)
    self.assertEqual(x[0], 8.0)
    self.assertEqual(x[-2:], (4.0 * 2048 * 1001, 4.0 * 1001))
    self.assertEqual(max(x), 4.0 * 2048 * 1001)
    self.assertEqual(x[1:3], (4.0 * 3 * 3 * 3 * 32, 4.0 * 32))  # the first convolution: 3x3, 3 -> 32 channels
    self.assertEqual(sum(x) - 8, 4 * 23819401)  # 23.8M parameters, InceptionV3 without batch normalisation
    # On two servers the global step goes to the first, and then every kernel lands on the second.
    self.assertEqual(stacks.busiest_shard(list(x), 2), sum(x[1::2]))

  def test_ps_tables_charge_the_busiest_shard(self):
    table = {'id': 'ebug_tf11_ps_inception3_daint_synthetic', 'setting': {}, 'cells': []}
    p, _ = v.plan(table)
    cell = {'gpus': 128, 'nodes': 128, 'num_ps': 116}
    shard = stacks.busiest_shard(list(v.INCEPTION3_VARIABLES), 116)
    self.assertAlmostEqual(v.comm(p, table, cell, 95277604.0), p.stack.ps_exchange(95277604.0, 128, 116, shard))
    self.assertGreater(shard, 8 * 95277604.0 / 116)  # the classifier's weights alone are 10x an even share


class LeastErrorTest(absltest.TestCase):

  def test_a_per_step_cost_reproduces_its_own_table(self):
    # t = 0.1 s per micro-batch, C(P) = 0, 0.05, 0.2 s per step with 8, 4, 2 micro-batches.
    points = [(8, 8, 0.1), (16, 4, 0.1 + 0.05 / 4), (64, 2, 0.1 + 0.2 / 2)]
    self.assertEqual(v.least_error(points), 0.0)

  def test_faster_at_more_workers_by_hand(self):
    # Without variation, a per-step cost only grows with P: 1.0 s at 2 workers and 0.8 s at 4 need both moved to
    # one m, 0.8 / (1 - e) = 1.0 / (1 + e): e = 1/9.
    self.assertAlmostEqual(v.least_error([(2, 1, 1.0), (4, 1, 0.8)], cvs=[0.0]), 1 / 9, places=6)

  def test_a_slower_micro_batch_is_not_a_per_step_cost(self):
    # The micro-batch 30% slower at 16 and 32 nodes with 4 and 2 micro-batches: no C(P) growing with P gives both.
    points = [(16, 16, 1.0), (256, 4, 1.3), (512, 2, 1.3)]
    self.assertGreater(v.least_error(points, cvs=[0.0]), 0.0)

  def test_extra_seconds_by_hand(self):
    row = v.Row('t', '', '', '', 16, 2, 100.0, 125.0, 'sequences/s', accum=4, micro_per_gpu=10)
    self.assertAlmostEqual(row.extra_s, 16 * 4 * 10 / 100.0 - 16 * 4 * 10 / 125.0)


class ParameterServerStepTest(absltest.TestCase):

  def test_a_parameter_server_cell_by_hand(self):
    table = {'id': 'ebug_tf11_ps_inception3_daint_synthetic', 'setting': {}, 'cells': []}
    p, _ = v.plan(table)
    cell = {'gpus': 16, 'nodes': 16, 'num_ps': 4, 'variable_update': 'parameter_server'}
    m, micro = 95277604.0, 0.46
    shard = stacks.busiest_shard(list(v.INCEPTION3_VARIABLES), 4)
    link = dataclasses.replace(p.stack, host=None).ps_exchange(m, 16, 4, shard)
    staging = p.stack.ps_exchange(m, 16, 4, shard) - link
    mu = step.slowest(micro, 16, v.NOMINAL.cv)
    expected = mu + staging + step.ps_exposed(link, mu, v.NOMINAL.backward_share, True)
    self.assertAlmostEqual(v.step_seconds(p, table, cell, m, micro, 1, v.NOMINAL), expected)
    # distributed_replicated pulls after the step: more exposed.
    replicated = dict(cell, variable_update='distributed_replicated')
    self.assertGreater(v.step_seconds(p, table, replicated, m, micro, 1, v.NOMINAL), expected)

  def test_which_pulls_run_under_the_forward_pass(self):
    self.assertTrue(v._pulls_under_forward({'setting': {}}, {'variable_update': 'parameter_server'}))
    self.assertFalse(v._pulls_under_forward({'setting': {}}, {'variable_update': 'distributed_replicated'}))
    tfbench = {'setting': {'stack': 'tf_cnn_benchmarks; variable_update=distributed_replicated'}}
    self.assertFalse(v._pulls_under_forward(tfbench, {}))
