"""Transformer behaviour (causality, padding, cached decoding) and the seq2seq task (harness/translation.py)."""

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import optax

from waitless.experiments.harness import tasks
from waitless.experiments.harness import translation
from waitless.models import transformer

VOCAB = 20


def _model(**overrides):
  config = dict(vocab_size=VOCAB, emb_dim=16, num_heads=2, num_layers=2, qkv_dim=16, mlp_dim=32, max_len=16,
                dropout_rate=0.0, attention_dropout_rate=0.0)
  config.update(overrides)
  return transformer.Transformer(transformer.TransformerConfig(**config))


def _batch(seed=0, batch=3, length=8):
  rng = np.random.default_rng(seed)
  inputs = rng.integers(3, VOCAB, size=(batch, length)).astype(np.int32)
  targets = rng.integers(3, VOCAB, size=(batch, length)).astype(np.int32)
  inputs[:, -2:] = 0   # padding
  targets[:, -3:] = 0
  return {'inputs': inputs, 'targets': targets, 'mask': np.ones((batch,), np.float32)}


class TransformerTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.model = _model()
    self.batch = _batch()
    self.params = self.model.init(jax.random.key(0), translation.model_inputs(self.batch), train=False)['params']

  def test_logits_shape_and_shared_embedding(self):
    logits = self.model.apply({'params': self.params}, translation.model_inputs(self.batch), train=False)
    self.assertEqual(logits.shape, (3, 8, VOCAB))
    self.assertIn('shared_embedding', self.params)

  def test_decoder_is_causal(self):
    changed = {**self.batch, 'targets': self.batch['targets'].copy()}
    changed['targets'][:, 3] = (changed['targets'][:, 3] + 1) % VOCAB + 3
    apply = lambda b: self.model.apply({'params': self.params}, translation.model_inputs(b), train=False)
    a, b = apply(self.batch), apply(changed)
    # Position t sees targets < t (shifted right): positions 0..3 are unchanged.
    np.testing.assert_allclose(a[:, :4], b[:, :4], atol=1e-5)
    self.assertFalse(np.allclose(a[:, 4:5], b[:, 4:5], atol=1e-5))

  def test_padding_in_the_source_is_ignored(self):
    longer = {k: v for k, v in self.batch.items()}
    longer['inputs'] = np.concatenate([self.batch['inputs'], np.zeros((3, 4), np.int32)], axis=1)
    apply = lambda b: self.model.apply({'params': self.params}, translation.model_inputs(b), train=False)
    real = self.batch['targets'] > 0  # (padding target positions attend to nothing: their logits are moot)
    np.testing.assert_allclose(apply(self.batch)[real], apply(longer)[real], atol=1e-5)

  def test_cached_greedy_decode_matches_full_recomputation(self):
    inputs = jnp.asarray(self.batch['inputs'])
    decoded = np.asarray(translation.greedy_decode(self.model, self.params, inputs, 6, eos_id=1))
    # Reference: re-run the whole decoder on the prefix for each new token.
    prefix = np.zeros((3, 6), np.int32)
    apply = jax.jit(lambda targets: self.model.apply({'params': self.params},
                                                     {'inputs': inputs, 'targets': targets}, train=False))
    for t in range(6):
      logits = apply(jnp.asarray(prefix))
      prefix[:, t] = np.argmax(np.asarray(logits)[:, t], -1)
    for row, ref in zip(decoded, prefix):
      ref = ref.tolist()
      cut = ref.index(1) + 1 if 1 in ref else len(ref)
      self.assertEqual(row.tolist()[:cut], ref[:cut])
      self.assertTrue(all(t == 0 for t in row.tolist()[cut:]))

  def test_a_packed_row_gives_each_pair_its_own_logits(self):
    rng = np.random.default_rng(3)
    pairs = [(rng.integers(3, VOCAB, n), rng.integers(3, VOCAB, m)) for n, m in ((4, 5), (6, 3), (2, 4))]
    length = 16

    def pack(side):
      tokens, segmentation, position = (np.zeros((1, length), np.int32) for _ in range(3))
      start = 0
      for segment, pair in enumerate(pairs, 1):
        seq = pair[side]
        tokens[0, start:start + len(seq)] = seq
        segmentation[0, start:start + len(seq)] = segment
        position[0, start:start + len(seq)] = np.arange(len(seq))
        start += len(seq)
      return tokens, segmentation, position

    (inputs, in_seg, in_pos), (targets, tg_seg, tg_pos) = pack(0), pack(1)
    packed = {'inputs': inputs, 'targets': targets, 'inputs_segmentation': in_seg, 'inputs_position': in_pos,
              'targets_segmentation': tg_seg, 'targets_position': tg_pos}
    apply = jax.jit(lambda b: self.model.apply({'params': self.params}, b, train=False))
    logits = np.asarray(apply(packed))[0]
    for segment, (source, target) in enumerate(pairs, 1):
      alone = {'inputs': np.zeros((1, length), np.int32), 'targets': np.zeros((1, length), np.int32)}
      alone['inputs'][0, :len(source)] = source
      alone['targets'][0, :len(target)] = target
      expected = np.asarray(apply(alone))[0, :len(target)]
      np.testing.assert_allclose(logits[tg_seg[0] == segment], expected, atol=2e-5)
    # Without the segmentation the pairs would see each other: the test can tell.
    unsegmented = np.asarray(apply({'inputs': inputs, 'targets': targets}))[0]
    self.assertFalse(np.allclose(unsegmented[tg_seg[0] == 2], logits[tg_seg[0] == 2], atol=1e-3))

  def test_dropout_needs_and_uses_the_rng(self):
    model = _model(dropout_rate=0.3)
    run = jax.jit(lambda key: model.apply({'params': self.params}, translation.model_inputs(self.batch),
                                          train=True, rngs={'dropout': key}))
    np.testing.assert_array_equal(run(jax.random.key(1)), run(jax.random.key(1)))
    self.assertFalse(np.allclose(run(jax.random.key(1)), run(jax.random.key(2))))


