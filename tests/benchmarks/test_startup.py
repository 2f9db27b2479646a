"""The start-up benchmark's breakdown: every phase it times is entered (a renamed harness function would leave it
empty), and its lines group the imports by package."""

from absl.testing import absltest

from benchmarks import startup


class BreakdownTest(absltest.TestCase):

  def test_a_cold_run_is_broken_down_into_its_phases_and_programs(self):
    seconds, phases = startup.breakdown(warm=False)
    for phase in ('data load', 'initial state', 'loop: 10 steps, evaluation, metrics', 'checkpoints',
                  'import waitless', 'interpreter start and exit (outside the driver)'):
      self.assertIn(phase, phases)
    self.assertIn('compile block_step (in loop: 10 steps, evaluation, metrics)', phases)
    self.assertAlmostEqual(sum(phases.values()), seconds, delta=0.05 * seconds)

  def test_imports_are_grouped_by_package(self):
    phases = {'import jax': 1.0, 'import jaxlib': 0.5, 'import waitless': 0.2, 'import scipy': 0.3,
              'import yaml': 0.1, 'compile block_step (in loop)': 2.0}
    lines = dict(startup._grouped(phases, {'jax', 'jaxlib'}))
    self.assertEqual(lines['imports: jax, flax, optax, orbax and what they import'], 1.5)
    self.assertEqual(lines['imports: waitless modules'], 0.2)
    self.assertAlmostEqual(lines['imports: other packages (scipy 0.30, yaml 0.10)'], 0.4)
    self.assertEqual(lines['compile block_step (in loop)'], 2.0)


if __name__ == '__main__':
  absltest.main()
