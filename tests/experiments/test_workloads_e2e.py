"""End-to-end: each paper workload config trains a few steps under tfds mock data with its testing-size model."""

import json
import math
import os

from absl.testing import absltest
from absl.testing import parameterized
import pytest
import tensorflow_datasets as tfds

from waitless.cluster import registry
from waitless.experiments.harness import train
from waitless.experiments.harness import validation
from waitless.experiments.configs import cifar10
from waitless.experiments.configs import cifar100
from waitless.experiments.configs import imagenet
from waitless.experiments.configs import wmt

CONFIGS = {'cifar10': cifar10, 'cifar100': cifar100, 'imagenet': imagenet, 'wmt': wmt}

# The documented testing variant of each workload (see each config's docstring).
TESTING = {
    'cifar10': 'model.name=resnet_test',
    'cifar100': 'model.name=wrn_test',
    'imagenet': 'model.name=resnet50_test,model.dtype=float32,dataset.image_size=32',
    'wmt': ('model.name=transformer_test,model.dtype=float32,dataset.vocab_size=64,dataset.max_len=32,'
            'dataset.eval_max_len=32,model.max_len=32'),
}


def _config(workload: str, algorithm: str, tokenizer_dir: str, extra: str = ''):
  arg = ','.join(p for p in (algorithm, TESTING[workload], extra) if p)
  config = CONFIGS[workload].get_config(arg)
  config.workers, config.devices, config.num_steps = 2, 2, 2
  config.num_epochs = None  # num_steps instead of the workload's epochs
  config.batch_size, config.microbatches = 4, 1
  config.eval_every = config.checkpoint_every = 2
  config.log_every = config.steps_per_call = 1
  config.eval_batch_size = 16
  config.optimizer.warmup_steps = 1 if config.optimizer.lr_schedule == 'rsqrt' else 0
  if 'tokenizer_dir' in config.dataset:
    config.dataset.tokenizer_dir = tokenizer_dir
  return config


class WorkloadConfigTest(parameterized.TestCase):

  @parameterized.parameters(*CONFIGS)
  def test_every_registered_algorithm_is_accepted(self, workload):
    for name in registry.names():
      config = CONFIGS[workload].get_config(name)
      validation.validate(config)
      self.assertEqual(config.algorithm.name, name)
      self.assertIn('data_dir', config.dataset)
      self.assertIsNone(config.dataset.data_dir)


class WorkloadEndToEndTest(parameterized.TestCase):

  def _train(self, workload, algorithm, extra='', steps=2):
    workdir = self.create_tempdir().full_path
    config = _config(workload, algorithm, self.create_tempdir().full_path, extra)
    config.num_steps = steps
    with tfds.testing.mock_data(num_examples=32):
      summary = train.train_and_evaluate(config, workdir)
    self.assertEqual(summary['steps'], steps)
    self.assertTrue(math.isfinite(summary['final_train_loss']))
    self.assertTrue(math.isfinite(summary['final_eval_loss']))
    self.assertBetween(summary['final_eval_accuracy'], 0.0, 1.0)
    self.assertTrue(os.path.exists(os.path.join(workdir, 'metrics.jsonl')))
    with open(os.path.join(workdir, 'config.json')) as f:
      self.assertEqual(json.load(f)['dataset']['name'], config.dataset.name)
    return summary

  def test_cifar10_sync(self):
    self._train('cifar10', 'sync')

  def test_wmt_local_sgd(self):
    summary = self._train('wmt', 'local_sgd', 'local_steps=2,bleu.examples=8')
    self.assertBetween(summary['final_eval_bleu'], 0.0, 100.0)  # beam search on the consensus model

  @pytest.mark.slow
  def test_cifar100_local_sgd(self):
    self._train('cifar100', 'local_sgd', 'local_steps=2')

  @pytest.mark.slow
  def test_imagenet_sync(self):
    self._train('imagenet', 'sync')

  @pytest.mark.slow
  def test_cifar10_every_registered_algorithm(self):
    for name in registry.names():
      with self.subTest(name):
        # Two workers: K-of-P variants take K = 2; AdaSync adapts K after two loss reports, so 3 steps.
        extra = 'k=2' if 'k' in registry.get(name).defaults else ''
        self._train('cifar10', name, extra, steps=3)


if __name__ == '__main__':
  absltest.main()
