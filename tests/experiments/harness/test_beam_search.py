"""Beam search (experiments/harness/beam_search.py): exact against brute force on a toy model, scores consistent with
the rule score = log p(y|x) / ((5 + |y|) / 6) ** alpha, early stopping, and the Transformer's cached beam
decoding against its teacher-forced forward pass."""

from __future__ import annotations

import itertools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from waitless.experiments.harness import beam_search
from waitless.experiments.harness import translation
from waitless.models import transformer

EOS = 1


def _lp(n, alpha):
  return ((5.0 + n) / 6.0) ** alpha


def _ends(seq):
  """Number of tokens of the hypothesis `seq` (up to and including its first EOS; all when there is none)."""
  seq = list(seq)
  return seq.index(EOS) + 1 if EOS in seq else len(seq)


def _rule(token_log_probs, seq, alpha):
  """The score of `seq` given its per-token log-probabilities: log p / lp(|y|) when it ended with EOS, plain
  log p when it never did (the alive fallback)."""
  n = _ends(seq)
  logp = float(np.sum(token_log_probs[:n]))
  return logp / _lp(n, alpha) if EOS in list(seq) else logp


# A toy "model": per batch row b, a second-order Markov chain with a position-dependent table
# table[b, t, y_{t-2}, y_{t-1}, y_t] of log-probabilities (start tokens 0). Its decoding cache is the position
# (a scalar shared by all rows, like the Transformer's `cache_index`), the token before the one fed in and
# the batch row, so a cache not gathered with its beam gives wrong log-probabilities.


def _table(seed, batch=3, length=4, vocab=4, scale=1.5, eos_shift=0.0):
  rng = np.random.default_rng(seed)
  logits = scale * rng.standard_normal((batch, length, vocab, vocab, vocab))
  logits[..., EOS] += eos_shift
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def _token_log_probs(table_row, seq):
  prev2 = prev1 = 0
  out = []
  for t, y in enumerate(seq):
    out.append(table_row[t, prev2, prev1, y])
    prev2, prev1 = prev1, y
  return np.array(out)


def _toy_search(table, alpha, beam_size, on_step=None):
  batch, length = table.shape[:2]
  table = jnp.asarray(table, jnp.float32)

  def tokens_to_logits(flat_ids, cache):
    t = cache['index']
    if on_step is not None:
      jax.debug.callback(on_step, t)
    logits = table[cache['row'], t, cache['prev'], flat_ids[:, 0]]
    return logits, {'index': t + 1, 'prev': flat_ids[:, 0], 'row': cache['row']}

  cache = {'index': jnp.array(0, jnp.int32), 'prev': jnp.zeros((batch,), jnp.int32),
           'row': jnp.arange(batch, dtype=jnp.int32)}
  return beam_search.beam_search(tokens_to_logits, cache, batch, beam_size, length, alpha=alpha, eos_id=EOS)


_toy_search_jit = jax.jit(_toy_search, static_argnums=(2,))


def _brute_force(table_row, alpha):
  """Every finished hypothesis (all sequences of the table's length, cut at their first EOS, that have one),
  in float64, as (score, tokens padded with 0), best first."""
  length, vocab = table_row.shape[0], table_row.shape[-1]
  hypotheses = set()
  for seq in itertools.product(range(vocab), repeat=length):
    if EOS in seq:
      n = _ends(seq)
      hypotheses.add(seq[:n] + (0,) * (length - n))
  ranked = [(_rule(_token_log_probs(table_row, h), h, alpha), h) for h in hypotheses]
  return sorted(ranked, reverse=True)


def _assert_zeros_after_eos(test, seqs):
  for seq in np.asarray(seqs).reshape(-1, np.shape(seqs)[-1]).tolist():
    test.assertTrue(all(t == 0 for t in seq[_ends(seq):]), seq)


