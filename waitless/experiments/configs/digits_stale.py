"""Slow and stale gradients on the embedded digits: softmax regression, 8 learners, X ~ Exp(1), K = 4.

The first experiment of Dutta et al., "Slow and Stale Gradients Can Win the Race" (AISTATS 2018) (MNIST
softmax regression, P = 8, K = 4, exponential compute times of mean 1 s, batch 1, eta = 0.01) on the digits
that ship with scikit-learn, for the parameter-server family (`ksync`, `kbatch_sync`, `kasync`,
`kbatch_async`, `async`, `adasync`; any other registered algorithm runs too):

  python -m waitless.experiments.main --config=experiments/configs/digits_stale.py:kasync,k=4 --workdir=/tmp/ds_kasync
  python -m waitless.experiments.main --config=experiments/configs/digits_stale.py:ksync,k=8 --workdir=/tmp/ds_sync
  python -m waitless.experiments.main --config=experiments/configs/digits_stale.py:adasync,base=ksync,k0=1 --workdir=...
  python -m benchmarks.stale_tradeoff   # every variant for the same simulated time: the error-runtime table

Differences from the paper, and why: eta = 0.2 instead of 0.01 (the digits are standardised, 64 features),
so that 1,000 simulated seconds (a few thousand updates, seconds on two CPU cores) reach the error floor of
the variants with K <= 4 (the floor grows with eta / (K b) and with staleness; K = 8 needs longer). An iteration is one
server update, so `num_steps` buys very different simulated times per variant (mean time per update with
X ~ Exp(1): async 1/8 s, K-batch-* K/8 s, K-sync and K-async H_8 - H_{8-K} s, 0.63 s for K = 4, 2.7 s for
K = 8): compare runs against `sim_time`, as `benchmarks/stale_tradeoff.py` does (1,000 simulated seconds
each, 3 seeds). AdaSync adapts K every 20 simulated seconds (**choice**: about 160 updates at K = 1).
"""

from __future__ import annotations

import ml_collections

from waitless.experiments.configs import arguments
from waitless.experiments.configs import digits


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = digits.workload_config()
  config.model.hidden_sizes = ()        # no hidden layer: softmax regression

  config.workers = 8                    # P learners
  config.devices = 8
  config.batch_size = 1                 # per learner and pushed gradient, as in the paper
  config.num_steps = 2000               # server updates
  config.eval_every = 100
  config.log_every = 50
  config.checkpoint_every = 1000
  config.steps_per_call = 50
  config.target_accuracy = 0.9

  # K = 4 for every fixed-K variant; AdaSync starts at K0 = 1 and adapts every 20 simulated seconds.
  config.algorithm = ml_collections.ConfigDict({'name': 'kasync', 'k': 4, 'k0': 1, 'adapt_every_s': 20.0})

  config.optimizer.name = 'sgd'         # plain SGD on the server, as in the paper
  config.optimizer.learning_rate = 0.2  # paper: 0.01 (on MNIST)
  config.optimizer.momentum = 0.0

  config.stragglers.kind = 'exponential'  # X ~ Exp(mu): mean 1 / mu seconds per mini-batch
  config.stragglers.rate = 1.0            # mu
  return arguments.apply_arg(config, arg)
