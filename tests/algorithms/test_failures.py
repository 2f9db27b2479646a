"""A worker that fails for good: every algorithm goes on without it or stops with one line, never hangs.

The declared `tolerated_failures` of each algorithm's time rule must match what its clock does: a rule that
tolerates a lost worker simulates on after the failure; one that does not raises `StalledError` naming the
worker, when it failed and where the run got stuck. The training loop turns that into `ClusterStalled`
after logging what it trained (the main exits 4 with the line).
"""

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from waitless.cluster import registry
from waitless.cluster import clock as clock_lib
from waitless.cluster import factory
from waitless.experiments.configs import digits
from waitless.experiments.harness import recorder as recorder_lib
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import train

_ARGS = {'ksync': 'ksync,k=6', 'kasync': 'kasync,k=4', 'kbatch_sync': 'kbatch_sync,k=4',
         'kbatch_async': 'kbatch_async,k=4', 'adasync': 'adasync,k0=4'}
FAIL_AT_S = 0.05  # 5 iterations of 10 ms


def _failing(name: str, **overrides):
  config = digits.get_config(_ARGS.get(name, name))
  config.stragglers.fail_worker, config.stragglers.fail_at_s = 3, FAIL_AT_S
  for key, value in overrides.items():
    config[key] = value
  return config


class PermanentFailureTest(parameterized.TestCase):

  @parameterized.named_parameters(*[(name, name) for name in registry.names()])
  def test_goes_on_or_stops_with_one_line_as_its_rule_declares(self, name):
    config = _failing(name)
    rule = registry.time_rule(config)
    clock = factory.make_clock(config, rule, model_bytes=4e4)
    tolerates = rule.tolerated_failures(config.workers) >= 1
    try:
      for _ in range(40):
        block = clock.next_block(10)
        if name == 'adasync':
          clock.feedback(train_loss=1.0)
    except clock_lib.StalledError as e:
      self.assertFalse(tolerates, f'{name} declares it survives a lost worker but stalled: {e}')
      self.assertNotIn('\n', str(e))
      self.assertRegex(str(e), r'^worker\(s\) \[3\] failed for good at 0.05 s of simulated time, and \w+ waits '
                       r'for every worker at iteration \d+ \(simulated time [\d.e+-]+ s\): the run cannot continue')
      return
    self.assertTrue(tolerates, f'{name} declares it needs every worker but simulated on without worker 3')
    self.assertTrue(np.all(np.isfinite(block.sim_time)))
    self.assertGreater(clock.sim_time, 5 * FAIL_AT_S)
    np.testing.assert_array_equal(block.schedule.microbatches_done[:, 3], 0)  # the lost worker gives nothing

  def test_training_stops_after_logging_what_it_trained(self):
    workdir = self.create_tempdir().full_path
    with self.assertRaisesRegex(recorder_lib.ClusterStalled,
                                r'^worker\(s\) \[3\] failed for good .* Stopped after step \d+; its metrics are in '):
      train.train_and_evaluate(_failing('sync', num_steps=50, log_every=5, eval_every=50), workdir)
    rows = metrics_io.read_rows(workdir)
    self.assertEqual([r['step'] for r in rows], [5])  # the block that ran before the failure is logged

  @parameterized.named_parameters(('ksync', 'ksync'), ('wagma_between_global_averages', 'wagma,sync_every=100'))
  def test_a_survivor_trains_to_the_end(self, arg):
    summary = train.train_and_evaluate(_failing(arg, num_steps=40, eval_every=40),
                                       self.create_tempdir().full_path)
    self.assertEqual(summary['steps'], 40)
    self.assertGreater(summary['sim_time'], 5 * FAIL_AT_S)
    self.assertTrue(np.isfinite(summary['final_eval_accuracy']))

  def test_wagma_stops_at_the_first_global_average_after_the_failure(self):
    """Worker 3 fails in iteration 5; WAGMA's groups go on without it until the global average of iteration 9."""
    workdir = self.create_tempdir().full_path
    with self.assertRaisesRegex(recorder_lib.ClusterStalled,
                                r'^worker\(s\) \[3\] failed for good at 0.05 s of simulated time, and '
                                r'WaitAvoidingGroups waits for every worker at iteration 9 .* '
                                r'Stopped after step 9;'):
      train.train_and_evaluate(_failing('wagma', num_steps=50, log_every=3, eval_every=50), workdir)
    self.assertEqual([r['step'] for r in metrics_io.read_rows(workdir)], [3, 6, 9])


if __name__ == '__main__':
  absltest.main()