class Seq2SeqTaskTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.task = tasks.get('seq2seq')
    self.model = _model()
    self.batch = _batch()
    inputs = self.task.model_inputs(self.batch)
    self.params = self.model.init(jax.random.key(0), inputs, train=False)['params']

  def test_loss_is_smoothed_cross_entropy_over_real_tokens(self):
    loss, state = self.task.loss(self.model, self.params, {}, self.batch, jax.random.key(0))
    self.assertEqual(state, {})
    logits = self.model.apply({'params': self.params}, translation.model_inputs(self.batch), train=False)
    weights = self.batch['targets'] > 0
    smooth = optax.smooth_labels(jax.nn.one_hot(self.batch['targets'], VOCAB), 0.1 * VOCAB / (VOCAB - 1))
    ce = optax.softmax_cross_entropy(logits, smooth)
    minimum = optax.softmax_cross_entropy(jnp.log(smooth + 1e-20), smooth)
    expected = ((ce - minimum) * weights).sum() / weights.sum()
    np.testing.assert_allclose(loss, expected, rtol=1e-5)

  def test_loss_is_differentiable_and_ignores_padding_positions(self):
    grads = jax.jit(jax.grad(lambda p: self.task.loss(self.model, p, {}, self.batch, None)[0]))(self.params)
    self.assertTrue(all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads)))

  def test_eval_sums_count_real_tokens_of_real_rows(self):
    batch = dict(self.batch, mask=np.array([1.0, 1.0, 0.0], np.float32))
    sums = self.task.eval_sums(self.model, self.params, {}, batch)
    self.assertEqual(float(sums['count']), float((self.batch['targets'][:2] > 0).sum()))
    logits = self.model.apply({'params': self.params}, translation.model_inputs(batch), train=False)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets'])
    weights = (batch['targets'] > 0) * batch['mask'][:, None]
    np.testing.assert_allclose(sums['loss_sum'], (nll * weights).sum(), rtol=1e-5)
    correct = ((np.argmax(logits, -1) == batch['targets']) * weights).sum()
    self.assertEqual(float(sums['correct']), float(correct))

  def test_bleu(self):
    refs = ['the cat sat on the mat', 'a quick brown fox jumps']
    self.assertAlmostEqual(translation.bleu(refs, refs), 100.0, places=4)
    self.assertLess(translation.bleu(['dog', 'tree'], refs), 5.0)


if __name__ == '__main__':
  absltest.main()
