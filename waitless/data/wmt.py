"""WMT translation pairs from tensorflow-datasets (`wmt14_translate/de-en`, `wmt17_translate/de-en`), tokenized.

Findings of the 2014 / 2017 Conference on Machine Translation (WMT14: Bojar et al. 2014; WMT17: Bojar et al.
2017). As in flax `examples/wmt`: a SentencePiece model (`data/tokenizer.py`) trained on the training pairs,
both sides tokenized with an end-of-sentence token, training pairs longer than `max_len` tokens on either side
dropped. Batches: `inputs` (source) and `targets` (int32, 0 = padding); the `seq2seq` task in
`experiments/harness/translation.py` reads them.

Packing (`dataset.packing=True`, the WMT config's default): WMT sentences are ~30 tokens, so padding each to
`max_len` = 256 would leave ~85% of every batch empty. Instead the training pairs, in one seeded order, are
packed next-fit into rows of `max_len` tokens: a pair joins the current row while both its source and its target
still fit, else it opens a new row. A row also carries `inputs_segmentation` / `targets_segmentation` (1, 2, ...
per pair, 0 on padding) and `inputs_position` / `targets_position` (token index within its pair), with which the
Transformer keeps the pairs apart (`models/transformer.py`). The rows are fixed for the run; workers get disjoint
shards of rows, each worker's epoch a fresh seeded order of its rows, and `batch_size` counts rows. Without
packing, every pair is its own row, zero-padded to `max_len`. Evaluation pairs are never packed.

Tokenized text is random-access, so the training pairs are tokenized once and held in host memory (flat
token arrays with offsets, about 1 GB for WMT17 de-en) and streamed like `data/in_memory.py`: disjoint seeded
shards, a fresh seeded order per worker and epoch, exact positions. The token arrays are cached next to the
tokenizer (`dataset.tokenizer_dir`, default ~/.cache/waitless/tokenizers), keyed by the tokenizer and split.
Evaluation pairs are truncated to `eval_max_len` rather than dropped, so every pair counts.

Prepare the data once (network needed): `tfds build wmt17_translate/de-en --data_dir=DIR`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
from typing import Any

import numpy as np

from waitless import config_errors as errors
from waitless.data import base
from waitless.data import in_memory
from waitless.data import tfds_pipeline
from waitless.data import tokenizer as tokenizer_lib

log = logging.getLogger('waitless')


class Ragged:
  """Variable-length integer sequences stored flat: sequence i is `tokens[offsets[i]:offsets[i + 1]]`."""

  def __init__(self, tokens: np.ndarray, offsets: np.ndarray):
    self.tokens, self.offsets = tokens, offsets

  @classmethod
  def from_lists(cls, sequences) -> 'Ragged':
    lengths = np.fromiter((len(s) for s in sequences), np.int64, len(sequences))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.fromiter(itertools.chain.from_iterable(sequences), np.int32, int(offsets[-1]))
    return cls(tokens, offsets)

  def __len__(self):
    return len(self.offsets) - 1

  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)

  def select(self, index: np.ndarray) -> 'Ragged':
    """The sequences `index`, in that order (O(len(index)), not O(len(self)): it runs per batch)."""
    index = np.asarray(index)
    lengths = self.offsets[index + 1] - self.offsets[index]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    source = np.repeat(self.offsets[index] - offsets[:-1], lengths) + np.arange(offsets[-1])
    return Ragged(self.tokens[source], offsets)

  def padded(self, index: np.ndarray, length: int) -> np.ndarray:
    """(len(index), length) int32: the sequences, truncated to `length`, zero-padded."""
    index = np.asarray(index)
    starts = self.offsets[index]
    sizes = np.minimum(self.offsets[index + 1] - starts, length)
    cols = np.arange(length)
    valid = cols[None, :] < sizes[:, None]
    gather = np.where(valid, starts[:, None] + cols[None, :], 0)
    return np.where(valid, self.tokens[gather] if len(self.tokens) else 0, 0).astype(np.int32)


def pack(input_lengths: np.ndarray, target_lengths: np.ndarray, order: np.ndarray, max_len: int) -> Ragged:
  """Rows of pair indices: next-fit over `order`, a row holds at most `max_len` tokens on each side.

  Every pair must fit alone (lengths <= max_len). Row r holds pairs `order[offsets[r]:offsets[r + 1]]`.
  """
  starts, used_in, used_tg = [0], 0, 0
  for i, (a, b) in enumerate(zip(input_lengths[order].tolist(), target_lengths[order].tolist())):
    if used_in + a > max_len or used_tg + b > max_len:
      starts.append(i)
      used_in = used_tg = 0
    used_in += a
    used_tg += b
  return Ragged(np.asarray(order, np.int64), np.asarray(starts + [len(order)], np.int64))


def packed_rows(side: Ragged, rows: Ragged, row_ids: np.ndarray, length: int) -> tuple[np.ndarray, ...]:
  """(tokens, segmentation, position), each (len(row_ids), length) int32, of one side of the packed rows."""
  members = rows.select(np.asarray(row_ids))
  pairs, per_row = members.tokens, members.lengths()
  row_of = np.repeat(np.arange(len(row_ids)), per_row)
  segment = np.arange(len(pairs)) - np.repeat(members.offsets[:-1], per_row) + 1
  chosen = side.select(pairs)
  sizes, first = chosen.lengths(), chosen.offsets[:-1]
  start_in_row = first - first[members.offsets[:-1]][row_of]
  within = np.arange(len(chosen.tokens)) - np.repeat(first, sizes)
  token_row = np.repeat(row_of, sizes)
  token_col = np.repeat(start_in_row, sizes) + within
  out = tuple(np.zeros((len(row_ids), length), np.int32) for _ in range(3))
  for array, values in zip(out, (chosen.tokens, np.repeat(segment, sizes), within)):
    array[token_row, token_col] = values
  return out


class SequenceStreams:
  """`base.WorkerStreams` over tokenized pairs: each row one pair padded to `max_len`, or packed `rows`."""
  resident = None  # rows are built on the host (padded or packed): the step receives them

  def __init__(self, inputs: Ragged, targets: Ragged, max_len: int, workers: int, microbatch_size: int,
               seed: int, rows: Ragged | None = None):
    count = len(inputs) if rows is None else len(rows)
    self._order = in_memory.InMemoryStreams({'index': np.arange(count)}, workers, microbatch_size, seed)
    self._inputs, self._targets, self._max_len, self._rows = inputs, targets, max_len, rows
    self.workers = workers
    self.microbatch_size = microbatch_size
    self.shard_size = self._order.shard_size

  def read(self, workers, positions, count):
    index = self._order.read_indices(workers, positions, count)
    flat = index.reshape(-1)
    shape = index.shape + (self._max_len,)
    if self._rows is None:
      return {'inputs': self._inputs.padded(flat, self._max_len).reshape(shape),
              'targets': self._targets.padded(flat, self._max_len).reshape(shape)}
    out = {}
    for name, side in (('inputs', self._inputs), ('targets', self._targets)):
      tokens, segmentation, position = packed_rows(side, self._rows, flat, self._max_len)
      out.update({name: tokens.reshape(shape), f'{name}_segmentation': segmentation.reshape(shape),
                  f'{name}_position': position.reshape(shape)})
    return out


@dataclasses.dataclass(frozen=True)
class TranslationDataset(base.Dataset):
  """A `base.Dataset` that also carries what BLEU needs: the tokenizer and the evaluation texts."""
  tokenizer: Any = None
  eval_sources: tuple[str, ...] = ()
  eval_references: tuple[str, ...] = ()


def _texts(ds, keys, batch_size: int = 4096):
  """Yields, per batch of examples, one list of decoded strings per key."""
  for batch in ds.batch(batch_size).prefetch(2).as_numpy_iterator():
    yield [[s.decode('utf-8') for s in batch[k]] for k in keys]


def _interleaved(ds, keys):
  for columns in _texts(ds, keys):
    for row in zip(*columns):
      yield from row


def tokenize_split(ds, sp, keys, cache_path: str | None = None) -> list[Ragged]:
  """One `Ragged` per key, each sentence followed by EOS; cached at `cache_path` (.npz) when given."""
  if cache_path and os.path.exists(cache_path):
    with np.load(cache_path) as f:
      return [Ragged(f[f'{k}_tokens'], f[f'{k}_offsets']) for k in keys]
  # Per batch straight to int32 arrays: Python lists of ints would take ~10x the memory on the full split.
  parts = {k: ([], []) for k in keys}
  for columns in _texts(ds, keys):
    for k, texts in zip(keys, columns):
      ids = sp.encode(texts, out_type=int)
      tokens, lengths = parts[k]
      lengths.append(np.fromiter((len(x) + 1 for x in ids), np.int64, len(ids)))
      tokens.append(np.fromiter(itertools.chain.from_iterable(x + [tokenizer_lib.EOS_ID] for x in ids), np.int32,
                                int(lengths[-1].sum())))
  out = []
  for k in keys:
    tokens, lengths = parts[k]
    lengths = np.concatenate(lengths) if lengths else np.zeros((0,), np.int64)
    out.append(Ragged(np.concatenate(tokens) if tokens else np.zeros((0,), np.int32),
                      np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)))
  if cache_path:
    os.makedirs(os.path.dirname(cache_path), exist_ok=True)
    tmp = f'{cache_path}.{os.getpid()}.tmp.npz'
    np.savez(tmp, **{f'{k}_{part}': getattr(r, part) for k, r in zip(keys, out) for part in ('tokens', 'offsets')})
    os.replace(tmp, cache_path)
  return out


def _cache_path(model_dir: str, sp, tfds_name: str, split: str, keys) -> str:
  digest = hashlib.sha256(sp.serialized_model_proto() + f'|{tfds_name}|{split}|{keys}'.encode()).hexdigest()
  return os.path.join(model_dir, f'tokens_{digest[:16]}.npz')


def signature(config) -> base.Signature:
  """The examples' shapes (`dataset.max_len`; packed rows add their segmentation and positions) and the vocabulary
  (`dataset.vocab_size`, the size the tokenizer is trained to), without the data set or a tokenizer."""
  d = config.dataset
  sides = ('inputs', 'targets')
  keys = sides + tuple(f'{s}_{part}' for s in sides for part in ('segmentation', 'position')) if d.get(
      'packing', False) else sides
  return base.Signature({key: np.zeros((d.get('max_len', 256),), np.int32) for key in keys},
                        d.get('vocab_size', 32000), task='seq2seq')


def make_dataset(config) -> TranslationDataset:
  """Reads `config.dataset.`: `tfds_name`, `data_dir`, `source_language`, `target_language`, `train_split`,
  `eval_tfds_name` (evaluate on another dataset's `eval_split`, e.g. newstest2014 of `wmt14_translate/de-en`;
  None: `tfds_name`), `eval_split`, `vocab_size`, `max_len`, `eval_max_len`, `packing`, `tokenizer_dir`,
  `max_corpus_chars`."""
  d = config.dataset
  data_dir = d.get('data_dir')
  name = d.get('tfds_name', 'wmt17_translate/de-en')
  keys = (d.get('source_language', 'en'), d.get('target_language', 'de'))
  max_len = d.get('max_len', 256)
  packing = d.get('packing', False)
  errors.require(isinstance(packing, bool), 'dataset.packing', packing, 'True or False')
  eval_max_len = d.get('eval_max_len', None) or max_len
  model_dir = d.get('tokenizer_dir') or tokenizer_lib.default_dir()
  ds_builder = tfds_pipeline.builder(name, data_dir)
  languages = tuple(ds_builder.info.supervised_keys or ())
  errors.require(set(keys) <= set(languages) or not languages, 'dataset.source_language',
                 keys, f'{name} has languages {languages}')
  train_split = d.get('train_split', 'train')
  eval_split = d.get('eval_split', 'test')
  train_ds = tfds_pipeline.as_dataset(ds_builder, train_split, data_dir)
  eval_name = d.get('eval_tfds_name') or name
  eval_builder = ds_builder if eval_name == name else tfds_pipeline.builder(eval_name, data_dir)
  eval_ds = tfds_pipeline.as_dataset(eval_builder, eval_split, data_dir)

  sp = tokenizer_lib.train_or_load(_interleaved(train_ds, keys), d.get('vocab_size', 32000), model_dir,
                                   d.get('max_corpus_chars', 10 ** 7))
  inputs, targets = tokenize_split(train_ds, sp, keys, _cache_path(model_dir, sp, name, train_split, keys))
  keep = np.flatnonzero((inputs.lengths() <= max_len) & (targets.lengths() <= max_len))
  if len(keep) < len(inputs):
    inputs, targets = inputs.select(keep), targets.select(keep)
  microbatch = config.batch_size // config.microbatches
  rows = None
  if packing:
    rows = pack(inputs.lengths(), targets.lengths(), np.random.default_rng([config.seed, 3]).permutation(
        len(inputs)), max_len)
    slots = len(rows) * max_len
    log.info('packed %d training pairs into %d rows of %d tokens: %.0f%% of source and %.0f%% of target '
             'slots used', len(inputs), len(rows), max_len, 100 * len(inputs.tokens) / slots,
             100 * len(targets.tokens) / slots)
  count, unit = (len(inputs), 'pairs') if rows is None else (len(rows), 'packed rows')
  errors.require(count // config.workers >= microbatch, 'batch_size', config.batch_size,
                 f'{count} training {unit} of <= {max_len} tokens (dataset.max_len) over {config.workers} '
                 f'workers leave {count // config.workers} per worker, fewer than one micro-batch of '
                 f'{microbatch}')
  streams = SequenceStreams(inputs, targets, max_len, config.workers, microbatch, config.seed, rows)

  eval_inputs, eval_targets = tokenize_split(eval_ds, sp, keys)
  index = np.arange(len(eval_inputs))
  eval_arrays = {'inputs': eval_inputs.padded(index, eval_max_len),
                 'targets': eval_targets.padded(index, eval_max_len)}
  sources, references = [], []
  for src, ref in _texts(eval_ds, keys):
    sources.extend(src)
    references.extend(ref)

  example = {key: value[0, 0, 0, 0] for key, value in streams.read(np.zeros(1, int), np.zeros((1, 1), int),
                                                                  1).items()}
  return TranslationDataset(
      train=streams, eval_batches=lambda batch_size: base.padded_batches(eval_arrays, batch_size),
      example=example, num_classes=int(sp.get_piece_size()), train_size=len(inputs), task='seq2seq',
      tokenizer=sp, eval_sources=tuple(sources), eval_references=tuple(references))
