"""Every command the docs give resolves to a valid config (README.md, every docs/**/*.md, the config docstrings).

Each `experiments/configs/NAME.py[:ARG]` is loaded the way `experiments.main` loads it (ml_collections'
config_flags, with the `--config.KEY=VALUE` overrides on the same command line) and passed to
`validation.validate`, the check `setup.build` runs before anything compiles; nothing is compiled or trained.
Text is read as a shell reads it: a backslash at the end of a line joins the next line as it stands, so a
continuation indented inside a config argument splits it, and the command gets a stray positional argument
(which `experiments.main` would ignore); that fails too. Entries of `experiments.compare --algorithms=...` are
checked with the command's config argument. Algorithms that are not registered fail: nothing is expected to
fail.
"""

import ast
import glob
import os
import re
import shlex

from absl import flags
from absl.testing import absltest
from absl.testing import parameterized
from ml_collections import config_flags

from waitless import config_errors
from waitless.experiments import config_paths
from waitless.experiments.harness import validation
from waitless.experiments.configs import arguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, 'README.md')] + sorted(glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True))
_CONFIG_RE = re.compile(r'(?:--config=)?((?:waitless/)?experiments/configs/\w+\.py)(?::([^\s`\'"]*))?')
_OVERRIDE_RE = re.compile(r'--config\.([\w.]+)=([\'"]?)([^\s`\'"]+)\2')
_ALGORITHMS_RE = re.compile(r'--algorithms=([\'"]?)([^\s`\'"]+)\1')
_MODULE_RE = re.compile(r'python -m (waitless\.experiments\.\w+)')


def _doc_texts():
  """(name, text, its first line's number) of each document; config docstrings as written (backslashes kept)."""
  for path in DOCS:
    with open(path) as f:
      yield os.path.relpath(path, ROOT), f.read(), 1
  for path in sorted(glob.glob(os.path.join(ROOT, 'waitless', 'experiments', 'configs', '*.py'))):
    with open(path) as f:
      source = f.read()
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
      yield os.path.relpath(path, ROOT), ast.get_source_segment(source, body[0]), body[0].lineno


def _logical_lines(text: str, first: int):
  """(line number, line) with the shell's continuation: a line ending in a backslash joins the next as it is."""
  number, parts = None, []
  for i, line in enumerate(text.split('\n'), first):
    number = i if not parts else number
    if line.endswith('\\'):
      parts.append(line[:-1])
      continue
    yield number, ''.join(parts) + line
    parts = []


def _commands():
  """Every config the docs name: (where, config file, ARG or None, overrides, compare entries, stray words)."""
  found = []
  for doc, text, first in _doc_texts():
    for number, line in _logical_lines(text, first):
      matches = list(_CONFIG_RE.finditer(line))
      for i, match in enumerate(matches):
        tail = line[match.end():matches[i + 1].start() if i + 1 < len(matches) else len(line)]
        overrides = tuple((key, value) for key, _, value in _OVERRIDE_RE.findall(tail))
        algorithms = _ALGORITHMS_RE.search(tail)
        stray = ()
        module = _MODULE_RE.search(line[:match.start()])
        if module and match.group(0).startswith('--config='):
          words = shlex.split(line[module.end():].split('`')[0], comments=True)
          stray = tuple(w for w in words if not w.startswith('-'))
        where = f'{doc}:{number}: {match.group(0)}'
        found.append((where, match.group(1), match.group(2), overrides,
                      algorithms.group(2) if algorithms else None, stray))
  return found


def _load(path: str, arg: str | None, overrides=()):
  """The config `experiments.main --config=PATH[:ARG] --config.K=V...` would run (config_flags' parser)."""
  spec = config_paths.resolve(path) + (f':{arg}' if arg is not None else '')
  argv = ['main', f'--config={spec}', *(f'--config.{k}={v}' for k, v in overrides)]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, flag_values=values, lock_config=True, sys_argv=argv)
  values(argv)
  arguments.apply_flag_rules(values.config, config_flags.get_override_values(values['config']))
  return values.config


COMMANDS = _commands()


class DocsCommandsTest(parameterized.TestCase):

  def test_the_docs_name_configs(self):
    docs = {where.split(':')[0] for where, *_ in COMMANDS}
    self.assertIn('README.md', docs)
    self.assertIn('waitless/experiments/configs/digits.py', docs)
    for page in ('compare', 'experiments', 'simulator', 'real_runs', 'results/nonblocking', 'results/wagma'):
      self.assertIn(f'docs/{page}.md', docs)
    self.assertGreater(len(COMMANDS), 40)

  def test_quoted_overrides_are_read(self):
    line = ("python -m waitless.experiments.compare --config=experiments/configs/digits.py "
            "--config.stragglers.slow_workers='(0,1)'")
    self.assertEqual(tuple((k, v) for k, _, v in _OVERRIDE_RE.findall(line)), (('stragglers.slow_workers', '(0,1)'),))

  @parameterized.named_parameters(
      (f'{i}_{re.sub(r"[^0-9A-Za-z]+", "_", c[0])[:90]}', *c) for i, c in enumerate(COMMANDS))
  def test_command_resolves_to_a_valid_config(self, where, path, arg, overrides, algorithms, stray):
    self.assertEqual(stray, (), f'{where}: words outside the config argument (an indented line continuation?)')
    config = _load(path, arg, overrides)
    validation.validate(config)
    if algorithms:
      pairs = arguments.pairs(arg)
      for entry in arguments.parse_entries(algorithms):
        with self.subTest(entry=entry):
          validation.validate(_load(path, ','.join([entry, *pairs]), overrides))

  def test_a_broken_command_fails(self):
    with self.assertRaisesRegex(Exception, 'no_such_algorithm'):
      _load('experiments/configs/digits.py', 'no_such_algorithm')
    with self.assertRaises(config_errors.ConfigError):
      validation.validate(_load('experiments/configs/digits.py', 'sync,workers=3'))
    joined = ('python -m waitless.experiments.main --config=experiments/configs/digits.py:sync,\\\n'
              '    seed=1 --workdir=w')
    line = joined.replace('\\\n', '')
    self.assertEqual(shlex.split(line)[4], 'seed=1')  # what _commands reports as a stray word


if __name__ == '__main__':
  absltest.main()
