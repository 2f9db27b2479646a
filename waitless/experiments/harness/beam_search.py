"""Beam search decoding with the GNMT length penalty (after flax `examples/wmt/decode.py`).

Rule. A finished hypothesis y (its tokens up to and including the first EOS, |y| of them) of source x scores

  score(y) = log p(y | x) / lp(|y|),   lp(n) = ((5 + n) / 6) ** alpha,

the length penalty of Wu et al. 2016, "Google's Neural Machine Translation System: Bridging the Gap between
Human and Machine Translation" (arXiv:1609.08144), Section 7. alpha = 0 ranks by plain log-probability; larger
alpha favours longer outputs. Vaswani et al. 2017 decode the Transformer with beam 4 and alpha 0.6 (the defaults).

Search. Per example, `beam_size` alive hypotheses (no EOS yet) and the `beam_size` best finished ones. At step
t every alive hypothesis is extended by every token; of the beam_size * vocab candidates the best 2 * beam_size
by log-probability are kept (so that beam_size of them are still alive even if beam_size end in EOS at once):
those ending in EOS compete, by score, for the finished slots, the others, by log-probability, for the alive
ones. Log-probabilities only fall and lp only grows with length, so an alive hypothesis with log-probability l
can finish with at most l / lp(max_decode_len) (alpha >= 0); the search stops early once, for every example, all
finished slots are taken and no alive hypothesis can reach the worst of them. Hypotheses that have not met EOS
after `max_decode_len` tokens are never finished; an example with no finished hypothesis at all returns its alive
ones instead, scored by their plain log-probability (as flax does).

The model is stepped one token per call with its key/value cache (`tokens_to_logits`); the cache of the alive
hypotheses is gathered by beam index at every step. Pure JAX (`lax.while_loop`), jit-able. Token 0 is the start
token and padding: tokens after EOS are 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

NEG_INF = float('-inf')  # log-probability / score of an empty beam slot


def length_penalty(length, alpha):
  """lp(n) = ((5 + n) / 6) ** alpha (Wu et al. 2016, arXiv:1609.08144, Section 7)."""
  return jnp.power((5.0 + jnp.asarray(length, jnp.float32)) / 6.0, alpha)


# Beam bookkeeping. Scalar leaves (e.g. the cache's `cache_index`) are shared by all rows and left alone.


def add_beam_dim(x, beam_size: int):
  """(batch, ...) -> (batch, beam_size, ...), each row repeated."""
  if x.ndim == 0:
    return x
  return jnp.repeat(jnp.expand_dims(x, 1), beam_size, axis=1)


def flatten_beam_dim(x):
  """(batch, beam, ...) -> (batch * beam, ...)."""
  if x.ndim == 0:
    return x
  return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def unflatten_beam_dim(x, batch_size: int, beam_size: int):
  """(batch * beam, ...) -> (batch, beam, ...)."""
  if x.ndim == 0:
    return x
  assert x.shape[0] == batch_size * beam_size, (x.shape, batch_size, beam_size)
  return x.reshape((batch_size, beam_size) + x.shape[1:])


def flat_batch_beam_expand(x, beam_size: int):
  """(batch, ...) -> (batch * beam, ...): each row repeated `beam_size` times, consecutively."""
  return flatten_beam_dim(add_beam_dim(x, beam_size))


def gather_beams(nested, beam_indices, batch_size: int, new_beam_size: int):
  """Every leaf (batch, old_beam, ...) -> (batch, new_beam, ...): leaf[b, beam_indices[b, j]] at [b, j]."""
  batch_indices = jnp.broadcast_to(jnp.arange(batch_size)[:, None], (batch_size, new_beam_size))

  def gather(x):
    if x.ndim == 0:
      return x
    return x[batch_indices, beam_indices]
  return jax.tree.map(gather, nested)


class BeamState(NamedTuple):
  """The loop carry. Sequences hold the start token 0 at position 0, then up to max_decode_len tokens."""
  cur_index: jax.Array        # scalar int32: tokens generated so far
  alive_log_probs: jax.Array  # (batch, beam) float32, best first; NEG_INF marks an empty slot
  alive_seqs: jax.Array       # (batch, beam, max_decode_len + 1) int32
  finished_scores: jax.Array  # (batch, beam) float32, best first; NEG_INF marks an empty slot
  finished_seqs: jax.Array    # (batch, beam, max_decode_len + 1) int32
  finished_flags: jax.Array   # (batch, beam) bool: the slot holds a finished hypothesis
  cache: Any                  # the alive hypotheses' decoding cache, leaves (batch, beam, ...)


def beam_search(tokens_to_logits: Callable[[jax.Array, Any], tuple[jax.Array, Any]], initial_cache: Any,
                batch_size: int, beam_size: int, max_decode_len: int, alpha: float = 0.6, eos_id: int = 1):
  """Beam search for the highest-scoring sequences, score = log p(y|x) / ((5 + |y|) / 6) ** alpha.

  Args:
    tokens_to_logits: (flat_ids (batch * beam, 1) int32, flat_cache) -> (logits (batch * beam, vocab),
      new_flat_cache): next-token logits of every hypothesis given its last token (0 at the first step).
    initial_cache: pytree of the empty decoding cache for `batch_size` rows (leading dimension batch; scalar
      leaves are shared). It is repeated over the beam here; row b * beam_size + j is hypothesis j of example b.
    batch_size, beam_size, max_decode_len: static ints; at most max_decode_len tokens are generated.
    alpha: length-penalty exponent (Wu et al. 2016); 0 = plain log-probability. Early stopping assumes >= 0.
    eos_id: the end-of-sequence token.

  Returns:
    (sequences (batch, beam, max_decode_len) int32, scores (batch, beam) float32), best first. Tokens after
    EOS are 0. Examples without any finished hypothesis return their alive ones with plain log-probabilities;
    slots left empty score -inf (their sequence is all 0).
  """
  length = max_decode_len + 1
  first_only = jnp.where(jnp.arange(beam_size) == 0, 0.0, NEG_INF).astype(jnp.float32)
  init = BeamState(
      cur_index=jnp.array(0, jnp.int32),
      alive_log_probs=jnp.tile(first_only[None], (batch_size, 1)),
      alive_seqs=jnp.zeros((batch_size, beam_size, length), jnp.int32),
      finished_scores=jnp.full((batch_size, beam_size), NEG_INF, jnp.float32),
      finished_seqs=jnp.zeros((batch_size, beam_size, length), jnp.int32),
      finished_flags=jnp.zeros((batch_size, beam_size), bool),
      cache=jax.tree.map(lambda x: add_beam_dim(x, beam_size), initial_cache))

  def cond(state: BeamState):
    best_alive = state.alive_log_probs[:, 0] / length_penalty(max_decode_len, alpha)
    worst_finished = jnp.where(jnp.all(state.finished_flags, axis=1), state.finished_scores[:, -1], NEG_INF)
    return (state.cur_index < max_decode_len) & jnp.any(best_alive > worst_finished)

  def body(state: BeamState):
    i = state.cur_index
    flat_ids = flatten_beam_dim(lax.dynamic_slice_in_dim(state.alive_seqs, i, 1, axis=2))
    flat_logits, new_flat_cache = tokens_to_logits(flat_ids, jax.tree.map(flatten_beam_dim, state.cache))
    logits = unflatten_beam_dim(flat_logits.astype(jnp.float32), batch_size, beam_size)
    new_cache = jax.tree.map(lambda x: unflatten_beam_dim(x, batch_size, beam_size), new_flat_cache)
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits, axis=-1) + state.alive_log_probs[:, :, None]

    # The 2 * beam best one-token extensions of the alive hypotheses.
    num_candidates = 2 * beam_size
    cand_log_probs, cand_indices = lax.top_k(log_probs.reshape(batch_size, beam_size * vocab), num_candidates)
    cand_beams = cand_indices // vocab
    cand_tokens = (cand_indices % vocab).astype(jnp.int32)
    cand_seqs = gather_beams(state.alive_seqs, cand_beams, batch_size, num_candidates)
    cand_seqs = lax.dynamic_update_slice_in_dim(cand_seqs, cand_tokens[:, :, None], i + 1, axis=2)
    ended = cand_tokens == eos_id

    # Alive: the best beam_size candidates that did not end, with their parents' caches.
    alive_log_probs, keep = lax.top_k(jnp.where(ended, NEG_INF, cand_log_probs), beam_size)
    alive_seqs = gather_beams(cand_seqs, keep, batch_size, beam_size)
    parents = gather_beams(cand_beams, keep, batch_size, beam_size)
    alive_cache = gather_beams(new_cache, parents, batch_size, beam_size)

    # Finished: the best beam_size of the old finished and the candidates that just ended, by score.
    new_flags = ended & (cand_log_probs > NEG_INF)
    new_scores = jnp.where(new_flags, cand_log_probs / length_penalty(i + 1, alpha), NEG_INF)
    scores = jnp.concatenate([state.finished_scores, new_scores], axis=1)
    finished_scores, best = lax.top_k(scores, beam_size)
    finished_seqs, finished_flags = gather_beams(
        [jnp.concatenate([state.finished_seqs, cand_seqs], axis=1),
         jnp.concatenate([state.finished_flags, new_flags], axis=1)], best, batch_size, beam_size)

    return BeamState(cur_index=i + 1, alive_log_probs=alive_log_probs, alive_seqs=alive_seqs,
                     finished_scores=finished_scores, finished_seqs=finished_seqs,
                     finished_flags=finished_flags, cache=alive_cache)

  final = lax.while_loop(cond, body, init)
  any_finished = jnp.any(final.finished_flags, axis=1)
  finished_seqs = jnp.where(final.finished_flags[:, :, None], final.finished_seqs, 0)
  alive_seqs = jnp.where((final.alive_log_probs > NEG_INF)[:, :, None], final.alive_seqs, 0)
  sequences = jnp.where(any_finished[:, None, None], finished_seqs, alive_seqs)[:, :, 1:]
  scores = jnp.where(any_finished[:, None], final.finished_scores, final.alive_log_probs)
  return sequences, scores


def start_decoding(model, params, inputs, max_decode_len: int):
  """(decoder, encoded, cache) to translate `inputs` (batch, length) one token per call.

  `decoder` is a `decode=True` copy of the Transformer `model` (dropout off), `encoded` the encoder output and
  `cache` the empty key/value cache for `max_decode_len` tokens of `batch` rows. A step is
  `decoder.apply({'params': params, 'cache': cache}, encoded, inputs, last_tokens (batch, 1), mutable=['cache'],
  method=type(decoder).decode)`.
  """
  decoder = model.clone(config=dataclasses.replace(model.config, decode=True, dropout_rate=0.0,
                                                   attention_dropout_rate=0.0))
  encoded = model.apply({'params': params}, inputs, False, method=type(model).encode)
  cache = decoder.init(jax.random.key(0), encoded, inputs, jnp.ones((inputs.shape[0], max_decode_len), jnp.int32),
                       method=type(decoder).decode)['cache']
  return decoder, encoded, cache


def transformer_beam_search(model, params, inputs, max_decode_len: int, beam_size: int = 4, alpha: float = 0.6,
                            eos_id: int = 1):
  """`beam_search` with the Transformer of `models/transformer.py`: (sequences (batch, beam, max_decode_len),
  scores (batch, beam)), best first.

  Encodes `inputs` (batch, length) once, repeats the encoding and the source over the beam and steps a
  `decode=True` copy of the model (dropout off) one token per call with its key/value cache, as
  `experiments/harness/translation.py:greedy_decode` does. `model.config.max_len` must be >= max_decode_len.
  """
  decoder, encoded, cache = start_decoding(model, params, inputs, max_decode_len)
  batch = inputs.shape[0]
  flat_encoded = flat_batch_beam_expand(encoded, beam_size)
  flat_inputs = flat_batch_beam_expand(inputs, beam_size)

  def tokens_to_logits(flat_ids, flat_cache):
    logits, variables = decoder.apply({'params': params, 'cache': flat_cache}, flat_encoded, flat_inputs,
                                      flat_ids, mutable=['cache'], method=type(decoder).decode)
    return logits[:, -1, :], variables['cache']

  return beam_search(tokens_to_logits, cache, batch, beam_size, max_decode_len, alpha=alpha, eos_id=eos_id)


def beam_decode(model, params, inputs, max_decode_len: int, beam_size: int = 4, alpha: float = 0.6,
                eos_id: int = 1):
  """Beam-search translation of `inputs` (batch, length) -> (batch, max_decode_len) int32 token ids.

  The best hypothesis per example under score = log p(y|x) / ((5 + |y|) / 6) ** alpha (Wu et al. 2016,
  arXiv:1609.08144; see `beam_search`). Tokens after the first EOS are 0: the contract of
  `experiments/harness/translation.py:greedy_decode`, so either can feed BLEU. Jit with `static_argnums=(0, 3, 4)`.
  """
  sequences, _ = transformer_beam_search(model, params, inputs, max_decode_len, beam_size, alpha, eos_id)
  return sequences[:, 0]
