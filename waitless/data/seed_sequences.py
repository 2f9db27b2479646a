"""numpy's `SeedSequence`, vectorised over many seeds: the generators of many streams seeded at once.

`generators(entropy)` gives, for every row of a (K, 4) uint32 array of entropy words, the generator that
`np.random.default_rng(row)` gives: the same stream, to the bit (tests/data/test_seed_sequences.py checks it
against numpy). numpy seeds a generator by hashing its words in a `SeedSequence`, one seed per call, then
`PCG64` takes 4 words of that sequence's state. Here the hashing runs as array operations over all K seeds at
once, and each `PCG64` takes its precomputed state (`_State`), through the interface numpy declares for seed
sequences (`ISeedSequence`). Worker w's epoch e of an in-memory data set is such a stream
(`in_memory.InMemoryStreams`), so a block that starts an epoch on every worker seeds them all in one call.

The algorithm is numpy's (numpy/random/bit_generator.pyx, `SeedSequence.mix_entropy` and `generate_state`)
for a pool of 4 words, entropy of exactly 4 words and no spawn key: 32-bit multiply-xorshift hashes whose
multipliers advance the same way for every seed, so that only the words differ between rows.
"""

from __future__ import annotations

import numpy as np
from numpy.random import bit_generator

POOL_SIZE = 4  # numpy's DEFAULT_POOL_SIZE
_INIT_A, _MULT_A = 0x43b0d7e5, 0x931e8875
_INIT_B, _MULT_B = 0x8b51f9dd, 0x58f38ded
_MIX_MULT_L, _MIX_MULT_R = np.uint32(0xca01f9dd), np.uint32(0x4973f715)
_XSHIFT = 16
_MASK = 0xFFFFFFFF


def _constants(start: int, multiplier: int, count: int) -> np.ndarray:
  """The hash multipliers a run of `count` hashes uses, in turn: each one `start` times `multiplier`^(k+1)."""
  out, value = [], start
  for _ in range(count):
    value = (value * multiplier) & _MASK
    out.append(value)
  return np.array(out, np.uint32)


# mix_entropy's hashes in call order: 4 for the entropy words, then 3 per source word of the pool (12).
_ENTROPY_CONSTANTS = _constants(_INIT_A, _MULT_A, POOL_SIZE + POOL_SIZE * (POOL_SIZE - 1))
# What each hash xors its value with: the multiplier before it advanced (INIT_A first).
_ENTROPY_XORS = np.concatenate([[np.uint32(_INIT_A)], _ENTROPY_CONSTANTS[:-1]]).astype(np.uint32)
_STATE_WORDS = 2 * POOL_SIZE  # generate_state(4, np.uint64): 8 uint32 words
_STATE_CONSTANTS = _constants(_INIT_B, _MULT_B, _STATE_WORDS)
_STATE_XORS = np.concatenate([[np.uint32(_INIT_B)], _STATE_CONSTANTS[:-1]]).astype(np.uint32)


def _hash(values: np.ndarray, xor: np.ndarray, multiplier: np.ndarray) -> np.ndarray:
  """numpy's `hashmix` (and `generate_state`'s step): ((v ^ xor) * multiplier) ^ (that >> 16), modulo 2^32."""
  out = (values ^ xor) * multiplier
  out ^= out >> _XSHIFT
  return out


def states(entropy: np.ndarray) -> np.ndarray:
  """`np.random.SeedSequence(row).generate_state(4, np.uint64)` for every row of `entropy`, (K, 4) uint32:
  (K, 4) uint64."""
  entropy = np.asarray(entropy, np.uint32)
  if entropy.ndim != 2 or entropy.shape[1] != POOL_SIZE:
    raise ValueError(f'entropy must be (K, {POOL_SIZE}) uint32 words, got shape {entropy.shape}')
  # The pool word by word, (4, K): each mixing step reads one word of every seed and writes the others.
  pool = _hash(entropy.T, _ENTROPY_XORS[:POOL_SIZE, None], _ENTROPY_CONSTANTS[:POOL_SIZE, None])
  k = POOL_SIZE
  for source in range(POOL_SIZE):  # each word mixed into the others: the 3 hashes of one source use its value
    targets = [t for t in range(POOL_SIZE) if t != source]
    hashed = _hash(pool[source], _ENTROPY_XORS[k:k + 3, None], _ENTROPY_CONSTANTS[k:k + 3, None])
    mixed = _MIX_MULT_L * pool[targets] - _MIX_MULT_R * hashed  # numpy's `mix`
    mixed ^= mixed >> _XSHIFT
    pool[targets] = mixed
    k += 3
  words = _hash(pool[np.arange(_STATE_WORDS) % POOL_SIZE], _STATE_XORS[:, None], _STATE_CONSTANTS[:, None])
  # As numpy does: the 32-bit words read little-endian, two to a 64-bit word.
  return np.ascontiguousarray(words.T.astype('<u4')).view('<u8').astype(np.uint64)


class _State(bit_generator.ISeedSequence):
  """A seed sequence whose state is already computed (`states`): what `PCG64` asks of one."""

  __slots__ = ('_state',)

  def __init__(self, state: np.ndarray):
    self._state = state

  def generate_state(self, n_words, dtype=np.uint32):
    if n_words != POOL_SIZE or np.dtype(dtype) != np.uint64:
      raise ValueError(f'precomputed for 4 uint64 words, asked for {n_words} {np.dtype(dtype)}')
    return self._state


def generators(entropy: np.ndarray) -> list[np.random.Generator]:
  """`np.random.default_rng(row)` for every row of `entropy` ((K, 4) uint32 words), seeded at once."""
  return [np.random.Generator(np.random.PCG64(_State(state))) for state in states(entropy)]
