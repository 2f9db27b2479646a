"""Synthetic least-squares (or logistic) problem for exactness tests and quick algorithm studies.

  python -m waitless.experiments.main --config=experiments/configs/synthetic.py:sync --workdir=/tmp/ls

A linear model on y = x . w* + noise, d = 16; plain SGD (no momentum) so sequential references are simple.
"""

from __future__ import annotations

import ml_collections

from waitless.experiments.configs import arguments
from waitless.experiments.configs import common


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = common.base_config()
  config.dataset = ml_collections.ConfigDict()
  config.dataset.name = 'synthetic'
  config.dataset.problem = 'least_squares'  # least_squares | logistic
  config.dataset.num_examples = 2048
  config.dataset.dim = 16
  config.dataset.noise = 0.1
  config.dataset.problem_seed = 0           # the problem, independent of the run seed

  config.model = ml_collections.ConfigDict()
  config.model.name = 'mlp'
  config.model.hidden_sizes = ()            # linear model
  config.model.dtype = 'float32'
  config.model.param_dtype = 'float32'

  config.workers = 4
  config.devices = 4
  config.batch_size = 8
  config.num_steps = 100
  config.target_accuracy = 1.0   # regression: accuracy is reported as 0, so no time_to_target (use the loss)
  config.optimizer.momentum = 0.0
  config.optimizer.learning_rate = 0.05
  return arguments.apply_arg(config, arg)
