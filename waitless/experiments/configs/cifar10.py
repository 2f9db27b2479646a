"""CIFAR-10 with ResNet-20 (He et al. 2016): 8 workers, batch 32 each, SGD + Nesterov momentum, cosine LR.

Data from tensorflow-datasets (prepare once: `tfds build cifar10 --data_dir=DIR`, then `dataset.data_dir=DIR`
or leave it None for $TFDS_DATA_DIR / ~/tensorflow_datasets). Every registered algorithm runs on it:

  python -m waitless.experiments.main --config=experiments/configs/cifar10.py:sync --workdir=/tmp/c10_sync
  python -m waitless.experiments.main --config=experiments/configs/cifar10.py:local_sgd,local_steps=8 --workdir=...
  # one GPU: all 8 workers on it
  python -m waitless.experiments.main --config=experiments/configs/cifar10.py:sync,devices=1 --workdir=...

Defaults: 8 workers x 32 images (global 256), `num_epochs` = 200 (39,063 iterations), SGD, Nesterov 0.9,
weight decay 5e-4, learning rate 0.1 (global batch 256, Goyal et al. scaling) with 5 warm-up epochs then cosine;
pad-4 random crop + flip; every micro-batch takes 10 ms of simulated time (no stragglers, ideal network).
The run converts epochs to iterations, ceil(E * 50,000 / (workers * batch_size)) (experiments/harness/duration.py);
`optimizer.warmup_steps`, `eval_every` and `checkpoint_every` are iterations: set them again when changing
workers or batch_size. `num_steps=N` in the config argument runs N iterations instead.

Headline runs of the papers (see shared/ALGORITHMS.md; field names of each algorithm are in its registry
defaults):
- LAP-SGD (Chatterjee, Kungurtsev, Alistarh), author's scripts: ResNet-20, 2 nodes, Q = 4 threads, batch 256
  per thread, LR 0.1 -> 0.4 over 5 warm-up epochs then cosine, H = 16, post-local after 150 of 300 epochs,
  Nesterov 0.9, wd 5e-4. One iteration = one node update (2 x 256 samples): 300 epochs = 29,297 iterations.
    python -m waitless.experiments.main --config=experiments/configs/cifar10.py:lap_sgd,threads=4,local_steps=16 \
      --config.workers=2 --config.devices=2 --config.batch_size=256 --config.num_epochs=300 \
      --config.algorithm.pre_post_steps=14648 --config.optimizer.learning_rate=0.4 \
      --config.optimizer.warmup_steps=488 --config.eval_every=977 --workdir=/tmp/c10_lap
- Non-blocking SGD (He & Dube): 8 workers, ResNet, heterogeneous cluster, m micro-batches per worker batch;
  up to 2x less time than sync / D-PSGD to the same training loss.
    python -m waitless.experiments.main --config=experiments/configs/cifar10.py:nonblocking,microbatches=4 \
      --config.stragglers.kind=slow_workers --config.stragglers.slow_fraction=0.25 \
      --config.stragglers.slow_factor=4.0 --workdir=...
- AdaSync (Dutta et al., journal version arXiv 2003.10579): CIFAR-10, 8 workers, lr 0.12, batch 32,
  exponential compute times: its own variant `cifar10_adasync.py`.
    python -m waitless.experiments.main --config=experiments/configs/cifar10_adasync.py --workdir=/tmp/c10_adasync
- DaSGD (author's defaults): 32 workers, local batch 32, tau = 4, d = 1, p = 0.25, AdamW, one-cycle LR
  (here: warmup + cosine).
    python -m waitless.experiments.main --config=experiments/configs/cifar10.py:dasgd,correction=mix \
      --config.workers=32 --config.devices=8 --config.optimizer.name=adamw \
      --config.optimizer.learning_rate=0.001 --workdir=...  # 200 epochs = 9,766 iterations

Testing (CPU, seconds; tfds mock data, no download):
  python -m waitless.experiments.main --config=experiments/configs/cifar10.py:sync,model.name=resnet_test,num_steps=20 \
    --config.workers=2 --config.devices=2 --config.eval_every=20 --mock_data --workdir=/tmp/c10_test
"""

from __future__ import annotations

import ml_collections

from waitless.experiments.configs import arguments
from waitless.experiments.configs import common

TRAIN_SIZE = 50_000


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = common.base_config()
  config.dataset = common.tfds_dataset('cifar10', eval_split='test')
  config.dataset.shuffle_buffer = 10_000  # per worker (a worker's shard is 50,000 / workers images)
  config.dataset.augment = True           # pad 4 + random crop + flip

  config.model = ml_collections.ConfigDict()
  config.model.name = 'resnet20'          # resnet20 | resnet56 | resnet18 | wrn16_8 | resnet_test (testing)
  config.model.dtype = 'float32'          # bfloat16 on accelerators
  config.model.param_dtype = 'float32'

  config.workers = 8
  config.devices = 8
  config.batch_size = 32
  common.use_epochs(config, 200)
  steps_per_epoch = -(-TRAIN_SIZE // (config.workers * config.batch_size))  # iterations per epoch, rounded up
  config.eval_every = steps_per_epoch
  config.log_every = 50
  config.checkpoint_every = 10 * steps_per_epoch
  config.steps_per_call = 10
  config.eval_batch_size = 1000
  config.target_accuracy = 0.91           # ResNet-20 reaches 91-92% (He et al. 2016: 91.25%)

  config.optimizer.name = 'sgd'
  config.optimizer.learning_rate = 0.1
  config.optimizer.momentum = 0.9
  config.optimizer.nesterov = True
  config.optimizer.weight_decay = 5e-4
  config.optimizer.lr_schedule = 'cosine'
  config.optimizer.warmup_steps = 5 * steps_per_epoch
  return arguments.apply_arg(config, arg)
