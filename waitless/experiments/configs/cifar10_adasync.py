"""AdaSync on CIFAR-10 (journal setting of Dutta et al., arXiv 2003.10579): 8 learners, lr 0.12, batch 32.

ResNet-20 (`cifar10.py`) trained through an emulated parameter server whose K adapts to the training loss:
start at K0 and every `adapt_every_s` seconds of simulated time set K <- min(P, round(K0 sqrt(F(W_0) / F(W_t)))).
Compute times are exponential (mean 10 ms per mini-batch of 32), so small K is fast and stale-free K-sync
waits only for the K fastest learners.

  python -m waitless.experiments.main --config=experiments/configs/cifar10_adasync.py --workdir=/tmp/c10_adasync
  # the fixed-K runs it is compared with (same data order and compute-time model):
  python -m waitless.experiments.main --config=experiments/configs/cifar10_adasync.py:ksync,k=1 --workdir=/tmp/c10_k1
  python -m waitless.experiments.main --config=experiments/configs/cifar10_adasync.py:ksync,k=8 --workdir=/tmp/c10_k8
  # AdaSync over K-async instead of K-sync:
  python -m waitless.experiments.main --config=experiments/configs/cifar10_adasync.py:adasync,base=kasync --workdir=...

Overrides of `cifar10.py`: plain SGD (no momentum) at a constant 0.12 without warm-up, as in the paper;
X ~ Exp(100 / s); AdaSync over K-sync from K0 = 1, adapting every 5 simulated seconds (**choice**: the
paper's t0 is not in the abstract; one K-sync update takes 1.25 ms at K = 1 and 27 ms at K = 8, so 5 s is
200 to 4,000 updates). Weight decay 5e-4 and augmentation stay as in `cifar10.py`. `num_steps` counts server
updates, each of K x 32 images (fewer epochs than `cifar10.py`'s 256-image iterations while K < 8).

Testing (CPU, about a minute; tfds mock data):
  python -m waitless.experiments.main --config=experiments/configs/cifar10_adasync.py:adasync,num_steps=30 \
    --config.model.name=resnet_test --config.eval_every=30 --mock_data --workdir=/tmp/c10_adasync_test
"""

from __future__ import annotations

import ml_collections

from waitless.experiments.configs import arguments
from waitless.experiments.configs import cifar10


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = cifar10.get_config(None)
  config.workers = 8                      # P learners
  config.batch_size = 32                  # per learner and pushed gradient
  config.algorithm = ml_collections.ConfigDict({
      'name': 'adasync',
      'base': 'ksync',                    # the K-family rule whose K adapts
      'k0': 1,                            # starting K (also the K of fixed-K variants given without k=)
      'k': 1,
      'adapt_every_s': 5.0,               # t0, simulated seconds between adjustments of K
  })
  config.optimizer.learning_rate = 0.12
  config.optimizer.momentum = 0.0
  config.optimizer.nesterov = False
  config.optimizer.lr_schedule = 'constant'
  config.optimizer.warmup_steps = 0
  config.stragglers.kind = 'exponential'  # X ~ Exp(rate): mean 10 ms per mini-batch of 32
  config.stragglers.rate = 100.0
  return arguments.apply_arg(config, arg or 'adasync')
