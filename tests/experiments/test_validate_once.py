"""A run's config is validated once and its cluster profile parsed once, on every program's path.

`experiments.main` trains one run through `train.train_and_evaluate` (several seeds through `setup.plan_groups`
and `train.train_group`), `experiments.simulate` drives the clock alone (`simulate.simulate`). Counted:
`validation.validate` (the whole check of a run's config), `cluster.factory.validate` (its cluster part, which
`simulate` runs alone) and `cluster.profiles.parse` (reading a profile's figures).
"""

import contextlib
import os
from unittest import mock

from absl.testing import absltest

from waitless.cluster import factory
from waitless.cluster import profiles
from waitless.experiments import simulate
from waitless.experiments.configs import digits
from waitless.experiments.harness import setup
from waitless.experiments.harness import train
from waitless.experiments.harness import validation

PROFILE = 'dgx_h100'  # a shipped profile with figures for digits/mlp


def _config(arg: str = 'sync'):
  config = digits.get_config(f'{arg},num_steps=4,eval_every=4,log_every=2,checkpoint_every=4,steps_per_call=2,'
                             'workers=2,devices=2')
  config.cluster.profile = PROFILE
  return config


@contextlib.contextmanager
def _counting():
  """Yields {name: mock} for the counted functions, each still doing its work."""
  with mock.patch.object(validation, 'validate', wraps=validation.validate) as validate, \
       mock.patch.object(factory, 'validate', wraps=factory.validate) as cluster_validate, \
       mock.patch.object(profiles, 'parse', wraps=profiles.parse) as parse:
    yield {'validate': validate, 'cluster_validate': cluster_validate, 'parse': parse}


class ValidateOnceTest(absltest.TestCase):

  def test_a_main_run_validates_once_and_parses_its_profile_once(self):
    with _counting() as counts:
      summary = train.train_and_evaluate(_config(), self.create_tempdir().full_path)
    self.assertEqual(summary['steps'], 4)
    self.assertEqual(counts['validate'].call_count, 1)
    self.assertEqual(counts['cluster_validate'].call_count, 1)
    self.assertEqual(counts['parse'].call_count, 1)

  def test_main_with_seeds_validates_each_seed_once(self):
    # experiments.main --seeds=2: the run that sizes the program is handed on to training, not built again.
    configs = [_config(), _config()]
    configs[1].seed = 1
    root = self.create_tempdir().full_path
    workdirs = [os.path.join(root, f'seed{c.seed}') for c in configs]
    with _counting() as counts:
      planned, = setup.plan_groups(configs, workdirs, max_replicas=2)
      outcomes = train.train_group(configs, workdirs, built=planned.built)
    self.assertEqual(planned.indices, [0, 1])
    self.assertEqual([o['steps'] for o in outcomes], [4, 4])
    self.assertEqual(counts['validate'].call_count, 2)
    self.assertEqual(counts['parse'].call_count, 2)

  def test_simulate_validates_once_and_parses_its_profile_once(self):
    with _counting() as counts:
      result = simulate.simulate(_config('local_sgd'), iterations=20, nbytes=1e5)
    self.assertEqual((result['iterations'], result['profile']), (20, PROFILE))
    self.assertEqual(counts['cluster_validate'].call_count, 1)
    self.assertEqual(counts['parse'].call_count, 1)


if __name__ == '__main__':
  absltest.main()
