"""`config.dataset.name` -> the function that builds its `base.Dataset`.

Each pipeline's module is imported when a run asks for it: a digits run does not import the TFDS pipelines nor
WMT's tokenizer (sentencepiece).
"""

from __future__ import annotations

from waitless import config_errors as errors


def _digits(config):
  from waitless.data import digits  # pylint: disable=g-import-not-at-top
  return digits.make_dataset(config)


def _mnist1d(config):
  from waitless.data import mnist1d  # pylint: disable=g-import-not-at-top
  return mnist1d.make_dataset(config)


def _synthetic(config):
  from waitless.data import synthetic  # pylint: disable=g-import-not-at-top
  return synthetic.make_dataset(config)


def _cifar(config):
  from waitless.data import cifar  # pylint: disable=g-import-not-at-top
  return cifar.make_dataset(config)


def _imagenet(config):
  from waitless.data import imagenet  # pylint: disable=g-import-not-at-top
  return imagenet.make_dataset(config)


def _wmt(config):
  from waitless.data import wmt  # pylint: disable=g-import-not-at-top
  return wmt.make_dataset(config)


BUILDERS = {
    'digits': _digits,
    'mnist1d': _mnist1d,
    'synthetic': _synthetic,
    'cifar10': _cifar,
    'cifar100': _cifar,
    'imagenet2012': _imagenet,
    'wmt': _wmt,
}


def make_dataset(config):
  if config.dataset.name not in BUILDERS:
    raise errors.ConfigError('dataset.name', config.dataset.name, f'known: {", ".join(sorted(BUILDERS))}')
  return BUILDERS[config.dataset.name](config)
