"""The wall-clock checkpoint period (`checkpoint_every_s`): where it checkpoints, and that it moves nothing else."""

import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized

from waitless import config_errors as errors
from waitless.cluster import registry
from waitless.experiments.harness import checkpointing
from waitless.experiments.harness import inputs
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import preemption
from waitless.experiments.harness import train
from waitless.experiments.harness import validation
from tests import harness
from tests.experiments import test_train


def _saved_steps(config, workdir, stop_requests=None) -> list[int]:
  """Trains `config` in `workdir` and returns the steps of every checkpoint saved, in order."""
  saved = []
  real_save = checkpointing.Checkpointer.save

  def save(self, step, *args, **kwargs):
    saved.append(step)
    return real_save(self, step, *args, **kwargs)

  with mock.patch.object(checkpointing.Checkpointer, 'save', save):
    train.train_and_evaluate(config, workdir, stop_requests=stop_requests)
  return saved


class CheckpointPeriodTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('local_sgd', 'local_sgd,local_steps=3'),  # lookahead on: a due checkpoint must cancel it
      ('kasync', 'kasync,k=2'))                  # stale views, a vectorised clock
  def test_a_passed_period_checkpoints_every_block_and_changes_no_result(self, arg):
    common = dict(num_steps=30, checkpoint_every=1000, log_every=5, eval_every=10, steps_per_call=4)
    steps_only = self.create_tempdir().full_path
    self.assertEqual(_saved_steps(harness.synthetic_config(arg, checkpoint_every_s=0.0, **common), steps_only),
                     [30])  # by step: the end only
    every_block = self.create_tempdir().full_path
    config = harness.synthetic_config(arg, checkpoint_every_s=1e-9, **common)
    saved = _saved_steps(config, every_block)
    ends, round_length = [0], registry.get(arg.split(',')[0]).round_length(config)
    while ends[-1] < 30:
      ends.append(ends[-1] + inputs.block_length(ends[-1], config, round_length))
    self.assertEqual(saved, ends[1:])  # a period that has always passed: after every block
    self.assertGreater(len(saved), 6)
    self.assertEqual(test_train._summary_without_wall(every_block), test_train._summary_without_wall(steps_only))
    self.assertEqual(test_train._strip_wall(metrics_io.read_rows(every_block)),
                     test_train._strip_wall(metrics_io.read_rows(steps_only)))

  def test_a_run_resumed_from_a_period_checkpoint_equals_an_uninterrupted_one(self):
    common = dict(num_steps=30, checkpoint_every=1000, log_every=5, eval_every=10, steps_per_call=4)
    full = self.create_tempdir().full_path
    train.train_and_evaluate(harness.synthetic_config('kasync,k=2', checkpoint_every_s=0.0, **common), full)
    stopped = self.create_tempdir().full_path
    config = harness.synthetic_config('kasync,k=2', checkpoint_every_s=1e-9, **common)

    class CrashAt(preemption.StopRequests):
      """Crashes (no checkpoint of its own) before the first block that starts at step 13 or later: [14, 15)."""

      def agreed(self, step, checkpoint_due=False):
        if step >= 13:
          raise RuntimeError('crash')
        return super().agreed(step, checkpoint_due)

    with self.assertRaisesRegex(RuntimeError, 'crash'):
      train.train_and_evaluate(config, stopped, stop_requests=CrashAt())
    checkpoints = sorted(int(n) for n in os.listdir(os.path.join(stopped, 'checkpoints')) if n.isdigit())
    self.assertEqual(checkpoints[-1], 14)  # where the block before the crash ended: the period's, not a step's
    train.train_and_evaluate(config, stopped)
    self.assertEqual(test_train._summary_without_wall(stopped), test_train._summary_without_wall(full))
    self.assertEqual(test_train._strip_wall(metrics_io.read_rows(stopped)),
                     test_train._strip_wall(metrics_io.read_rows(full)))

  def test_a_negative_period_is_refused_naming_the_field(self):
    with self.assertRaisesRegex(errors.ConfigError, r'checkpoint_every_s.*-1.*>= 0'):
      validation.validate(harness.synthetic_config('sync', checkpoint_every_s=-1.0))


if __name__ == '__main__':
  absltest.main()
