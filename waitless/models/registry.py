"""`config.model.name` -> a Flax module. Every module takes `(inputs, train: bool)`.

Each model's module but the MLP's is imported when a run asks for it (an MLP run imports no ResNet nor
Transformer).
"""

from __future__ import annotations

import jax.numpy as jnp

from waitless import config_errors as errors
from waitless.models import mlp

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float64': jnp.float64}


def _dtype(config, field):
  name = config.get(field, 'float32')
  errors.require(name in DTYPES, f'model.{field}', name, f'one of {", ".join(DTYPES)}')
  return DTYPES[name]


def _mlp(config, num_outputs):
  return mlp.MLP(hidden_sizes=tuple(config.hidden_sizes), num_outputs=num_outputs,
                 dtype=_dtype(config, 'dtype'), param_dtype=_dtype(config, 'param_dtype'))


def _cnn1d(config, num_outputs):
  from waitless.models import cnn1d
  return cnn1d.build(config, num_outputs)


def _resnet(config, num_outputs):
  from waitless.models import resnet
  return resnet.build(config, num_outputs)


def _wrn(config, num_outputs):
  from waitless.models import wrn
  return wrn.build(config, num_outputs)


def _transformer(config, num_outputs):
  from waitless.models import transformer
  return transformer.build(config, num_outputs)


BUILDERS = {
    'mlp': _mlp,
    'cnn1d': _cnn1d,
    'resnet20': _resnet,
    'resnet56': _resnet,
    'resnet18': _resnet,
    'resnet50': _resnet,
    'resnet_test': _resnet,
    'resnet50_test': _resnet,
    'wrn16_8': _wrn,
    'wrn28_10': _wrn,
    'wrn_test': _wrn,
    'transformer_base': _transformer,
    'transformer_big': _transformer,
    'transformer_test': _transformer,
}


def make_model(config, num_outputs: int):
  """The module named by `config.name` (`config` = the `model` section), with `num_outputs` outputs."""
  if config.name not in BUILDERS:
    raise errors.ConfigError('model.name', config.name, f'known: {", ".join(sorted(BUILDERS))}')
  return BUILDERS[config.name](config, num_outputs)
