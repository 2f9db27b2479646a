"""`config.model.name` -> a Flax module. Every module takes `(inputs, train: bool)`."""

from __future__ import annotations

import jax.numpy as jnp

from waitless import config_errors as errors
from waitless.models import cnn1d
from waitless.models import mlp
from waitless.models import resnet
from waitless.models import transformer
from waitless.models import wrn

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float64': jnp.float64}


def _dtype(config, field):
  name = config.get(field, 'float32')
  errors.require(name in DTYPES, f'model.{field}', name, f'one of {", ".join(DTYPES)}')
  return DTYPES[name]


def _mlp(config, num_outputs):
  return mlp.MLP(hidden_sizes=tuple(config.hidden_sizes), num_outputs=num_outputs,
                 dtype=_dtype(config, 'dtype'), param_dtype=_dtype(config, 'param_dtype'))


BUILDERS = {
    'mlp': _mlp,
    'cnn1d': cnn1d.build,
    'resnet20': resnet.build,
    'resnet56': resnet.build,
    'resnet18': resnet.build,
    'resnet50': resnet.build,
    'resnet_test': resnet.build,
    'resnet50_test': resnet.build,
    'wrn16_8': wrn.build,
    'wrn28_10': wrn.build,
    'wrn_test': wrn.build,
    'transformer_base': transformer.build,
    'transformer_big': transformer.build,
    'transformer_test': transformer.build,
}


def make_model(config, num_outputs: int):
  """The module named by `config.name` (`config` = the `model` section), with `num_outputs` outputs."""
  if config.name not in BUILDERS:
    raise errors.ConfigError('model.name', config.name, f'known: {", ".join(sorted(BUILDERS))}')
  return BUILDERS[config.name](config, num_outputs)
