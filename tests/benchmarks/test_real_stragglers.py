"""`benchmarks/real_stragglers.py`'s flags, without starting processes: `--debug_slow_process=I:S` (what it
accepts; a bad value refused in one line naming the flag, before any process starts) and the flags the launcher
hands its processes."""

import types
from unittest import mock

from absl import flags
from absl.testing import absltest
from absl.testing import parameterized

from waitless import config_errors as errors
from benchmarks import real_stragglers


class ParseSlowTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('none', '', 2, (-1, 0.0)),
      ('default', '1:0.004', 2, (1, 0.004)),
      ('first', '0:0.5', 3, (0, 0.5)),
      ('zero_seconds', '2:0', 3, (2, 0.0)),
      ('exponent', '1:4e-3', 2, (1, 0.004)),
  )
  def test_accepts(self, value, processes, expected):
    self.assertEqual(real_stragglers.parse_slow(value, processes), expected)

  @parameterized.named_parameters(
      ('process_out_of_range', '2:0.004'),
      ('negative_process', '-1:0.004'),
      ('negative_seconds', '1:-0.004'),
      ('nan', '1:nan'),
      ('inf', '1:inf'),
      ('no_seconds', '1:'),
      ('no_colon', '1'),
      ('words', 'one:0.004'),
      ('seconds_not_a_number', '1:fast'),
      ('three_parts', '1:0.004:2'),
      ('float_process', '1.0:0.004'),
  )
  def test_refuses(self, value):
    with self.assertRaisesRegex(errors.ConfigError,
                                f'^debug_slow_process={value!r} .*"I:S", a process I in 0..1 and S >= 0') as e:
      real_stragglers.parse_slow(value, 2)
    self.assertNotIn('\n', str(e.exception))

  def test_main_refuses_before_starting_processes(self):
    settings = types.SimpleNamespace(process_id=-1, debug_slow_process='5:0.004', num_processes=2, out='')
    with mock.patch.object(real_stragglers, 'FLAGS', settings), \
         mock.patch.object(real_stragglers, 'launch') as launch:
      with self.assertRaisesRegex(errors.ConfigError, '^debug_slow_process='):
        real_stragglers.main(['real_stragglers.py'])
    launch.assert_not_called()


class ChildFlagsTest(absltest.TestCase):

  def _parsed(self, argv):
    flag_values = flags.FlagValues()
    real_stragglers.define_flags(flag_values)
    flag_values(['real_stragglers.py', *argv])
    return flag_values

  def test_processes_get_the_launchers_values(self):
    """What the launcher parsed reaches every process, the empty `--debug_slow_process=` (no process slowed)
    included; the per-process flags are the launcher's to set."""
    launcher = self._parsed(['--debug_slow_process=', '--repeats=2', '--microbatches=6', '--out=/tmp/x.json'])
    with mock.patch.object(real_stragglers, 'FLAGS', launcher):
      passed = real_stragglers.child_flags()
    self.assertIn('--debug_slow_process=', passed)
    self.assertFalse([a for a in passed if a.startswith(('--out', '--process_id', '--coordinator_address'))])
    child = self._parsed(passed)
    for name in real_stragglers.SHARED_FLAGS:
      self.assertEqual(getattr(child, name), getattr(launcher, name), name)
    self.assertEqual((child.debug_slow_process, child.repeats, child.microbatches), ('', 2, 6))
    self.assertEqual(real_stragglers.parse_slow(child.debug_slow_process, child.num_processes), (-1, 0.0))


if __name__ == '__main__':
  absltest.main()
