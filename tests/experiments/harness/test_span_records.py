"""A span's blocks recorded together after its last one (`loop.Loop.defers`) against each block recorded as soon
as it ran: the same rows, summaries and failures, from one fetch of their measurements
(`block_step.join_measurements`, `measurements_to_host_each`) that gives back each block's own."""

import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np

from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import loop as loop_lib
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import train
from tests import harness
from tests.experiments import test_train

CADENCE = dict(num_steps=40, steps_per_call=3, log_every=6, eval_every=12, checkpoint_every=24)


def _packed(rng, shape):
  """A block's packed measurements on 8 devices, sharded over the workers (the last axis), as the step gives."""
  mesh = Mesh(np.array(jax.devices()[:8]), ('workers',))
  spec = PartitionSpec(*([None] * (len(shape) - 1)), 'workers')
  return jax.device_put(rng.normal(size=shape).astype(np.float32), NamedSharding(mesh, spec))


class JoinedMeasurementsTest(parameterized.TestCase):

  @parameterized.parameters((False, ()), (True, ()), (False, (3,)))  # timed; a group of 3 replicas
  def test_each_block_gets_back_what_its_own_fetch_gives(self, timed, lead):
    rng = np.random.default_rng(0)
    per_iteration = 4 if timed else 2
    measured = [_packed(rng, lead + (per_iteration * n + 1, 8)) for n in (3, 3, 1, 5)]  # blocks of 3, 3, 1, 5
    joined = block_step_lib.join_measurements(measured, 'cpu')
    got = block_step_lib.measurements_to_host_each(joined, [m.shape[-2] for m in measured], timed)
    self.assertLen(got, len(measured))
    for host, m in zip(got, measured):
      want = block_step_lib.measurements_to_host(m, timed)
      self.assertEqual(sorted(host), sorted(want))
      for name in want:
        np.testing.assert_array_equal(host[name], want[name])

  def test_one_block_is_not_copied(self):
    measured = [_packed(np.random.default_rng(1), (7, 8))]
    self.assertIs(block_step_lib.join_measurements(measured, 'cpu'), measured[0])


def _train(configs, records_by_span: bool, root: str):
  """Trains `configs` as one group with or without span records: (workdirs, each run's failure or None, how many
  blocks each fetch of measurements brought)."""
  workdirs = [os.path.join(root, f'r{i}') for i in range(len(configs))]
  fetched = []
  each = block_step_lib.measurements_to_host_each
  one = block_step_lib.measurements_to_host
  with mock.patch.object(loop_lib.Loop, 'records_by_span', records_by_span), \
       mock.patch.object(block_step_lib, 'measurements_to_host_each',
                         lambda joined, rows, timed=False: fetched.append(len(rows)) or each(joined, rows, timed)), \
       mock.patch.object(block_step_lib, 'measurements_to_host',
                         lambda packed, timed=False: fetched.append(1) or one(packed, timed)):
    outcomes = train.train_group(configs, workdirs)
  failures = [f'{type(o).__name__}: {o}'.replace(root, '<root>') if isinstance(o, Exception) else None
              for o in outcomes]
  return workdirs, failures, fetched


class SpanRecordsTest(parameterized.TestCase):

  def _assert_same_runs(self, configs, diverges=False):
    by_span, at_once = (_train(configs, flag, self.create_tempdir().full_path) for flag in (True, False))
    self.assertEqual(max(at_once[2]), 1)
    self.assertGreater(max(by_span[2]), 1)  # several blocks in one fetch
    self.assertLess(len(by_span[2]), len(at_once[2]))
    if diverges:  # found at its span's end: the rest of that span ran, and the block then in flight
      self.assertLessEqual(sum(by_span[2]), sum(at_once[2]) + loop_lib.AHEAD_BLOCKS)
    else:
      self.assertEqual(sum(by_span[2]), sum(at_once[2]))
    self.assertEqual(by_span[1], at_once[1])
    for a, b in zip(by_span[0], at_once[0]):
      self.assertEqual(test_train._strip_wall(metrics_io.read_rows(a)), test_train._strip_wall(metrics_io.read_rows(b)))
      self.assertEqual(os.path.exists(os.path.join(a, 'summary.json')), os.path.exists(os.path.join(b, 'summary.json')))
      if os.path.exists(os.path.join(b, 'summary.json')):
        self.assertEqual(test_train._summary_without_wall(a), test_train._summary_without_wall(b))
      rows = metrics_io.read_rows(a)
      self.assertEqual([r['wall_time'] for r in rows], sorted(r['wall_time'] for r in rows))
    return by_span

  @parameterized.parameters('sync', 'kasync,k=2', 'local_sgd,local_steps=2', 'dasgd')
  def test_a_run_recorded_by_span_writes_the_rows_of_one_recorded_block_by_block(self, arg):
    self._assert_same_runs([harness.synthetic_config(arg, **CADENCE)])

  def test_the_progress_period_ends_a_spans_records(self):
    # Every block takes longer than a period of 1 ns: each is recorded as soon as it ran, as without spans.
    config = harness.synthetic_config('sync', progress_every_s=1e-9, **CADENCE)
    _, _, fetched = _train([config], True, self.create_tempdir().full_path)
    _, _, at_once = _train([config], False, self.create_tempdir().full_path)
    self.assertEqual(fetched, at_once)
    self.assertEqual(set(fetched), {1})

  def test_a_group_recorded_by_span_writes_each_replicas_rows(self):
    configs = [harness.synthetic_config('kasync,k=2', seed=seed, **CADENCE, **{'optimizer.learning_rate': lr})
               for seed, lr in ((0, 0.05), (1, 0.02))]
    self._assert_same_runs(configs)

  def test_a_divergence_inside_a_span_stops_at_the_same_step_with_the_same_rows(self):
    # The loss explodes after a few blocks, far from the first checkpoint: inside a span.
    config = harness.synthetic_config('sync', num_steps=60, steps_per_call=2, log_every=2, eval_every=60,
                                      checkpoint_every=60, **{'optimizer.learning_rate': 50.0})
    runs = self._assert_same_runs([config], diverges=True)
    self.assertRegex(runs[1][0], r'TrainingDiverged: training loss is \S+ at step \d+; stopped')

  def test_one_replica_diverging_inside_a_span_leaves_the_other_to_finish_alike(self):
    configs = [harness.synthetic_config('sync', seed=0, num_steps=60, steps_per_call=2, log_every=2, eval_every=60,
                                        checkpoint_every=60, **{'optimizer.learning_rate': lr})
               for lr in (50.0, 0.05)]
    workdirs, failures, _ = self._assert_same_runs(configs, diverges=True)
    self.assertRegex(failures[0], r'TrainingDiverged: training loss is \S+ at step \d+; stopped')
    self.assertIsNone(failures[1])
    self.assertFalse(os.path.exists(os.path.join(workdirs[0], 'summary.json')))
    self.assertTrue(os.path.exists(os.path.join(workdirs[1], 'summary.json')))


if __name__ == '__main__':
  absltest.main()
