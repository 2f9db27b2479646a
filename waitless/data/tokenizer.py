"""A SentencePiece subword tokenizer trained on the training text, cached on disk (as in flax `examples/wmt`).

SentencePiece: A simple and language independent subword tokenizer and detokenizer for Neural Text Processing,
Kudo and Richardson, EMNLP 2018 (arXiv:1808.06226). One unigram model for both languages, trained on the first
`max_corpus_chars` characters of the training pairs (both sides, one sentence a line), character coverage 1.0.
Ids: 0 = padding, 1 = end of sentence, 2 = unknown (no beginning-of-sentence token: the decoder starts from 0).

The model file is named after a hash of the training corpus and the trainer's options, so a model trained on
other text (another data set, or random strings under `tfds.testing.mock_data`) is never picked up by mistake.
It is written to a temporary name and renamed, so concurrent processes (one per host) do not collide.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Iterable

import sentencepiece as spm

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2


def default_dir() -> str:
  return os.path.join(os.path.expanduser('~'), '.cache', 'waitless', 'tokenizers')


def corpus_text(sentences: Iterable[str], max_chars: int) -> str:
  """The first sentences of `sentences` up to `max_chars` characters, one a line (newlines flattened)."""
  lines, chars = [], 0
  for sentence in sentences:
    line = sentence.replace('\n', ' ').strip()
    if not line:
      continue
    lines.append(line)
    chars += len(line)
    if chars >= max_chars:
      break
  return '\n'.join(lines) + '\n'


def _options(vocab_size: int, model_type: str, character_coverage: float) -> str:
  return ' '.join([
      f'--vocab_size={vocab_size}', f'--model_type={model_type}', f'--character_coverage={character_coverage}',
      f'--pad_id={PAD_ID}', f'--eos_id={EOS_ID}', f'--unk_id={UNK_ID}', '--bos_id=-1',
      # A soft limit: a small corpus (tests, mock data) may support fewer pieces than asked for.
      '--hard_vocab_limit=false', '--num_threads=4', '--input_sentence_size=10000000',
      '--shuffle_input_sentence=true'])


def train_or_load(sentences: Iterable[str], vocab_size: int, model_dir: str | None = None,
                  max_corpus_chars: int = 10 ** 7, model_type: str = 'unigram',
                  character_coverage: float = 1.0) -> spm.SentencePieceProcessor:
  """The tokenizer for this corpus: loaded from `model_dir` if trained before, else trained and saved there."""
  model_dir = model_dir or default_dir()
  text = corpus_text(sentences, max_corpus_chars)
  options = _options(vocab_size, model_type, character_coverage)
  digest = hashlib.sha256((options + '\0' + text).encode('utf-8')).hexdigest()[:16]
  path = os.path.join(model_dir, f'spm_{vocab_size}_{digest}.model')
  if not os.path.exists(path):
    os.makedirs(model_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=model_dir) as tmp:
      corpus = os.path.join(tmp, 'corpus.txt')
      with open(corpus, 'w', encoding='utf-8') as f:
        f.write(text)
      prefix = os.path.join(tmp, 'spm')
      spm.SentencePieceTrainer.Train(f'--minloglevel=2 --input={corpus} --model_prefix={prefix} {options}')
      os.replace(prefix + '.model', path)
  return load(path)


def load(path: str) -> spm.SentencePieceProcessor:
  return spm.SentencePieceProcessor(model_file=path)
