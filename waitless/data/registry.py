"""`config.dataset.name` -> the function that builds its `base.Dataset`."""

from __future__ import annotations

from waitless import config_errors as errors
from waitless.data import cifar
from waitless.data import digits
from waitless.data import imagenet
from waitless.data import mnist1d
from waitless.data import synthetic
from waitless.data import wmt

BUILDERS = {
    'digits': digits.make_dataset,
    'mnist1d': mnist1d.make_dataset,
    'synthetic': synthetic.make_dataset,
    'cifar10': cifar.make_dataset,
    'cifar100': cifar.make_dataset,
    'imagenet2012': imagenet.make_dataset,
    'wmt': wmt.make_dataset,
}


def make_dataset(config):
  if config.dataset.name not in BUILDERS:
    raise errors.ConfigError('dataset.name', config.dataset.name, f'known: {", ".join(sorted(BUILDERS))}')
  return BUILDERS[config.dataset.name](config)
