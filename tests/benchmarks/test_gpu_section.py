"""benchmarks.gpu: the GPU section's configs, its code path on CPU (tiny settings), and the command without a GPU."""

import io
import math
import os
import re
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import jax
import pytest

from waitless.cluster import registry
from benchmarks import gpu
from waitless.experiments.harness import validation

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tables(text: str) -> dict[str, list[list[str]]]:
  """'6.1' -> the body rows (cells) of the table under `### 6.1 ...`."""
  tables = {}
  for part in text.split('\n### ')[1:]:
    number = part.split(' ', 1)[0]
    rows = [line for line in part.splitlines() if line.startswith('|')]
    tables[number] = [[c.strip() for c in row.strip('|').split('|')] for row in rows[2:]]  # after header, ---
  return tables


def _ratio(cell: str) -> float:
  match = re.fullmatch(r'(\S+)x', cell)
  assert match, cell
  return float(match.group(1))


class ConfigTest(parameterized.TestCase):

  @parameterized.parameters(8, 2)
  def test_every_registered_algorithm_gets_a_valid_one_device_config(self, workers):
    for name in registry.names():
      with self.subTest(name):
        config = gpu._config(name, 'resnet20', workers, 32)
        validation.validate(config)
        self.assertEqual((config.algorithm.name, config.workers, config.devices, config.batch_size),
                         (name, workers, 1, 32))
        self.assertEqual((config.model.name, config.model.dtype), ('resnet20', 'float32'))

  def test_k_of_p_argument_kept_when_it_fits_and_cut_to_half_otherwise(self):
    self.assertEqual(gpu._config('ksync,k=6', 'resnet20', 8, 32).algorithm.k, 6)
    self.assertEqual(gpu._config('ksync,k=6', 'resnet20', 4, 32).algorithm.k, 2)
    config = gpu._config('adasync,k0=2', 'resnet20', 1, 32)
    self.assertEqual(config.algorithm.k0, 1)
    self.assertEqual(gpu._label('ksync', gpu._config('ksync,k=6', 'resnet20', 8, 32),
                                registry.get('ksync').defaults), 'ksync k=6')

  def test_bfloat16_computes_in_bfloat16_with_float32_parameters(self):
    config = gpu._config('sync', 'resnet20', 8, 32, dtype='bfloat16')
    validation.validate(config)
    self.assertEqual((config.model.dtype, config.model.param_dtype), ('bfloat16', 'float32'))


class SectionTest(absltest.TestCase):

  @pytest.mark.slow  # six ResNet builds and compilations: about a minute on 2 shared cores
  def test_quick_section_on_cpu(self):
    out = io.StringIO()
    gpu.section_gpu(out, quick=True, model='resnet_test', workers=2, batch=4,
                    args={'ksync': 'ksync,k=6', 'local_sgd': 'local_sgd,local_steps=2'})
    text = out.getvalue()
    lines = text.splitlines()
    self.assertTrue(lines[0].startswith('## 6. GPU: resnet_test'), lines[0])
    where = next(line for line in lines if line.startswith('Ran on:'))
    self.assertIn('backend cpu', where)
    self.assertIn(f'jax {jax.__version__}', where)
    self.assertIn('2 workers x batch 4', where)
    self.assertEqual(lines.index(where), 2)  # right under the heading, before the tables
    self.assertTrue(text.endswith('\n\n'))

    tables = _tables(text)
    self.assertEqual(sorted(tables), ['6.1', '6.2', '6.3'])
    self.assertEqual([row[0] for row in tables['6.1']], ['sync, 2 workers x 4', 'sync, 1 worker x 8'])
    self.assertEqual([row[0] for row in tables['6.2']], ['ksync k=1', 'local_sgd', 'sync', 'wagma'])
    self.assertEqual([row[0] for row in tables['6.3']], ['float32', 'bfloat16'])
    for number, rows in tables.items():
      for row in rows:
        with self.subTest(f'{number} {row[0]}'):
          ratio = _ratio(row[-1])
          self.assertTrue(math.isfinite(ratio) and ratio > 0, row)
          seconds = float(row[1])
          self.assertGreater(seconds, 0)
    # The base of each table is itself.
    self.assertEqual(tables['6.1'][1][-1], '1.00x')
    self.assertEqual(dict((row[0], row[-1]) for row in tables['6.2'])['sync'], '1.00x')
    self.assertEqual(tables['6.3'][0][-1], '1.00x')
    # images/s = workers x batch / seconds per iteration.
    for row in tables['6.1'] + tables['6.3']:
      self.assertAlmostEqual(float(row[2]), 8 / (float(row[1]) / 1e3), delta=0.02 * float(row[2]) + 1)


class CommandTest(absltest.TestCase):

  def test_without_gpu_prints_one_line_and_exits_0(self):
    if jax.default_backend() == 'gpu':
      self.skipTest('a GPU is present: the command would run the section')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get('PYTHONPATH')] if p]))
    result = subprocess.run([sys.executable, '-m', 'benchmarks.gpu'], cwd=ROOT, capture_output=True, text=True,
                            env=env, timeout=300)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.splitlines(), [result.stdout.strip()])
    self.assertIn('No GPU present', result.stdout)
    self.assertIn('--force', result.stdout)


if __name__ == '__main__':
  absltest.main()
