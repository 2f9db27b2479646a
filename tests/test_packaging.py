"""The `waitless` distribution: installed, it is `waitless.*` and nothing else; in a checkout, one name per module.

A clean venv (`python -m venv`, its own pip and setuptools), `pip install --no-deps --no-build-isolation` of a copy
of the sources into it (what `pip install .` or a git URL builds, without touching the checkout), the
dependencies reached through a .pth file naming this environment's site-packages (CI reaches no index at test
time), then the venv's interpreter, isolated (-I) in an empty directory, imports `waitless.algorithms` from the
venv and finds no top-level `algorithms`, `config_errors`, ... And the imports of the checkout go through
`waitless.` only (`launch/rewrite_imports.py --check`), so no module runs under two names and `except
ConfigError` catches what an algorithm raises.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

from absl.testing import absltest

from launch import rewrite_imports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_LEVEL = rewrite_imports.PACKAGES + rewrite_imports.MODULES


class RewriteTest(absltest.TestCase):

  def test_rules(self):
    # Each line starts with '|' so that the script, which rewrites this file too, leaves the fixture alone.
    before = textwrap.dedent('''\
        |from algorithms import spec
        |from experiments.configs import common
        |import cluster.rules as rules
        |import config_errors as errors
        |import config_errors
        |  import config_errors as errors  # pylint: disable=g-import-not-at-top
        |from config_errors import ConfigError
        |  from data import embedded  # indented, with a comment
        |>>> from algorithms import local_sgd
        |x = importlib.import_module(f|'experiments.configs.{n}')
        |from algorithms_extra import thing
        |import dataclasses
        |subprocess.run([sys.executable, '-m', 'experiments.main'])
        ''').replace('|', '')
    after = textwrap.dedent('''\
        |from waitless.algorithms import spec
        |from waitless.experiments.configs import common
        |import waitless.cluster.rules as rules
        |from waitless import config_errors as errors
        |from waitless import config_errors
        |  from waitless import config_errors as errors  # pylint: disable=g-import-not-at-top
        |from waitless.config_errors import ConfigError
        |  from waitless.data import embedded  # indented, with a comment
        |>>> from waitless.algorithms import local_sgd
        |x = importlib.import_module(f'waitless.experiments.configs.{n}')
        |from algorithms_extra import thing
        |import dataclasses
        |subprocess.run([sys.executable, '-m', 'experiments.main'])
        ''').replace('|', '')
    self.assertEqual(rewrite_imports.rewrite('x.py', before), after)
    self.assertEqual(rewrite_imports.rewrite('x.py', after), after)  # idempotent
    self.assertEqual(rewrite_imports.by_hand(after), [])

  def test_markdown_python_blocks_only(self):
    text = 'Say `from algorithms import x`.\n```python\nfrom algorithms import x\n```\n```bash\nfrom algorithms\n```\n'
    self.assertEqual(rewrite_imports.rewrite('README.md', text),
                     text.replace('```python\nfrom algorithms', '```python\nfrom waitless.algorithms'))

  def test_imports_binding_the_package_name_are_left_to_a_person(self):
    self.assertEqual(rewrite_imports.by_hand('import algorithms.spec\nimport os, cluster\nimport data  # x\n'),
                     ['import algorithms.spec', 'import os, cluster', 'import data  # x'])

  def test_the_checkout_is_rewritten(self):
    result = subprocess.run([sys.executable, os.path.join(ROOT, 'launch', 'rewrite_imports.py'), '--check'],
                            capture_output=True, text=True, check=False)
    self.assertEqual(result.returncode, 0, 'run `python launch/rewrite_imports.py`:\n' + result.stdout
                     + result.stderr)

  def test_one_name_per_module(self):
    probe = ('import sys, waitless.experiments.compare, waitless.experiments.simulate\n'
             f'print(sorted({{m.split(".")[0] for m in sys.modules}} & {set(TOP_LEVEL)!r}))')
    result = subprocess.run([sys.executable, '-c', probe], cwd=self.create_tempdir().full_path, capture_output=True,
                            text=True, env=dict(os.environ, PYTHONPATH=ROOT), check=False)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip(), '[]', 'a module was imported under its top-level name too')


class InstallTest(absltest.TestCase):

  def test_install_gives_waitless_and_nothing_top_level(self):
    tmp = self.create_tempdir().full_path
    source, venv, empty = (os.path.join(tmp, d) for d in ('source', 'venv', 'empty'))
    os.makedirs(empty)
    ignore = shutil.ignore_patterns('__pycache__', '*.egg-info', 'build')
    os.makedirs(source)
    for name in ('pyproject.toml', 'setup.py', 'README.md'):
      shutil.copy(os.path.join(ROOT, name), source)
    for name in ('waitless',) + rewrite_imports.PACKAGES:
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
        import waitless.algorithms.registry as registry
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


if __name__ == '__main__':
  absltest.main()
