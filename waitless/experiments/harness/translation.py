"""The `seq2seq` task (translation): label-smoothed token cross-entropy, token accuracy, greedy decoding, BLEU.

As in flax `examples/wmt/train.py`. Batches hold `inputs` and `targets` (int32, 0 = padding). Training loss:
cross-entropy against targets smoothed with `label_smoothing` (0.1, Szegedy et al. 2016), minus its minimum
(the entropy of the smoothed targets) so a perfect model scores 0, averaged over the non-padding target tokens
of the micro-batch. Evaluation sums (over the batch's `mask`): `loss_sum` = plain token negative
log-likelihood, `correct` = tokens whose argmax is right, `count` = non-padding target tokens; so
eval_loss is per-token NLL (perplexity = exp) and eval_accuracy is token accuracy. `experiments/harness/tasks.py`
registers `loss`, `eval_sums` and `model_inputs` as the `seq2seq` task (this module does not import it, so
there is no import cycle).

BLEU (Papineni et al. 2002) is computed with sacrebleu (Post 2018, "A Call for Clarity in Reporting BLEU
Scores") on detokenized translations of the evaluation split: `bleu_score(model, params, dataset)`, by beam
search (`experiments/harness/beam_search.py`, beam 4 and length penalty 0.6 as Vaswani et al. 2017) or, with beam size
1, greedily. The training loop reports it as `eval_bleu` when the config has a `bleu` section (see `eval_bleu` below).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from waitless.experiments.harness import beam_search


LABEL_SMOOTHING = 0.1


PACKING_KEYS = ('inputs_segmentation', 'inputs_position', 'targets_segmentation', 'targets_position')


def model_inputs(batch):
  """What the Transformer reads from a batch: the token arrays and, for packed batches, where each pair is."""
  return {k: batch[k] for k in ('inputs', 'targets') + PACKING_KEYS if k in batch}


def smoothed_cross_entropy(logits, targets, label_smoothing: float):
  """Per-token cross-entropy against smoothed one-hot targets, minus its minimum (flax examples/wmt)."""
  vocab = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1)
  normalizing = -(confidence * math.log(confidence) + (vocab - 1) * low * math.log(low + 1e-20))
  soft = jax.nn.one_hot(targets, vocab) * (confidence - low) + low
  return -jnp.sum(soft * jax.nn.log_softmax(logits.astype(jnp.float32)), axis=-1) - normalizing


def _apply(model, params, model_state, batch, train: bool, rng):
  """Logits of the model on `batch` (as `experiments/harness/tasks.py:_apply`; the Transformer has no batch norm)."""
  variables = {'params': params, **model_state}
  rngs = {'dropout': rng} if rng is not None else None
  if train and model_state:
    logits, new_state = model.apply(variables, model_inputs(batch), train=True, mutable=list(model_state),
                                    rngs=rngs)
    return logits, dict(new_state)
  return model.apply(variables, model_inputs(batch), train=train, rngs=rngs), model_state


def loss(model, params, model_state, batch, rng, label_smoothing: float = LABEL_SMOOTHING):
  """Mean label-smoothed cross-entropy over the non-padding target tokens; (loss, new model_state)."""
  logits, new_state = _apply(model, params, model_state, batch, True, rng)
  weights = (batch['targets'] > 0).astype(jnp.float32)
  per_token = smoothed_cross_entropy(logits, batch['targets'], label_smoothing)
  return (per_token * weights).sum() / jnp.maximum(weights.sum(), 1.0), new_state


def eval_sums(model, params, model_state, batch):
  """{'loss_sum': token NLL, 'correct': right tokens, 'count': tokens} over non-padding tokens of `mask`ed rows."""
  logits, _ = _apply(model, params, model_state, batch, False, None)
  targets = batch['targets']
  weights = (targets > 0).astype(jnp.float32) * batch['mask'][:, None]
  nll = smoothed_cross_entropy(logits, targets, 0.0)
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  return {'loss_sum': (nll * weights).sum(), 'correct': (correct * weights).sum(), 'count': weights.sum()}


def greedy_decode(model, params, inputs, max_decode_len: int, eos_id: int = 1):
  """Greedy autoregressive translation of `inputs` (batch, length) -> (batch, max_decode_len) token ids.

  Uses the model's key/value cache (`decode=True` copy of its config): one decoder call per output token.
  Tokens after the first EOS are 0.
  """
  decoder, encoded, cache = beam_search.start_decoding(model, params, inputs, max_decode_len)
  batch = inputs.shape[0]

  def step(i, carry):
    cache, token, out, done = carry
    logits, variables = decoder.apply({'params': params, 'cache': cache}, encoded, inputs, token,
                                      mutable=['cache'], method=type(decoder).decode)
    nxt = jnp.argmax(logits[:, -1, :], axis=-1).astype(jnp.int32)
    nxt = jnp.where(done, 0, nxt)
    out = out.at[:, i].set(nxt)
    return variables['cache'], nxt[:, None], out, done | (nxt == eos_id)

  init = (cache, jnp.zeros((batch, 1), jnp.int32), jnp.zeros((batch, max_decode_len), jnp.int32),
          jnp.zeros((batch,), bool))
  return lax.fori_loop(0, max_decode_len, step, init)[2]


def detokenize(tokenizer, ids: np.ndarray, eos_id: int = 1) -> list[str]:
  """Text of each row of `ids`, cut at the first EOS, padding dropped."""
  texts = []
  for row in np.asarray(ids):
    row = row.tolist()
    if eos_id in row:
      row = row[:row.index(eos_id)]
    texts.append(tokenizer.decode([t for t in row if t > 0]))
  return texts


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
  """Corpus BLEU (sacrebleu defaults: 13a tokenization, one reference per sentence)."""
  import sacrebleu
  return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


_greedy = jax.jit(greedy_decode, static_argnums=(0, 3))
_beam = jax.jit(beam_search.beam_decode, static_argnums=(0, 3, 4, 5))


def bleu_score(model, params, dataset, batch_size: int = 64, max_examples: int | None = None,
               max_decode_len: int | None = None, beam_size: int = 4, alpha: float = 0.6,
               place=jnp.asarray) -> float:
  """BLEU of translations of the evaluation split of `dataset` (a `data.wmt.TranslationDataset`).

  Beam search with `beam_size` beams and length penalty `alpha`, or greedy decoding when `beam_size` is 1;
  at most `max_decode_len` tokens (default: the evaluation length); the first `max_examples` sentences (None:
  all). `place` puts each batch of source tokens where `params` live.
  """
  hypotheses = []
  total = len(dataset.eval_references) if max_examples is None else min(max_examples, len(dataset.eval_references))
  for batch in dataset.eval_batches(batch_size):
    length = max_decode_len or batch['targets'].shape[1]
    inputs = place(batch['inputs'])
    if beam_size == 1:
      ids = _greedy(model, params, inputs, length)
    else:
      ids = _beam(model, params, inputs, length, beam_size, alpha)
    keep = int(batch['mask'].sum())
    hypotheses.extend(detokenize(dataset.tokenizer, np.asarray(ids)[:keep]))
    if len(hypotheses) >= total:
      break
  hypotheses = hypotheses[:total]
  return bleu(hypotheses, dataset.eval_references[:total])


def eval_bleu(model, params, dataset, config, place=jnp.asarray) -> dict[str, float]:
  """{'eval_bleu': BLEU} as `config.bleu` asks (`examples`: -1 all, 0 none; `beam_size`, `alpha`,
  `batch_size`, `max_decode_len`: 0 for the evaluation length); {} when the config has no `bleu` section."""
  b = config.get('bleu')
  if b is None or b.examples == 0:
    return {}
  return {'eval_bleu': bleu_score(model, params, dataset, batch_size=b.batch_size,
                                  max_examples=None if b.examples < 0 else b.examples,
                                  max_decode_len=b.max_decode_len or None, beam_size=b.beam_size, alpha=b.alpha,
                                  place=place)}
