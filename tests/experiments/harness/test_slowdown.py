"""`experiments/harness/slowdown.py`'s TEST-ONLY flags `--debug_slow_process=I:S` and `--debug_delay=K:S`: what they
accept, and a bad value refused in one line naming the flag."""

from absl.testing import absltest
from absl.testing import parameterized

from waitless import config_errors as errors
from waitless.experiments.harness import slowdown


class ParseTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('none', '', 2, (-1, 0.0)),
      ('default', '1:0.004', 2, (1, 0.004)),
      ('first', '0:0.5', 3, (0, 0.5)),
      ('zero_seconds', '2:0', 3, (2, 0.0)),
      ('exponent', '1:4e-3', 2, (1, 0.004)),
  )
  def test_accepts(self, value, processes, expected):
    self.assertEqual(slowdown.parse_slow(value, processes), expected)

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
      slowdown.parse_slow(value, 2)
    self.assertNotIn('\n', str(e.exception))

  @parameterized.named_parameters(
      ('none', '', 4, (0, 0.0)),
      ('default', '1:0.02', 4, (1, 0.02)),
      ('every_process', '4:0.5', 4, (4, 0.5)),
      ('zero', '0:0.5', 4, (0, 0.5)),
  )
  def test_delay_accepts(self, value, processes, expected):
    self.assertEqual(slowdown.parse_delay(value, processes), expected)

  @parameterized.named_parameters(
      ('more_than_processes', '5:0.02'),
      ('negative_seconds', '1:-0.02'),
      ('nan', '1:nan'),
      ('no_colon', '1'),
      ('float_count', '1.5:0.02'),
  )
  def test_delay_refuses(self, value):
    with self.assertRaisesRegex(errors.ConfigError, f'^debug_delay={value!r} .*"K:S", K in 0..4 processes') as e:
      slowdown.parse_delay(value, 4)
    self.assertNotIn('\n', str(e.exception))


if __name__ == '__main__':
  absltest.main()
