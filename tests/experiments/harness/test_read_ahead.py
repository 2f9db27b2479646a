"""Blocks drawn and read ahead together (`reader.BlockReader.prepare`, `BlockReader.rewind`) against the same
reader taking them one at a time: the same blocks, inputs, clocks and data positions, a stall found at the same
block, and the same metrics rows from a whole run."""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from waitless.experiments.harness import inputs as inputs_lib
from waitless.experiments.harness import loop as loop_lib
from waitless.experiments.harness import reader as reader_lib
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import setup
from waitless.experiments.harness import train
from tests import harness
from tests.experiments import test_train
from tests.experiments.harness import test_shared_host_work

ALGORITHMS = ('sync', 'async', 'kasync,k=2', 'local_sgd,local_steps=2', 'wagma', 'dpsgd', 'dasgd', 'kbatch_async',
              'nonblocking', 'adasync')
CADENCE = dict(num_steps=40, steps_per_call=3, log_every=6, eval_every=12, checkpoint_every=24)


def _group(arg: str, replicas: int, **overrides):
  configs = [harness.synthetic_config(arg, workers=4, devices=2, microbatches=2, seed=3, **{
      'stragglers.kind': 'exponential', 'optimizer.learning_rate': lr, **CADENCE, **overrides})
             for lr in (0.05, 0.02)[:replicas]]
  return setup.build_group(configs)


def _readers(group, checkpoint_due=lambda: False) -> tuple[reader_lib.BlockReader, reader_lib.BlockReader]:
  """The loop's block reader as it runs (reads ahead where it may) and the same reader one block at a time."""
  _, model_bytes = setup.param_count_and_bytes(setup.init_state(group).params)
  made = []
  for _ in range(2):
    members = [loop_lib.Replica.start(run, setup.clock_for(run, model_bytes)) for run in group.runs]
    lookahead = not group.lead.rule.uses_feedback and not group.lead.measured  # as `loop.Loop` decides
    made.append(reader_lib.BlockReader(group, members, lookahead, checkpoint_due))
  made[1].reads_ahead = False
  return made[0], made[1]


def _assert_same_block(test, a: reader_lib.Prepared, b: reader_lib.Prepared):
  test.assertEqual((a.step, a.length, a.live, sorted(a.stalled)), (b.step, b.length, b.live, sorted(b.stalled)))
  for x, y in zip(a.blocks, b.blocks):
    test.assertEqual(x is None, y is None)
    if x is not None:
      test_shared_host_work._assert_blocks_equal(x, y)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(a.inputs[0]), jax.device_get(b.inputs[0]))
  test.assertEqual(a.inputs[1], b.inputs[1])  # packing
  np.testing.assert_array_equal(a.inputs[2], b.inputs[2])  # steps
  test.assertEqual(a.inputs[3], b.inputs[3])  # gradient slots


def _assert_same_host_state(test, a: reader_lib.BlockReader, b: reader_lib.BlockReader):
  for r, s in zip(a.replicas, b.replicas):
    np.testing.assert_array_equal(r.positions, s.positions)
    test.assertEqual(r.clock.state_dict(), s.clock.state_dict())


class ReadAheadTest(parameterized.TestCase):

  @parameterized.product(arg=ALGORITHMS, replicas=(1, 2))
  def test_blocks_read_ahead_equal_blocks_read_one_at_a_time(self, arg, replicas):
    ahead, one_by_one = _readers(_group(arg, replicas))
    lead = ahead.lead
    self.assertEqual(ahead.reads_ahead, not lead.rule.uses_feedback and inputs_lib.reads_ahead(lead))
    self.assertEqual(ahead.reads_ahead, not lead.rule.uses_feedback and not lead.finished_only)
    spans, step = [], 0
    while step < 40:
      a, b = ahead.prepare(step), one_by_one.prepare(step)
      if ahead.ahead is not None and ahead.ahead.step == step:
        spans.append(step)
      _assert_same_block(self, a, b)
      step += a.length
      if step % 24 == 0 or step == 40:  # a checkpoint's step: no block is read past it
        self.assertTrue(ahead.ahead is None or not ahead.ahead.blocks)
        _assert_same_host_state(self, ahead, one_by_one)
    if ahead.reads_ahead:  # from the start and from the checkpoint's step, at most AHEAD_BLOCKS blocks each
      self.assertContainsSubset([0, 24], spans)
      self.assertLessEqual(len(spans), 2 * 40 // (reader_lib.AHEAD_BLOCKS * 2))
    else:
      self.assertEmpty(spans)

  @parameterized.parameters('sync', 'kasync,k=2', 'local_sgd,local_steps=2')
  def test_a_rewind_inside_a_span_leaves_what_one_block_at_a_time_leaves(self, arg):
    ahead, one_by_one = _readers(_group(arg, 2))
    step = 0
    for _ in range(3):
      a, b = ahead.prepare(step), one_by_one.prepare(step)
      step += a.length
    self.assertNotEmpty(ahead.ahead.blocks)  # blocks past `step` were read
    ahead.rewind(step)  # a checkpoint or a stop at `step`
    self.assertIsNone(ahead.ahead)
    _assert_same_host_state(self, ahead, one_by_one)
    while step < 40:
      a, b = ahead.prepare(step), one_by_one.prepare(step)
      _assert_same_block(self, a, b)
      step += a.length
    _assert_same_host_state(self, ahead, one_by_one)

  def test_a_passed_checkpoint_period_reads_one_block(self):
    # Each block would end with a checkpoint that rewinds what was read past it: read none.
    ahead, _ = _readers(_group('sync', 1), checkpoint_due=lambda: True)
    self.assertTrue(ahead.reads_ahead)
    self.assertEqual(ahead.prepare(0).length, 3)
    self.assertIsNone(ahead.ahead)

  def test_a_stall_inside_a_span_stops_at_the_same_block(self):
    group = _group('sync', 1, **{'stragglers.fail_worker': 1, 'stragglers.fail_at_s': 0.3,
                                 'stragglers.return_at_s': -1.0, 'stragglers.rate': 100.0})
    ahead, one_by_one = _readers(group)
    step, blocks = 0, 0
    while True:
      a, b = ahead.prepare(step), one_by_one.prepare(step)
      self.assertEqual(sorted(a.stalled), sorted(b.stalled))
      if a.stalled:
        break
      _assert_same_block(self, a, b)
      step, blocks = step + a.length, blocks + 1
    self.assertGreater(blocks, 1)  # the failure falls inside the first span, after its first block
    self.assertLess(step, 24)

  @parameterized.parameters('sync', 'kasync,k=2')
  def test_a_run_that_reads_ahead_writes_the_rows_of_one_that_does_not(self, arg):
    config = harness.synthetic_config(arg, **CADENCE)
    read_ahead, one_by_one = self.create_tempdir().full_path, self.create_tempdir().full_path
    train.train_and_evaluate(config, read_ahead)
    with mock.patch.object(inputs_lib, 'reads_ahead', return_value=False):
      train.train_and_evaluate(config, one_by_one)
    self.assertEqual(test_train._summary_without_wall(read_ahead), test_train._summary_without_wall(one_by_one))
    self.assertEqual(test_train._strip_wall(metrics_io.read_rows(read_ahead)),
                     test_train._strip_wall(metrics_io.read_rows(one_by_one)))


if __name__ == '__main__':
  absltest.main()
