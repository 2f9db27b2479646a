"""`config.dataset.name` -> the function that builds its `base.Dataset`."""

from __future__ import annotations

import config_errors as errors
from data import cifar
from data import digits
from data import imagenet
from data import mnist1d
from data import synthetic
from data import wmt

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
