"""WMT pipeline and SentencePiece tokenizer under tfds mock data (random strings)."""

import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import ml_collections
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from waitless import config_errors as errors
from waitless.data import registry
from waitless.data import tfds_pipeline
from waitless.data import tokenizer
from waitless.data import wmt
from waitless.experiments.harness import translation
from waitless.models import registry as models_registry

EXAMPLES = 40


def _config(tokenizer_dir, workers=4, batch_size=4, microbatches=2, seed=0, **dataset):
  d = {'name': 'wmt', 'tfds_name': 'wmt17_translate/de-en', 'data_dir': None, 'vocab_size': 48, 'max_len': 24,
       'eval_max_len': 24, 'tokenizer_dir': tokenizer_dir, **dataset}
  return ml_collections.ConfigDict({'workers': workers, 'batch_size': batch_size, 'microbatches': microbatches,
                                    'seed': seed, 'dataset': d})


def _rows(tokens):
  """Each padded sequence of a (..., L) array as a tuple without padding."""
  flat = tokens.reshape(-1, tokens.shape[-1])
  return [tuple(int(t) for t in row if t) for row in flat]


class TokenizerTest(absltest.TestCase):

  def test_trains_once_then_loads_with_reserved_ids(self):
    model_dir = self.create_tempdir().full_path
    rng = np.random.default_rng(0)
    sentences = [''.join(rng.choice(list(' abcdefghij'), size=15)) for _ in range(50)]
    sp = tokenizer.train_or_load(sentences, 40, model_dir)
    files = sorted(os.listdir(model_dir))
    self.assertLen(files, 1)
    self.assertEqual((sp.pad_id(), sp.eos_id(), sp.unk_id()), (0, 1, 2))
    self.assertLessEqual(sp.get_piece_size(), 40)
    text = 'abc hij gaf'
    self.assertEqual(sp.decode(sp.encode(text)), text)
    self.assertTrue(all(t > 2 for t in sp.encode(text)))
    mtime = os.path.getmtime(os.path.join(model_dir, files[0]))
    again = tokenizer.train_or_load(sentences, 40, model_dir)
    self.assertEqual(os.path.getmtime(os.path.join(model_dir, files[0])), mtime)
    self.assertEqual(again.encode(text), sp.encode(text))
    # Another corpus gets another model file, never the cached one.
    tokenizer.train_or_load(sentences[::-1][:30], 40, model_dir)
    self.assertLen(os.listdir(model_dir), 2)


class RaggedTest(absltest.TestCase):

  def test_padded_truncates_and_select_keeps_order(self):
    ragged = wmt.Ragged.from_lists([[5, 6, 1], [7, 1], [8, 9, 10, 11, 1]])
    np.testing.assert_array_equal(ragged.padded(np.array([2, 0, 1]), 4),
                                  [[8, 9, 10, 11], [5, 6, 1, 0], [7, 1, 0, 0]])
    chosen = ragged.select(np.array([2, 1]))
    self.assertEqual(_rows(chosen.padded(np.arange(2), 6)), [(8, 9, 10, 11, 1), (7, 1)])


def _pairs_of_packed(tokens, segmentation):
  """The sequences of a packed (..., L) array, as tuples, split by segment."""
  flat_tokens = tokens.reshape(-1, tokens.shape[-1])
  flat_segments = segmentation.reshape(-1, tokens.shape[-1])
  return [tuple(int(t) for t in row[seg == k]) for row, seg in zip(flat_tokens, flat_segments)
          for k in range(1, int(seg.max()) + 1)]