class ToyBeamSearchTest(parameterized.TestCase):

  @parameterized.parameters(0.0, 0.6)
  def test_a_beam_holding_every_hypothesis_finds_all_of_them_in_order(self, alpha):
    # vocab 4, length 4: a beam of 4 ** 4 never drops a candidate, so the search is exhaustive.
    for seed in (0, 1):
      table = _table(seed)
      seqs, scores = map(np.asarray, _toy_search_jit(table, alpha, 4 ** 4))
      self.assertEqual((seqs.shape, seqs.dtype, scores.shape), ((3, 256, 4), np.int32, (3, 256)))
      for b in range(3):
        brute = _brute_force(table[b], alpha)
        self.assertLen(brute, 1 + 3 + 9 + 27)
        np.testing.assert_array_equal(seqs[b, :len(brute)], [h for _, h in brute])
        np.testing.assert_allclose(scores[b, :len(brute)], [s for s, _ in brute], atol=1e-5)
        self.assertTrue(np.all(scores[b, len(brute):] == -np.inf))
        self.assertTrue(np.all(seqs[b, len(brute):] == 0))

  def test_the_length_penalty_changes_the_ranking(self):
    # (So that the exhaustive test above checks the penalty, not only log-probabilities.)
    table = _table(0)
    best = lambda alpha: [_brute_force(table[b], alpha)[0][1] for b in range(3)]
    self.assertNotEqual(best(0.0), best(0.6))
    seqs, _ = _toy_search_jit(table, 0.6, 4 ** 4)
    self.assertEqual([tuple(s) for s in np.asarray(seqs)[:, 0].tolist()], best(0.6))

  @parameterized.parameters((2, 0.6), (3, 0.0), (2, 1.0))
  def test_small_beam_scores_follow_the_rule_and_are_sorted(self, beam_size, alpha):
    for seed in range(3):
      table = _table(10 + seed)
      seqs, scores = map(np.asarray, _toy_search_jit(table, alpha, beam_size))
      self.assertEqual((seqs.shape, scores.shape), ((3, beam_size, 4), (3, beam_size)))
      _assert_zeros_after_eos(self, seqs)
      for b in range(3):
        self.assertTrue(np.all(np.diff(scores[b]) <= 0), scores[b])
        self.assertTrue(np.all(np.isfinite(scores[b])))
        self.assertLen({tuple(s) for s in seqs[b].tolist()}, beam_size)
        for seq, score in zip(seqs[b].tolist(), scores[b]):
          self.assertIn(EOS, seq)
          self.assertAlmostEqual(score, _rule(_token_log_probs(table[b], seq), seq, alpha), delta=1e-5)
        self.assertLessEqual(scores[b, 0], _brute_force(table[b], alpha)[0][0] + 1e-5)

  def test_without_finished_hypotheses_the_alive_ones_are_returned_with_plain_log_probs(self):
    # EOS is so unlikely that with one beam it never makes the top 2 candidates.
    table = _table(3, eos_shift=-30.0)
    steps = []
    seqs, scores = map(np.asarray, _toy_search(table, 0.6, 1, on_step=lambda t: steps.append(int(t))))
    self.assertEqual(steps, [0, 1, 2, 3])
    for b in range(3):
      seq = seqs[b, 0].tolist()
      self.assertNotIn(EOS, seq)
      logp = float(np.sum(_token_log_probs(table[b], seq)))
      self.assertAlmostEqual(scores[b, 0], logp, delta=1e-5)
      self.assertGreater(abs(logp / _lp(4, 0.6) - logp), 1e-2)  # (a penalised score would differ)

  def test_stops_once_no_alive_hypothesis_can_beat_the_finished_ones(self):
    # EOS is very likely: after two steps both finished slots hold hypotheses that no longer one can beat.
    table = _table(4, eos_shift=10.0)
    steps = []
    seqs, scores = map(np.asarray, _toy_search(table, 0.6, 2, on_step=lambda t: steps.append(int(t))))
    self.assertEqual(steps, [0, 1])
    for b in range(3):
      brute = _brute_force(table[b], 0.6)
      np.testing.assert_array_equal(seqs[b], [h for _, h in brute[:2]])
      np.testing.assert_allclose(scores[b], [s for s, _ in brute[:2]], atol=1e-5)

  def test_does_not_stop_while_a_longer_hypothesis_can_still_win_through_the_length_penalty(self):
    # One beam, alpha 2. Step 0: EOS (p 0.6, score -0.51) or token 2 (p 0.37), then 2, 2 and EOS almost surely:
    # [2, 2, 2, EOS] scores -1.06 / lp(4) = -0.47 and wins, though its log-probability is already below -0.51
    # after one step. The bound that lets the search stop is log p / lp(max_decode_len), not log p / lp(now).
    table = np.full((1, 4, 4, 4, 4), np.log(0.25))
    table[0, 0, 0, 0] = np.log([0.01, 0.60, 0.37, 0.02])
    table[0, 1, 0, 2] = table[0, 2, 2, 2] = np.log([0.005, 0.005, 0.98, 0.01])
    table[0, 3, 2, 2] = np.log([0.005, 0.98, 0.01, 0.005])
    steps = []
    seqs, scores = map(np.asarray, _toy_search(table, 2.0, 1, on_step=lambda t: steps.append(int(t))))
    self.assertEqual(steps, [0, 1, 2, 3])
    self.assertEqual(seqs[0, 0].tolist(), [2, 2, 2, EOS])
    self.assertEqual(_brute_force(table[0], 2.0)[0][1], (2, 2, 2, EOS))
    self.assertAlmostEqual(scores[0, 0], _brute_force(table[0], 2.0)[0][0], delta=1e-5)


# The Transformer. Token 0 is padding: the teacher-forced pass masks it out of attention, the cached decoder
# does not, so a hypothesis with a 0 before its EOS has no teacher-forced score to compare with; such
# hypotheses are skipped, or (exact search) made impossible with a -1e4 output bias on token 0.


def _teacher_forced_scores(model, params, inputs, seqs, alpha):
  """The rule's score of each row of `seqs` (n, L) for `inputs` (n, length), from one full forward pass."""
  logits = jax.jit(lambda p, x, y: model.apply({'params': p}, {'inputs': x, 'targets': y}, train=False))(
      params, jnp.asarray(inputs), jnp.asarray(seqs))
  log_probs = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)), np.float64)
  tokens = np.take_along_axis(log_probs, np.asarray(seqs)[..., None], axis=-1)[..., 0]
  return np.array([_rule(t, s, alpha) for t, s in zip(tokens, np.asarray(seqs).tolist())])


