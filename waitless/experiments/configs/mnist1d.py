"""MNIST-1D (Greydanus, "Scaling down deep learning", 2020): the paper's small CNN, 8 workers on 8 CPU devices.

Generated locally by the `mnist1d` package (no download; cached after the first run, see data/mnist1d.py):
4,000 training and 1,000 test sequences of length 40, 10 classes. Harder than the digits (a linear model
reaches about a third), so algorithms that lose progress to staleness or averaging show it. The config argument
names the algorithm and overrides, as for every workload:

  python -m waitless.experiments.main --config=experiments/configs/mnist1d.py:sync --workdir=/tmp/m1d_sync
  python -m waitless.experiments.main --config=experiments/configs/mnist1d.py:local_sgd,local_steps=4 --workdir=...
  python -m waitless.experiments.main --config=experiments/configs/mnist1d.py:sync,model.name=mlp --workdir=...
  python -m waitless.experiments.main --config=experiments/configs/mnist1d.py:sync,stragglers=heterogeneous \
      --workdir=...

Models: `cnn1d` (default; the paper's ConvBase: three stride-2 convolutions of 25 channels, 5,210 parameters)
and `mlp` (`model.hidden_sizes`, read by the MLP only: two hidden layers of 100 as the paper's MLP, without its
residual connection).

Defaults: SGD, momentum 0.9, constant learning rate 0.2, batch 32 per worker (global 256), 300 iterations
(19 epochs), evaluation every 10 iterations, target accuracy 0.8; every micro-batch takes 10 ms of simulated
time on every worker (no stragglers, ideal network).

Variant `stragglers=heterogeneous` (a config-argument entry, e.g. `mnist1d.py:sync,stragglers=heterogeneous`):
a heterogeneous cluster with persistent slow workers and random delays, the setting the comparisons use:
workers 0 and 1 (a quarter) take twice as long for every micro-batch (20 ms instead of 10 ms) and, at every
iteration index, one random worker is delayed by another three calls (30 ms; on a cluster profile three of
the profile's micro-batch calls). The same as the flags
  --config.stragglers.slow_fraction=0.25 --config.stragglers.slow_factor=2.0
  --config.stragglers.delayed_workers=1 --config.stragglers.delay_calls=3
`stragglers=homogeneous` is the default (no stragglers). What it gives: docs/results/quickstart.md.

Variant `stragglers=sqrt`: a fixed, arbitrary heterogeneity (Ringmaster ASGD's setting): worker i's compute
times are scaled by sqrt(i + 1) (10 ms to 28 ms per micro-batch on 8 workers), no random delays; it sets
`stragglers.worker_factors` to sqrt(1), ..., sqrt(P) for the `workers` of the config argument (a later
`--config.workers` flag does not resize it: validation refuses the mismatch). Results:
docs/results/later_work.md. One run (900 server updates, about 4 simulated seconds):
  python -m waitless.experiments.main --config=experiments/configs/mnist1d.py:ringmaster,max_delay=4,stragglers=sqrt \
      --config.optimizer.momentum=0.0 --config.optimizer.learning_rate=0.15 --config.num_steps=900 \
      --workdir=/tmp/m1d_ringmaster

The parameter-server family (async, kasync, kbatch_*: an iteration is one server update of 1..K gradients)
needs more iterations and no momentum here: with momentum 0.9 async and kasync,k=4 diverge;
`optimizer.momentum=0.0` and 600 (kasync,k=4, lr 0.2) to 2,400 (async, lr 0.1) iterations learn.

Test accuracy (1,000 sequences), ours next to the paper's published baselines (the mnist1d README: one
worker, Adam, batch 100, 6,000+ steps):
  paper:  logistic regression 32%, MLP 68%, CNN 94%, GRU 91% (human expert 96%)
  ours: docs/experiments.md, "Embedded workloads".
"""

from __future__ import annotations

import ml_collections

from waitless.experiments.configs import arguments
from waitless.experiments.configs import common

def workload_config() -> ml_collections.ConfigDict:
  """The MNIST-1D workload before the config argument is applied."""
  config = common.base_config()
  config.dataset = ml_collections.ConfigDict()
  config.dataset.name = 'mnist1d'       # the package's defaults and seed: a fixed split, independent of `seed`

  config.model = ml_collections.ConfigDict()
  config.model.name = 'cnn1d'           # cnn1d | mlp
  config.model.hidden_sizes = (100, 100)  # mlp only
  config.model.dtype = 'float32'
  config.model.param_dtype = 'float32'

  config.workers = 8
  config.devices = 8
  config.batch_size = 32
  config.num_steps = 300
  config.eval_every = 10                # often: time to target is read at evaluations
  config.log_every = 10
  config.checkpoint_every = 100
  config.steps_per_call = 10
  config.eval_batch_size = 1000
  config.target_accuracy = 0.8

  config.optimizer.name = 'sgd'
  config.optimizer.learning_rate = 0.2
  config.optimizer.momentum = 0.9
  return config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return arguments.apply_arg(workload_config(), arg)