class PackingTest(absltest.TestCase):

  def test_next_fit_keeps_order_and_respects_both_lengths(self):
    rng = np.random.default_rng(0)
    inputs = rng.integers(1, 9, 200)
    targets = rng.integers(1, 9, 200)
    order = rng.permutation(200)
    rows = wmt.pack(inputs, targets, order, max_len=12)
    np.testing.assert_array_equal(rows.tokens, order)
    for r in range(len(rows)):
      members = rows.tokens[rows.offsets[r]:rows.offsets[r + 1]]
      self.assertNotEmpty(members)
      self.assertLessEqual(inputs[members].sum(), 12)
      self.assertLessEqual(targets[members].sum(), 12)
      if r + 1 < len(rows):  # next-fit: the next row's first pair did not fit in this one
        nxt = rows.tokens[rows.offsets[r + 1]]
        self.assertTrue(inputs[members].sum() + inputs[nxt] > 12 or targets[members].sum() + targets[nxt] > 12)
    self.assertBetween(len(rows), -(-max(inputs.sum(), targets.sum()) // 12), 150)

  def test_packed_rows_unpack_to_the_pairs_with_positions(self):
    side = wmt.Ragged.from_lists([[5, 6, 1], [7, 1], [8, 9, 10, 1], [4, 1]])
    rows = wmt.Ragged(np.array([2, 0, 3, 1]), np.array([0, 2, 4]))  # rows (2, 0) and (3, 1)
    tokens, segmentation, position = wmt.packed_rows(side, rows, np.array([1, 0, 1]), 8)
    np.testing.assert_array_equal(tokens, [[4, 1, 7, 1, 0, 0, 0, 0], [8, 9, 10, 1, 5, 6, 1, 0],
                                           [4, 1, 7, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(segmentation[1], [1, 1, 1, 1, 2, 2, 2, 0])
    np.testing.assert_array_equal(position[1], [0, 1, 2, 3, 0, 1, 2, 0])
    np.testing.assert_array_equal(position[0], [0, 1, 0, 1, 0, 0, 0, 0])


class WmtPipelineTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.enter_context(tfds.testing.mock_data(num_examples=EXAMPLES))
    self.tokenizer_dir = self.create_tempdir().full_path

  def test_batches_dataset_fields_and_tokens(self):
    ds = registry.make_dataset(_config(self.tokenizer_dir))
    self.assertEqual(ds.task, 'seq2seq')
    self.assertEqual(ds.num_classes, ds.tokenizer.get_piece_size())
    self.assertEqual(ds.train_size, EXAMPLES)
    batch = ds.train.read(np.arange(4), np.zeros((2, 4), int), 2)
    for key in ('inputs', 'targets'):
      self.assertEqual(batch[key].shape, (2, 4, 2, 2, 24))
      self.assertEqual(batch[key].dtype, np.int32)
      for row in _rows(batch[key]):
        self.assertEqual(row[-1], tokenizer.EOS_ID)
        self.assertNotIn(tokenizer.EOS_ID, row[:-1])
    self.assertEqual(ds.example['inputs'].shape, (24,))
    source = ds.tokenizer.decode(list(_rows(batch['inputs'][0, 0, 0])[0][:-1]))
    self.assertIn(source, ds.eval_sources)  # mock data: every split yields the same random pairs

  def test_disjoint_shards_same_positions_and_resume(self):
    config = _config(self.tokenizer_dir)
    ds = registry.make_dataset(config)
    shard = ds.train.shard_size
    self.assertEqual(shard, EXAMPLES // 4)
    epoch = shard // 2
    per_worker = [set(_rows(ds.train.read(np.array([w]), np.array([[0]]), epoch)['inputs'])) for w in range(4)]
    self.assertEqual([len(s) for s in per_worker], [shard] * 4)
    self.assertLen(set.union(*per_worker), 4 * shard)
    first = ds.train.read(np.arange(4), np.array([[3, 3, 3, 3]]), 2)
    fresh = registry.make_dataset(config)  # cached tokenizer and tokens
    again = fresh.train.read(np.array([2]), np.array([[4]]), 1)
    np.testing.assert_array_equal(again['targets'][0, 0, 0], first['targets'][0, 2, 1])

  def test_packed_rows_hold_every_pair_once_in_disjoint_shards_and_resume(self):
    config = _config(self.tokenizer_dir, workers=2, batch_size=1, microbatches=1, packing=True, max_len=48)
    ds = registry.make_dataset(config)
    unpacked = registry.make_dataset(_config(self.tokenizer_dir, workers=1, batch_size=1, microbatches=1,
                                             max_len=48))
    every_pair = _rows(unpacked.train.read(np.array([0]), np.array([[0]]), EXAMPLES)['inputs'])
    rows_per_worker = ds.train.shard_size
    self.assertLess(rows_per_worker * 2, EXAMPLES)  # several pairs per row
    epoch = ds.train.read(np.arange(2), np.zeros((1, 2), int), rows_per_worker)
    self.assertEqual(epoch['inputs'].shape, (1, 2, rows_per_worker, 1, 48))
    for name in ('inputs', 'targets'):
      packed = _pairs_of_packed(epoch[name], epoch[f'{name}_segmentation'])
      positions = epoch[f'{name}_position'][epoch[f'{name}_segmentation'] > 0]
      self.assertEqual(len(positions), sum(len(p) for p in packed))
      self.assertTrue(all(p[-1] == tokenizer.EOS_ID for p in packed))
    sources = [_pairs_of_packed(epoch['inputs'][:, w], epoch['inputs_segmentation'][:, w]) for w in range(2)]
    self.assertEmpty(set(sources[0]) & set(sources[1]))
    self.assertContainsSubset(set(sources[0]) | set(sources[1]), set(every_pair))
    self.assertLen(sources[0] + sources[1], len(set(sources[0]) | set(sources[1])))
    fresh = registry.make_dataset(config)
    again = fresh.train.read(np.array([1]), np.array([[2]]), 1)
    for key, value in again.items():
      np.testing.assert_array_equal(value[0, 0, 0], epoch[key][0, 1, 2], err_msg=key)
    self.assertIn('inputs_segmentation', ds.example)

  def test_long_pairs_are_dropped_from_training_and_truncated_in_eval(self):
    ds = registry.make_dataset(_config(self.tokenizer_dir, max_len=12, eval_max_len=12, workers=1,
                                       batch_size=1, microbatches=1))
    self.assertLess(ds.train_size, EXAMPLES)
    batches = list(ds.eval_batches(16))
    self.assertEqual(sum(b['mask'].sum() for b in batches), EXAMPLES)
    self.assertEqual(batches[0]['inputs'].shape, (16, 12))

  def test_bleu_lines_translations_up_with_their_references(self):
    ds = registry.make_dataset(_config(self.tokenizer_dir, workers=1, batch_size=1, microbatches=1))
    model = models_registry.make_model(ml_collections.ConfigDict({'name': 'transformer_test', 'max_len': 24}),
                                       ds.num_classes)
    params = model.init(jax.random.key(0), jax.tree.map(lambda x: x[None], ds.example), train=False)['params']
    greedy = []
    for batch in ds.eval_batches(8):
      ids = translation.greedy_decode(model, params, jax.numpy.asarray(batch["inputs"]), 24)
      greedy.extend(translation.detokenize(ds.tokenizer, np.asarray(ids))[:int(batch['mask'].sum())])
    self.assertLen(greedy, EXAMPLES)
    self.assertGreater(len(set(greedy)), 1)
    # In another batching (the last batch padded), bleu_score scores the same translations, in order, against
    # the references of the same sentences.
    with mock.patch.object(translation, 'bleu', side_effect=lambda h, r: (list(h), list(r))):
      hypotheses, references = translation.bleu_score(model, params, ds, batch_size=16, max_decode_len=24,
                                                      beam_size=1)
      self.assertEqual(hypotheses, greedy)
      self.assertEqual(references, list(ds.eval_references))
      hypotheses, references = translation.bleu_score(model, params, ds, batch_size=16, max_decode_len=24,
                                                      beam_size=1, max_examples=7)
      self.assertEqual((hypotheses, references), (greedy[:7], list(ds.eval_references[:7])))
    config = ml_collections.ConfigDict({'bleu': {'examples': 10, 'beam_size': 3, 'alpha': 0.6, 'batch_size': 4,
                                                 'max_decode_len': 8}})
    scores = translation.eval_bleu(model, params, ds, config)
    self.assertBetween(scores['eval_bleu'], 0.0, 100.0)
    config.bleu.examples = 0
    self.assertEqual(translation.eval_bleu(model, params, ds, config), {})

  def test_evaluation_can_come_from_another_dataset(self):
    def as_dataset(builder, split, **unused):
      del unused
      year = builder.name[3:5]  # wmt14_translate / wmt17_translate
      texts = [f'{split} {year} sentence {i}' for i in range(6)]
      return tf.data.Dataset.from_tensor_slices({'en': texts, 'de': texts})

    with tfds.testing.mock_data(as_dataset_fn=as_dataset):
      ds = registry.make_dataset(_config(self.tokenizer_dir, workers=1, batch_size=1, microbatches=1,
                                         eval_tfds_name='wmt14_translate/de-en'))
      same = registry.make_dataset(_config(self.tokenizer_dir, workers=1, batch_size=1, microbatches=1))
    self.assertEqual(ds.eval_references[0], 'test 14 sentence 0')
    self.assertEqual(same.eval_references[0], 'test 17 sentence 0')
    self.assertEqual(ds.train_size, 6)

  def test_unknown_language_is_a_config_error(self):
    with self.assertRaisesRegex(errors.ConfigError, 'source_language'):
      registry.make_dataset(_config(self.tokenizer_dir, source_language='fr'))


class MissingWmtTest(parameterized.TestCase):

  @parameterized.parameters('wmt17_translate/de-en', 'wmt14_translate/de-en')
  def test_one_line_message_with_the_location_and_how_to_prepare(self, name):
    data_dir = self.create_tempdir().full_path
    with self.assertRaises(tfds_pipeline.DatasetNotFoundError) as raised:
      registry.make_dataset(_config(self.create_tempdir().full_path, data_dir=data_dir, tfds_name=name))
    message = str(raised.exception)
    self.assertIn(f'tfds build {name} --data_dir={data_dir}', message)
    self.assertNotIn('\n', message)


if __name__ == '__main__':
  absltest.main()