def _init(model, seed, inputs, targets):
  init = jax.jit(lambda key: model.init(key, {'inputs': inputs, 'targets': targets}, train=False)['params'])
  return init(jax.random.key(seed))


def _source(seed, batch, vocab, length=6):
  rng = np.random.default_rng(seed)
  inputs = rng.integers(2, vocab, size=(batch, length)).astype(np.int32)
  inputs[1:, -2:] = 0  # padding
  return inputs


class TransformerBeamDecodeTest(absltest.TestCase):

  def test_jitted_beam_decode_and_its_scores_match_the_teacher_forced_model(self):
    vocab, max_len, beam = 12, 8, 4
    model = transformer.build(ml_collections.ConfigDict(
        {'name': 'transformer_test', 'max_len': max_len, 'dropout_rate': 0.0, 'attention_dropout_rate': 0.0}),
        vocab)
    inputs = _source(3, 4, vocab)
    params = _init(model, 3, inputs, inputs)
    decode = jax.jit(beam_search.beam_decode, static_argnums=(0, 3, 4))
    ids = decode(model, params, jnp.asarray(inputs), max_len, beam)
    self.assertEqual((ids.shape, ids.dtype), ((4, max_len), jnp.int32))
    _assert_zeros_after_eos(self, ids)

    seqs, scores = jax.jit(beam_search.transformer_beam_search, static_argnums=(0, 3, 4))(
        model, params, jnp.asarray(inputs), max_len, beam)
    seqs, scores = np.asarray(seqs), np.asarray(scores)
    np.testing.assert_array_equal(np.asarray(ids), seqs[:, 0])
    _assert_zeros_after_eos(self, seqs)
    self.assertTrue(np.all(np.diff(scores, axis=1) <= 0))
    self.assertGreater(int(np.any(seqs == EOS, axis=-1).sum()), 4)  # finished hypotheses are among them
    flat = seqs.reshape(-1, max_len)
    checked = np.array([0 not in s[:_ends(s)] for s in flat.tolist()])
    self.assertGreaterEqual(int(checked.sum()), 8)
    expected = _teacher_forced_scores(model, params, np.repeat(inputs, beam, axis=0)[checked], flat[checked],
                                      0.6)
    np.testing.assert_allclose(scores.reshape(-1)[checked], expected, atol=1e-4)

  def test_exhaustive_beam_is_the_exact_best_and_beats_greedy(self):
    vocab, length, alpha, batch = 4, 3, 0.6, 3
    config = transformer.TransformerConfig(vocab_size=vocab, max_len=6, logits_via_embedding=False,
                                           dropout_rate=0.0, attention_dropout_rate=0.0,
                                           **transformer.PRESETS['transformer_test'])
    model = transformer.Transformer(config)
    inputs = _source(11, batch, vocab)
    params = _init(model, 11, inputs, inputs[:, :length])
    params = jax.tree.map(lambda x: x, params)
    params['decoder']['logitdense']['bias'] = params['decoder']['logitdense']['bias'].at[0].set(-1e4)

    # A beam of vocab ** length drops no candidate: the search is exhaustive.
    seqs, scores = map(np.asarray, jax.jit(beam_search.transformer_beam_search, static_argnums=(0, 3, 4))(
        model, params, jnp.asarray(inputs), length, vocab ** length, alpha))
    # Every finished hypothesis without token 0 (1 + 2 + 4 per source), scored by the full forward pass.
    hypotheses = [p + (EOS,) + (0,) * (length - n - 1) for n in range(length)
                  for p in itertools.product((2, 3), repeat=n)]
    self.assertLen(hypotheses, 7)
    greedy = np.asarray(jax.jit(translation.greedy_decode, static_argnums=(0, 3))(
        model, params, jnp.asarray(inputs), length))
    brute, greedy_scores = np.split(_teacher_forced_scores(
        model, params, np.concatenate([np.repeat(inputs, 7, axis=0), inputs]),
        np.concatenate([np.tile(hypotheses, (batch, 1)), greedy]), alpha), [7 * batch])
    for b in range(batch):
      order = np.argsort(-brute[7 * b:7 * (b + 1)])
      np.testing.assert_array_equal(seqs[b, :7], np.array(hypotheses)[order])
      np.testing.assert_allclose(scores[b, :7], brute[7 * b:7 * (b + 1)][order], atol=1e-4)
    # Greedy's output, when it ended, is one of the hypotheses, so it cannot score more. (With this seed
    # greedy ends on every source, each time with a worse score than the beam's.)
    ended = np.array([EOS in g for g in greedy.tolist()])
    self.assertTrue(np.any(ended))
    self.assertTrue(np.all(scores[ended, 0] >= greedy_scores[ended] - 1e-5))
    self.assertTrue(np.any(scores[ended, 0] > greedy_scores[ended] + 1e-3))


if __name__ == '__main__':
  absltest.main()
