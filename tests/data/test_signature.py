"""A data set's signature (`data.registry.signature`: example shapes, classes, task) is its data set's, without the
data: a model is sized from it (`tasks.model_bytes`) where the data set is absent."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
import tensorflow_datasets as tfds

from waitless.data import registry
from waitless.experiments.configs import cifar10
from waitless.experiments.configs import digits
from waitless.experiments.configs import imagenet
from waitless.experiments.configs import mnist1d
from waitless.experiments.configs import synthetic
from waitless.experiments.configs import wmt
from waitless.experiments.harness import tasks


def _assert_same(test, signature, dataset):
  structs = lambda tree: jax.tree.map(lambda x: (np.shape(x), np.asarray(x).dtype), tree)
  test.assertEqual(structs(signature.example), structs(dataset.example))
  test.assertEqual((signature.num_classes, signature.task), (dataset.num_classes, dataset.task))


class SignatureTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('digits', lambda: digits.get_config('sync')), ('mnist1d', lambda: mnist1d.get_config('sync')),
      ('least_squares', lambda: synthetic.get_config('sync')),
      ('logistic', lambda: synthetic.get_config('sync,dataset.problem=logistic')))
  def test_an_embedded_data_set_has_its_own_signature(self, make):
    config = make()
    _assert_same(self, registry.signature(config), registry.make_dataset(config))

  @parameterized.named_parameters(
      ('cifar10', lambda: cifar10.get_config('sync,workers=2,devices=2,batch_size=4')),
      ('imagenet', lambda: imagenet.get_config('sync,workers=2,devices=2,batch_size=4,dataset.image_size=32')))
  def test_a_tfds_image_data_set_has_its_own_signature(self, make):
    config = make()
    with tfds.testing.mock_data(num_examples=16):
      dataset = registry.make_dataset(config)
    signature = registry.signature(config)
    _assert_same(self, signature, dataset)
    if config.dataset.name == 'imagenet2012':  # mock data has the builder's classes
      self.assertEqual(signature.num_classes, 1000)

  @parameterized.parameters(False, True)
  def test_wmt_sizes_its_inputs_by_max_len_and_its_vocabulary_by_vocab_size(self, packing):
    config = wmt.get_config(f'sync,dataset.packing={packing}')
    signature = registry.signature(config)
    self.assertEqual(signature.task, 'seq2seq')
    self.assertEqual(signature.num_classes, config.dataset.vocab_size)
    keys = ['inputs', 'targets'] + ([f'{s}_{p}' for s in ('inputs', 'targets') for p in ('segmentation', 'position')]
                                    if packing else [])
    self.assertEqual({k: v.shape for k, v in signature.example.items()},
                     {k: (config.dataset.max_len,) for k in keys})
    self.assertGreater(tasks.model_bytes(config), 4 * 60e6)  # Transformer base: about 60M parameters and more

  def test_resnet50_is_sized_without_imagenet(self):
    # No data set files and no mock: ResNet-50's 25,557,032 float32 parameters (1000 classes).
    config = imagenet.get_config('sync')
    self.assertEqual(tasks.model_bytes(config), 25_557_032 * 4)

  def test_an_unknown_data_set_is_one_error_naming_the_field(self):
    config = digits.get_config('sync')
    config.dataset.name = 'mnist'
    with self.assertRaisesRegex(ValueError, r"dataset.name='mnist' is not allowed: known: "):
      registry.signature(config)


if __name__ == '__main__':
  absltest.main()
