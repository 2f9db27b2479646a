"""The `waitless` distribution: installed, it is `waitless.*` and nothing else; in a checkout, one name per module.

A clean venv (`python -m venv`, its own pip and setuptools), `pip install --no-deps --no-build-isolation` of a copy
of the sources into it (what `pip install .` or a git URL builds, without touching the checkout), the
dependencies reached through a .pth file naming this environment's site-packages (CI reaches no index at test
time), then the venv's interpreter, isolated (-I) in an empty directory, imports `waitless.algorithms` from the
venv and finds no top-level `algorithms`, `config_errors`, ... In a checkout the folder `waitless/` is the package,
so no module runs under two names and `except ConfigError` catches what an algorithm raises.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

from absl.testing import absltest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_LEVEL = ('algorithms', 'cluster', 'data', 'experiments', 'models', 'config_errors')


class OneNameTest(absltest.TestCase):

  def test_one_name_per_module(self):
    probe = ('import sys, waitless.experiments.compare, waitless.experiments.simulate\n'
             f'print(sorted({{m.split(".")[0] for m in sys.modules}} & {set(TOP_LEVEL)!r}))')
    result = subprocess.run([sys.executable, '-c', probe], cwd=self.create_tempdir().full_path, capture_output=True,
                            text=True, env=dict(os.environ, PYTHONPATH=ROOT), check=False)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip(), '[]', 'a module was imported under a top-level name')

  def test_every_module_file_is_its_import_path(self):
    # The folder is the import name: no package extends its __path__ beyond its own folder.
    import waitless
    self.assertEqual(list(waitless.__path__), [os.path.join(ROOT, 'waitless')])
    for name in TOP_LEVEL:
      self.assertFalse(os.path.exists(os.path.join(ROOT, name + '.py')), name)
      self.assertFalse(os.path.exists(os.path.join(ROOT, name, '__init__.py')), name)


class InstallTest(absltest.TestCase):

  def test_install_gives_waitless_and_nothing_top_level(self):
    tmp = self.create_tempdir().full_path
    source, venv, empty = (os.path.join(tmp, d) for d in ('source', 'venv', 'empty'))
    os.makedirs(empty)
    ignore = shutil.ignore_patterns('__pycache__', '*.egg-info', 'build')
    os.makedirs(source)
    for name in ('pyproject.toml', 'setup.py', 'README.md'):
      shutil.copy(os.path.join(ROOT, name), source)
    for name in ('waitless',):
      shutil.copytree(os.path.join(ROOT, name), os.path.join(source, name), ignore=ignore)
    subprocess.run([sys.executable, '-m', 'venv', venv], check=True, capture_output=True, text=True, cwd=tmp)
    python = os.path.join(venv, 'bin', 'python')
    site = subprocess.run([python, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'], check=True,
                          capture_output=True, text=True).stdout.strip()
    before = set(os.listdir(site))
    with open(os.path.join(site, 'dependencies.pth'), 'w') as f:  # jax, flax, ... from this environment
      f.write(sysconfig.get_paths()['purelib'] + '\n')
    subprocess.run([python, '-m', 'pip', 'install', '-q', '--no-deps', '--no-build-isolation', '--no-index', source],
                   check=True, capture_output=True, text=True, cwd=tmp)
    installed = sorted(n for n in set(os.listdir(site)) - before if not n.endswith(('.dist-info', '.pth')))
    self.assertEqual(installed, ['waitless'])
    probe = textwrap.dedent(f'''\
        import importlib.util, sys
        import waitless.cluster.registry as registry
        from waitless import config_errors
        from waitless.cluster import factory
        assert all(importlib.util.find_spec(n) is None for n in {TOP_LEVEL!r}), 'a top-level module is installed'
        assert registry.__file__.startswith({site!r}), registry.__file__
        try:
          registry.get('no_such_algorithm')
        except config_errors.ConfigError as e:
          print(len(registry.names()), 'algorithms;', e)
        ''')
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    result = subprocess.run([python, '-I', '-c', probe], cwd=empty, env=env, capture_output=True, text=True,
                            check=False)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertRegex(result.stdout, r'^\d+ algorithms;.*no_such_algorithm')
    # A program and its config file by the names a checkout uses, from an empty directory: the installed copy.
    result = subprocess.run([python, '-I', '-m', 'waitless.experiments.simulate',
                             '--config=experiments/configs/digits.py:sync', '--iterations=2',
                             '--config.cluster.profile=dgx_h100'],
                            cwd=empty, env=env, capture_output=True, text=True, check=False)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn('"iterations": 2', result.stdout)
    self.assertIn('"profile": "dgx_h100"', result.stdout)  # the shipped profiles install as package data


if __name__ == '__main__':
  absltest.main()
