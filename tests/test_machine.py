"""waitless.machine: the figures a limit is checked against before anything is allocated (issue 59)."""

import resource
from unittest import mock

from absl.testing import absltest

from waitless import machine


class MachineTest(absltest.TestCase):

  def test_the_figures_are_positive(self):
    self.assertGreater(machine.available_memory_bytes(), 0)
    self.assertGreaterEqual(machine.cpu_count(), 1)
    self.assertEqual(machine.gigabytes(8.6e9), '8.6 GB')

  def test_a_cgroup_limit_or_ulimit_that_leaves_less_wins(self):
    with mock.patch.object(machine, '_cgroup_memory_left', return_value=10**9):
      self.assertLessEqual(machine.available_memory_bytes(), 10**9)
    with mock.patch.object(machine, '_address_space_left', return_value=5 * 10**8):
      self.assertLessEqual(machine.available_memory_bytes(), 5 * 10**8)

  def test_no_ulimit_is_no_limit(self):
    with mock.patch.object(resource, 'getrlimit', return_value=(resource.RLIM_INFINITY, resource.RLIM_INFINITY)):
      self.assertIsNone(machine._address_space_left())


if __name__ == '__main__':
  absltest.main()
