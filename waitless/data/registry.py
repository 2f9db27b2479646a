"""`config.dataset.name` -> the function that builds its `base.Dataset`.

The embedded data sets' modules (numpy only) are imported here; the TFDS pipelines and WMT's (with its
tokenizer, sentencepiece) when a run asks for them: a digits run does not import them.
"""

from __future__ import annotations

import importlib

from waitless import config_errors as errors
from waitless.data import digits
from waitless.data import mnist1d
from waitless.data import synthetic


def _cifar(config):
  from waitless.data import cifar
  return cifar.make_dataset(config)


def _imagenet(config):
  from waitless.data import imagenet
  return imagenet.make_dataset(config)


def _wmt(config):
  from waitless.data import wmt
  return wmt.make_dataset(config)


BUILDERS = {
    'digits': digits.make_dataset,
    'mnist1d': mnist1d.make_dataset,
    'synthetic': synthetic.make_dataset,
    'cifar10': _cifar,
    'cifar100': _cifar,
    'imagenet2012': _imagenet,
    'wmt': _wmt,
}


def _signature(module_name: str):
  def signature(config):
    module = importlib.import_module(f'waitless.data.{module_name}')
    return module.signature(config)
  return signature


SIGNATURES = {name: _signature(module) for name, module in (
    ('digits', 'digits'), ('mnist1d', 'mnist1d'), ('synthetic', 'synthetic'), ('cifar10', 'cifar'),
    ('cifar100', 'cifar'), ('imagenet2012', 'imagenet'), ('wmt', 'wmt'))}


def _check_name(config) -> None:
  if config.dataset.name not in BUILDERS:
    raise errors.ConfigError('dataset.name', config.dataset.name, f'known: {", ".join(sorted(BUILDERS))}')


def signature(config):
  """The `base.Signature` of `config.dataset` (example shapes, classes, task) without reading the data set."""
  _check_name(config)
  return SIGNATURES[config.dataset.name](config)


def make_dataset(config):
  _check_name(config)
  return BUILDERS[config.dataset.name](config)
