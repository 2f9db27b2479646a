"""The whole WMT path learns: tokenizer, packing, Transformer, schedule, beam search and BLEU on a toy language.

No WMT data can be downloaded in tests, so tfds is mocked with pairs of a word-substitution cipher (each
English word of a 20-word vocabulary has one "German" word; the order is kept). A tiny Transformer trained by
the WMT config's own pipeline must go from BLEU ~0 to a near-perfect translation of held-out sentences.
"""

import json
import os

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from waitless.experiments.harness import train
from waitless.experiments.configs import wmt

ENGLISH = ('one two three four five six seven eight nine ten red blue green black white cat dog bird fish '
           'tree').split()
GERMAN = ('eins zwei drei vier fuenf sechs sieben acht neun zehn rot blau gruen schwarz weiss katze hund vogel '
          'fisch baum').split()


def cipher_pairs(count: int, seed: int) -> dict[str, list[str]]:
  """`count` sentences of 3-7 random words and their word-by-word translations."""
  rng = np.random.default_rng(seed)
  pairs = {'en': [], 'de': []}
  for _ in range(count):
    words = rng.integers(0, len(ENGLISH), rng.integers(3, 8))
    pairs['en'].append(' '.join(ENGLISH[w] for w in words))
    pairs['de'].append(' '.join(GERMAN[w] for w in words))
  return pairs


def _cipher_as_dataset(builder, split, **unused):
  del builder, unused
  train_split = str(split) == 'train'
  return tf.data.Dataset.from_tensor_slices(cipher_pairs(2000 if train_split else 100, 0 if train_split else 1))


class TranslationLearnsTest(parameterized.TestCase):

  @parameterized.parameters(('sync', ''), ('local_sgd', 'local_steps=4'))
  def test_bleu_of_held_out_sentences_rises_to_near_perfect(self, algorithm, extra):
    arg = ','.join(p for p in (
        algorithm, extra, 'model.name=transformer_test,model.dtype=float32,model.max_len=32,'
        'model.dropout_rate=0.0,model.attention_dropout_rate=0.0,dataset.vocab_size=64,dataset.max_len=32,'
        'dataset.eval_max_len=32,workers=2,devices=2,batch_size=8,num_steps=600,eval_every=200,'
        'checkpoint_every=600,optimizer.learning_rate=0.01,optimizer.warmup_steps=100,bleu.examples=100') if p)
    config = wmt.get_config(arg)
    config.dataset.tokenizer_dir = self.create_tempdir().full_path
    workdir = self.create_tempdir().full_path
    with tfds.testing.mock_data(as_dataset_fn=_cipher_as_dataset):
      summary = train.train_and_evaluate(config, workdir)
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      bleu = [row['eval_bleu'] for row in map(json.loads, f) if 'eval_bleu' in row]
    self.assertLen(bleu, 3)
    self.assertGreater(summary['final_eval_bleu'], 90.0)
    self.assertGreater(summary['final_eval_accuracy'], 0.95)
    self.assertLess(bleu[0], summary['final_eval_bleu'])


if __name__ == '__main__':
  absltest.main()
