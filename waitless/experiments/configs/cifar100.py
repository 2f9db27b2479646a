"""CIFAR-100 with WRN-16-8 (Zagoruyko & Komodakis 2016): the CIFAR-10 setting with 100 classes and a wide net.

Data from tensorflow-datasets (prepare once: `tfds build cifar100 --data_dir=DIR`). Every registered
algorithm runs on it:

  python -m waitless.experiments.main --config=experiments/configs/cifar100.py:sync --workdir=/tmp/c100_sync
  python -m waitless.experiments.main --config=experiments/configs/cifar100.py:local_sgd,local_steps=8 --workdir=...

Defaults: as `cifar10.py` (8 workers x 32, SGD + Nesterov 0.9, wd 5e-4, LR 0.1 with 5 warm-up epochs then
cosine, `num_epochs` = 200: 39,063 iterations) with model `wrn16_8` (11.0M parameters; `model.dropout_rate` optional).

Headline run of the papers (shared/ALGORITHMS.md):
- LAP-SGD / LPP-SGD (Chatterjee, Kungurtsev, Alistarh) also report wide residual networks on CIFAR; with the
  author's CIFAR recipe (2 nodes, Q = 4 threads, batch 256 per thread, LR 0.1 -> 0.4 with 5 warm-up epochs then
  cosine, H = 16, post-local after 150 of 300 epochs, Nesterov 0.9, wd 5e-4; 300 epochs = 29,297 node updates):
    python -m waitless.experiments.main --config=experiments/configs/cifar100.py:lpp_sgd,threads=4,local_steps=16 \
      --config.workers=2 --config.devices=2 --config.batch_size=256 --config.num_epochs=300 \
      --config.algorithm.pre_post_steps=14648 --config.optimizer.learning_rate=0.4 \
      --config.optimizer.warmup_steps=488 --config.eval_every=977 --workdir=/tmp/c100_lpp

Testing (CPU, seconds; tfds mock data, no download):
  python -m waitless.experiments.main --config=experiments/configs/cifar100.py:sync,model.name=wrn_test,num_steps=20 \
    --config.workers=2 --config.devices=2 --config.eval_every=20 --mock_data --workdir=/tmp/c100_test
"""

from __future__ import annotations

import ml_collections

from waitless.experiments.configs import arguments
from waitless.experiments.configs import cifar10


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = cifar10.get_config(None)
  config.dataset.name = 'cifar100'
  config.model.name = 'wrn16_8'        # wrn16_8 | wrn28_10 | resnet18 | resnet56 | wrn_test (testing)
  config.model.dropout_rate = 0.0      # between the two convolutions of each block
  config.target_accuracy = 0.75        # WRN-16-8 reaches ~77-78% on CIFAR-100
  return arguments.apply_arg(config, arg)
