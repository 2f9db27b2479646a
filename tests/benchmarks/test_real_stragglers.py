"""`benchmarks/real_stragglers.py` without starting processes: its flags refused before any process starts (the
parsers of `--debug_slow_process` and `--debug_delay` are
`experiments.harness.slowdown`'s, tested there), the sleep table
every process and the prediction read, and the flags the launcher hands its processes."""

import types

import numpy as np
from unittest import mock

from absl import flags
from absl.testing import absltest
from absl.testing import parameterized

from waitless import config_errors as errors
from benchmarks import real_stragglers


class FlagsTest(parameterized.TestCase):

  def test_conditions(self):
    self.assertEqual(real_stragglers.parse_conditions(['delayed']), ('none', 'delayed'))
    self.assertEqual(real_stragglers.parse_conditions(['delayed', 'slowed', 'none']), real_stragglers.CONDITIONS)
    with self.assertRaisesRegex(errors.ConfigError, '^conditions=.*subset of none,slowed,delayed'):
      real_stragglers.parse_conditions(['slow'])

  @parameterized.named_parameters(
      ('slow', {'debug_slow_process': '5:0.004'}, '^debug_slow_process='),
      ('delay', {'debug_delay': '3:x'}, '^debug_delay='),
      ('conditions', {'conditions': ['late']}, '^conditions='),
      ('base_sleep', {'debug_base_sleep': -0.01}, '^debug_base_sleep=-0.01 .*>= 0'),
  )
  def test_main_refuses_before_starting_processes(self, bad, message):
    settings = types.SimpleNamespace(**{'process_id': -1, 'debug_slow_process': '1:0.004', 'debug_delay': '1:0.02',
                                        'debug_base_sleep': 0.01, 'conditions': ['none'], 'num_processes': 2,
                                        'out': '', **bad})
    with mock.patch.object(real_stragglers, 'FLAGS', settings), \
         mock.patch.object(real_stragglers, 'launch') as launch:
      with self.assertRaisesRegex(errors.ConfigError, message):
        real_stragglers.main(['real_stragglers.py'])
    launch.assert_not_called()


class SleepTableTest(absltest.TestCase):

  def _table(self, step, condition, slow=(1, 0.004), delay=(2, 0.02), seed=0, base=0.0):
    return real_stragglers.sleep_table(step, condition, 5, 3, slow, delay, seed, base)

  def test_base_sleep_is_everywhere_and_adds_to_the_slowdown(self):
    for condition in real_stragglers.CONDITIONS:
      np.testing.assert_allclose(self._table(4, condition, base=0.01), self._table(4, condition) + np.float32(0.01))

  def test_none_sleeps_nowhere(self):
    np.testing.assert_array_equal(self._table(7, 'none'), np.zeros((5, 3)))

  def test_slowed_is_one_process_every_microbatch(self):
    expected = np.zeros((5, 3), np.float32)
    expected[1] = 0.004
    for step in (0, 9):
      np.testing.assert_array_equal(self._table(step, 'slowed'), expected)

  def test_delayed_is_k_processes_once_drawn_from_the_step(self):
    tables = np.stack([self._table(step, 'delayed') for step in range(50)])
    np.testing.assert_array_equal(tables[:, :, 1:], 0)  # once per iteration: the first micro-batch only
    np.testing.assert_array_equal((tables[:, :, 0] > 0).sum(axis=1), np.full(50, 2))
    np.testing.assert_array_equal(tables[tables > 0], np.float32(0.02))
    self.assertEqual(len({tuple(np.flatnonzero(t[:, 0])) for t in tables}), 10)  # every pair of 5 comes up
    # every process computes the same table for a step (no host state), a different seed draws others
    np.testing.assert_array_equal(tables[3], self._table(3, 'delayed'))
    others = np.stack([self._table(step, 'delayed', seed=1) for step in range(50)])
    self.assertFalse(np.array_equal(tables, others))

  def test_replayed_trace_is_the_timed_iterations_in_order(self):
    results = {'workers': 5, 'microbatches': 3, 'speeds_s': {'none': [0.001, 0.002, 0.003, 0.004, 0.005]},
               'warmup': 2, 'timed': 4, 'slow': [1, 0.004], 'delay': [2, 0.02], 'seed': 0}
    trace = real_stragglers.replayed_trace(results, 'delayed')
    self.assertEqual(trace.shape, (4 * 3, 5))
    for i, step in enumerate(range(2, 6)):  # micro-batch k of timed iteration i is row 3 i + k
      np.testing.assert_allclose(trace[3 * i:3 * i + 3],
                                 np.array(results['speeds_s']['none'])[None] + self._table(step, 'delayed').T)


class ChildFlagsTest(absltest.TestCase):

  def _parsed(self, argv):
    flag_values = flags.FlagValues()
    real_stragglers.define_flags(flag_values)
    flag_values(['real_stragglers.py', *argv])
    return flag_values

  def test_processes_get_the_launchers_values(self):
    """What the launcher parsed reaches every process, the empty `--debug_slow_process=` (no process slowed)
    included; the per-process flags are the launcher's to set."""
    launcher = self._parsed(['--debug_slow_process=', '--repeats=2', '--microbatches=6', '--out=/tmp/x.json',
                             '--conditions=none,delayed'])
    with mock.patch.object(real_stragglers, 'FLAGS', launcher):
      passed = real_stragglers.child_flags()
    self.assertIn('--debug_slow_process=', passed)
    self.assertFalse([a for a in passed if a.startswith(('--out', '--process_id', '--coordinator_address'))])
    child = self._parsed(passed)
    for name in real_stragglers.SHARED_FLAGS:
      self.assertEqual(getattr(child, name), getattr(launcher, name), name)
    self.assertEqual((child.debug_slow_process, child.repeats, child.microbatches), ('', 2, 6))
    self.assertEqual(child.conditions, ['none', 'delayed'])
    self.assertEqual(real_stragglers.parse_slow(child.debug_slow_process, child.num_processes), (-1, 0.0))


if __name__ == '__main__':
  absltest.main()
