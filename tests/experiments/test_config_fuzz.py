"""Every field of every shipped config, set out of range, is refused with one ConfigError before compiling.

For each leaf of each workload config (and of the `algorithm` section of every registered algorithm), the test
writes values no field may take (NaN, infinities, a huge negative number, an unknown choice, a malformed
tuple) and checks that `experiments.harness.validation.validate` raises `config_errors.ConfigError` naming that field:
never accepts the value, never fails with another exception (a traceback for the user). Through the config
argument (`ALGORITHM,key=value`), a value of the wrong type is a ConfigError too.

A field the validation cannot judge without opening the data (a split name, a directory) is listed in
`CHECKED_WHEN_OPENED` with the reason; a new field that is neither validated nor listed fails the test.
"""

from __future__ import annotations

import glob
import importlib
import math
import os

from absl.testing import absltest
from absl.testing import parameterized
import ml_collections

from waitless import config_errors as errors
from waitless.cluster import registry
from waitless.experiments.harness import validation
from waitless.experiments.configs import digits

# Free-form fields: their values are names that only the dataset or the file system can judge, when the
# dataset is opened (data/tfds_pipeline.py, data/wmt.py), with a one-line error there.
CHECKED_WHEN_OPENED = {
    'dataset.data_dir': 'a directory; tensorflow-datasets reports a missing one when the dataset is opened',
    'dataset.tokenizer_dir': 'a directory for the SentencePiece model; created when missing',
    'dataset.train_split': 'a tfds split expression (e.g. train[:90%]); tfds parses it',
    'dataset.eval_split': 'a tfds split expression; tfds parses it',
    'dataset.tfds_name': 'a tfds builder name; tfds reports an unknown one',
    'dataset.eval_tfds_name': 'a tfds builder name; tfds reports an unknown one',
    'dataset.source_language': 'a language code of the WMT builder',
    'dataset.target_language': 'a language code of the WMT builder',
}
# Fields where a negative number is a documented sentinel, not out of range.
NEGATIVE_IS_A_SENTINEL = {
    'stragglers.return_at_s': 'negative: the failed worker never returns',
}


def _workload_modules():
  names = sorted(os.path.basename(f)[:-3] for f in glob.glob(
      os.path.join(os.path.dirname(digits.__file__), '*.py')))
  return [importlib.import_module(f'waitless.experiments.configs.{n}') for n in names
          if n not in ('__init__', 'common', 'arguments')]


def _leaves(config: ml_collections.ConfigDict, prefix: str = ''):
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _leaves(value, f'{prefix}{key}.')
    else:
      yield f'{prefix}{key}', value


def _bad_values(path: str, value):
  """Values `path` must refuse, by the type of its default."""
  if isinstance(value, bool):
    return []  # ml_collections refuses non-bools; both values are in range
  if isinstance(value, int):
    return [-10**6]
  if isinstance(value, float):
    bad = [math.nan, math.inf, -math.inf]
    return bad if path in NEGATIVE_IS_A_SENTINEL else bad + [-1e6]
  if isinstance(value, str):
    return ['no_such_value']
  if isinstance(value, tuple):
    if path.endswith('decay_boundaries'):
      return [(1.5,), (0.75, 0.5), (math.nan,)]
    return [(-1,), ('x',)] + ([(10**6,)] if path.endswith('workers') else [])  # worker ids beyond P
  return []


def _set(config: ml_collections.ConfigDict, path: str, value) -> None:
  node = config
  parts = path.split('.')
  for part in parts[:-1]:
    node = node[part]
  with node.ignore_type():
    node[parts[-1]] = value


def _cases():
  """(name, config factory, field path, bad value) for every field of every config and algorithm."""
  cases = []
  for module in _workload_modules():
    workload = module.__name__.split('.')[-1]
    for path, value in _leaves(module.get_config(None)):
      if path.startswith('algorithm.') or path in CHECKED_WHEN_OPENED:
        continue
      for i, bad in enumerate(_bad_values(path, value)):
        cases.append((f'{workload}__{path}__{i}', module.get_config, None, path, bad))
  for name in registry.names():
    for path, value in _leaves(digits.get_config(name).algorithm, 'algorithm.'):
      if path == 'algorithm.name':
        continue
      for i, bad in enumerate(_bad_values(path, value)):
        cases.append((f'{name}__{path}__{i}', digits.get_config, name, path, bad))
  return cases


class FieldRangeFuzzTest(parameterized.TestCase):

  @parameterized.named_parameters(*_cases())
  def test_out_of_range_value_is_refused_naming_the_field(self, get_config, arg, path, bad):
    config = get_config(arg)
    validation.validate(config)  # the shipped value is valid
    _set(config, path, bad)
    with self.assertRaises(errors.ConfigError) as raised:
      validation.validate(config)
    self.assertIn(path, str(raised.exception))
    self.assertNotIn('\n', str(raised.exception))

  @parameterized.named_parameters(*[(f'{p}', p) for p, v in _leaves(digits.get_config('sync'))
                                    if not isinstance(v, (str, type(None))) and p != 'algorithm.name'])
  def test_wrong_type_in_the_config_argument_is_a_config_error(self, path):
    with self.assertRaises(errors.ConfigError) as raised:
      digits.get_config(f"sync,{path}='text'")
    self.assertIn(path, str(raised.exception))

  def test_every_field_is_validated_or_listed(self):
    """Catches a new free-form field: it must be validated (above) or listed with its reason."""
    for path in CHECKED_WHEN_OPENED:
      self.assertTrue(any(path in dict(_leaves(m.get_config(None))) for m in _workload_modules()), path)


if __name__ == '__main__':
  absltest.main()
