"""Embedded default workload: scikit-learn digits, an MLP, 8 workers on 8 (CPU) devices.

Runs anywhere in a few minutes, no download. The config argument names the algorithm and overrides:

  python -m waitless.experiments.main --config=experiments/configs/digits.py:sync --workdir=/tmp/digits_sync
  python -m waitless.experiments.main --config=experiments/configs/digits.py:local_sgd,local_steps=4 --workdir=...
  python -m waitless.experiments.main --config=experiments/configs/digits.py:dasgd,local_steps=4,delay=1 --workdir=...

Defaults: SGD, momentum 0.9, constant learning rate 0.05, batch 16 per worker, 300 iterations, every
micro-batch takes 10 ms of simulated time on every worker (no stragglers, ideal network).
"""

from __future__ import annotations

import ml_collections

from waitless.experiments.configs import arguments
from waitless.experiments.configs import common


def workload_config() -> ml_collections.ConfigDict:
  """The digits workload before the config argument is applied (variants override it)."""
  config = common.base_config()
  config.dataset = ml_collections.ConfigDict()
  config.dataset.name = 'digits'
  config.dataset.test_fraction = 0.2    # fixed stratified split, independent of the run seed

  config.model = ml_collections.ConfigDict()
  config.model.name = 'mlp'
  config.model.hidden_sizes = (128,)
  config.model.dtype = 'float32'
  config.model.param_dtype = 'float32'

  config.optimizer.learning_rate = 0.05
  return config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return arguments.apply_arg(workload_config(), arg)
