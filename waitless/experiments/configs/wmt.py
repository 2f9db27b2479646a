"""WMT17 English-German with Transformer base: the WAGMA-SGD translation setting, 16 workers.

Data from tensorflow-datasets (prepare once: `tfds build wmt17_translate/de-en --data_dir=DIR`; WMT14 with
`dataset.tfds_name=wmt14_translate/de-en`). A SentencePiece vocabulary of 32k pieces is trained on the
training pairs on first use and cached, with the tokenized pairs, in `dataset.tokenizer_dir` (default
~/.cache/waitless/tokenizers). Every registered algorithm runs on it:

  python -m waitless.experiments.main --config=experiments/configs/wmt.py:sync --workdir=/tmp/wmt_sync
  python -m waitless.experiments.main --config=experiments/configs/wmt.py:local_sgd,local_steps=8 --workdir=...

Defaults, Transformer base as in Vaswani et al. 2017 (arXiv:1706.03762) section 5, in flax `examples/wmt`'s
form: training pairs packed into rows of 256 tokens (`dataset.packing`, see `data/wmt.py`), 16 workers x 8
rows (about 28k tokens per iteration, the paper's ~25k), Adam (b1 0.9, b2 0.98, eps 1e-9, no weight decay)
with the inverse-square-root schedule peaking at 7e-4 = 512^-0.5 x 4000^-0.5 after 4,000 warm-up iterations,
label smoothing 0.1, dropout 0.1, 100,000 iterations, bfloat16 compute. eval_loss is per-token NLL and
eval_accuracy token accuracy on newstest2017 (`eval_split=test`, teacher-forced; newstest2014, the test set
of most Transformer BLEU figures, with `dataset.eval_tfds_name=wmt14_translate/de-en`); at every evaluation
`eval_bleu` is the sacreBLEU of beam-search translations (beam 4, length penalty alpha 0.6, as the paper) of
the first `bleu.examples` evaluation sentences (-1: all of them; 0: no BLEU).

Headline run (shared/ALGORITHMS.md): WAGMA-SGD (Li et al.), Transformer on WMT17, 16 workers, group size S = 4
(sqrt 16), global average every tau = 8 iterations: BLEU 26.12, 1.39x faster than local SGD.
    python -m waitless.experiments.main --config=experiments/configs/wmt.py:wagma,group_size=4,sync_every=8 \
      --workdir=/tmp/wmt_wagma
    python -m waitless.experiments.main --config=experiments/configs/wmt.py:local_sgd,local_steps=8 --workdir=...

Testing (CPU, seconds; tfds mock data of random strings, no download):
  python -m waitless.experiments.main \
      --config=experiments/configs/wmt.py:sync,num_steps=20,dataset.tokenizer_dir=/tmp/wmt_tok \
    --config.model.name=transformer_test --config.model.dtype=float32 --config.model.max_len=32 \
    --config.dataset.vocab_size=64 --config.dataset.max_len=32 --config.dataset.eval_max_len=32 \
    --config.workers=2 --config.devices=2 --config.batch_size=4 --config.eval_every=20 \
    --mock_data --workdir=/tmp/wmt_test
"""

from __future__ import annotations

import ml_collections

from waitless.experiments.configs import arguments
from waitless.experiments.configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = common.base_config()
  config.dataset = common.tfds_dataset('wmt', eval_split='test')  # newstest2017 (wmt14: newstest2014)
  config.dataset.tfds_name = 'wmt17_translate/de-en'  # or wmt14_translate/de-en
  config.dataset.eval_tfds_name = None    # None: tfds_name; wmt14_translate/de-en: newstest2014 (flax's choice)
  config.dataset.source_language = 'en'
  config.dataset.target_language = 'de'
  config.dataset.vocab_size = 32_000      # SentencePiece pieces shared by both languages
  config.dataset.max_len = 256            # tokens per training row; longer pairs (either side) are dropped
  config.dataset.packing = True           # several pairs per row (False: one pair per row, zero-padded)
  config.dataset.eval_max_len = 256       # evaluation pairs are truncated to this
  config.dataset.max_corpus_chars = 10_000_000  # characters of training text the tokenizer learns from
  config.dataset.tokenizer_dir = None     # None: ~/.cache/waitless/tokenizers

  config.model = ml_collections.ConfigDict()
  config.model.name = 'transformer_base'  # transformer_base | transformer_big | transformer_test (testing)
  config.model.dtype = 'bfloat16'
  config.model.param_dtype = 'float32'
  config.model.dropout_rate = 0.1
  config.model.attention_dropout_rate = 0.1
  config.model.max_len = 256              # position embeddings; >= dataset.max_len and eval_max_len

  config.workers = 16
  config.devices = 16
  config.batch_size = 8                   # packed rows of dataset.max_len tokens per worker
  config.num_steps = 100_000
  config.eval_every = 5_000               # teacher-forced loss and accuracy, and BLEU
  config.log_every = 100
  config.checkpoint_every = 10_000
  config.steps_per_call = 10
  config.eval_batch_size = 256
  config.target_accuracy = 0.6            # token accuracy (BLEU is reported separately)

  config.optimizer.name = 'adamw'
  config.optimizer.learning_rate = 7e-4   # 512^-0.5 * 4000^-0.5, the peak of the paper's schedule
  config.optimizer.b2 = 0.98
  config.optimizer.eps = 1e-9
  config.optimizer.weight_decay = 0.0
  config.optimizer.lr_schedule = 'rsqrt'
  config.optimizer.warmup_steps = 4_000

  config.bleu = ml_collections.ConfigDict()  # eval_bleu at every evaluation (experiments/harness/translation.py)
  config.bleu.examples = -1               # evaluation sentences translated: -1 all, 0 no BLEU
  config.bleu.beam_size = 4               # 1: greedy decoding
  config.bleu.alpha = 0.6                 # length penalty ((5 + |y|) / 6)^alpha (Wu et al. 2016)
  config.bleu.batch_size = 64             # sentences decoded at once (each with beam_size beams)
  config.bleu.max_decode_len = 0          # 0: dataset.eval_max_len

  config.stragglers.base_s = 0.2          # choice: a Transformer-base step of 8 packed rows on one accelerator
  return arguments.apply_arg(config, arg)
