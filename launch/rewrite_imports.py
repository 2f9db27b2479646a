"""Rewrites every intra-project import to the public path `waitless.*`; idempotent, rerun after each merge.

  python launch/rewrite_imports.py           rewrite in place, print the files changed
  python launch/rewrite_imports.py --check   change nothing; exit 1 and list the files still to rewrite

The packages stay top-level folders of the repository (`waitless/__init__.py` makes them `waitless.algorithms`, ...
in a checkout; setup.py installs them there). A module imported as both `algorithms.spec` and
`waitless.algorithms.spec` would run twice, and `except config_errors.ConfigError` would miss a
`waitless.config_errors.ConfigError`: so code imports through `waitless.` only. This script moves
`config_errors.py` into `waitless/` and rewrites, in every .py file of the repository and the python blocks of
the Markdown files:

  from algorithms import spec               ->  from waitless.algorithms import spec
  from experiments.configs import common    ->  from waitless.experiments.configs import common
  import cluster.rules as rules              ->  import waitless.cluster.rules as rules
  import config_errors as errors             ->  from waitless import config_errors as errors
  from config_errors import ConfigError      ->  from waitless.config_errors import ConfigError
  importlib.import_module(f'experiments.x')  ->  importlib.import_module(f'waitless.experiments.x')

(also indented, and after a doctest's `>>> `). `python -m experiments.main` and other module names given to a
new interpreter stay: they run in a checkout as they did. An import it cannot rewrite without changing the name
it binds (`import algorithms.spec`, several modules in one statement) is listed and the script exits 2:
rewrite that line by hand. `tests/` and `benchmarks/` are tools of a checkout, not installed: they keep
their own names.
"""

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ('algorithms', 'cluster', 'data', 'experiments', 'models')
MODULES = ('config_errors',)
SKIP_DIRS = {'.git', '.venv', 'runs', 'workdirs', 'build', 'dist', 'tmp', '__pycache__', '.pytest_cache'}
THIS = os.path.abspath(__file__)

_PREFIX = r'^(?P<indent>[ \t]*(?:>>> |\.\.\. )?)'
_PKG = '|'.join(PACKAGES)
_MOD = '|'.join(MODULES)
_RULES = (
    (re.compile(_PREFIX + rf'from (?P<name>(?:{_PKG}|{_MOD})(?:\.\w+)*) import ', re.M),
     r'\g<indent>from waitless.\g<name> import '),
    (re.compile(_PREFIX + rf'import (?P<name>(?:{_PKG})(?:\.\w+)+) as ', re.M),
     r'\g<indent>import waitless.\g<name> as '),
    (re.compile(_PREFIX + rf'import (?P<name>{_MOD})(?P<rest>(?: as \w+)?[ \t]*(?:#.*)?)$', re.M),
     r'\g<indent>from waitless import \g<name>\g<rest>'),
    (re.compile(rf'import_module\((?P<f>f?)(?P<q>[\'"])(?P<name>(?:{_PKG})\.)'),
     r'import_module(\g<f>\g<q>waitless.\g<name>'),
)
# Imports that bind the package's own name, or several modules: no mechanical rewrite keeps their meaning.
_BY_HAND = re.compile(
    _PREFIX + rf'import (?:(?:{_PKG}|{_MOD})(?:\.\w+)*(?:[ \t]*,|[ \t]*(?:#.*)?$)|.*,[ \t]*(?:{_PKG}|{_MOD})\b)', re.M)
_FENCE = re.compile(r'(```python\n)(.*?)(```)', re.S)


def rewrite_python(text: str) -> str:
  for pattern, replacement in _RULES:
    text = pattern.sub(replacement, text)
  return text


def rewrite(path: str, text: str) -> str:
  if path.endswith('.md'):
    return _FENCE.sub(lambda m: m.group(1) + rewrite_python(m.group(2)) + m.group(3), text)
  return rewrite_python(text)


def by_hand(text: str) -> list[str]:
  return [m.group(0).strip() for m in _BY_HAND.finditer(text)]


def files(root: str):
  for folder, dirs, names in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith('.egg-info'))
    for name in sorted(names):
      path = os.path.join(folder, name)
      if name.endswith(('.py', '.md')) and os.path.abspath(path) != THIS:
        yield path


def move_modules(root: str, check: bool) -> list[str]:
  """Moves each top-level module of MODULES into waitless/ (git keeps its history as a rename)."""
  moved = []
  for module in MODULES:
    old, new = os.path.join(root, f'{module}.py'), os.path.join(root, 'waitless', f'{module}.py')
    if os.path.exists(old):
      if os.path.exists(new):
        raise SystemExit(f'both {old} and {new} exist: merge them by hand, then rerun')
      if not check:
        os.replace(old, new)
      moved.append(f'{module}.py -> waitless/{module}.py')
  return moved


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--check', action='store_true', help='change nothing; exit 1 if anything needs rewriting')
  parser.add_argument('--root', default=ROOT, help='the repository root')
  args = parser.parse_args(argv)
  changed = move_modules(args.root, args.check)
  manual = []
  for path in files(args.root):
    with open(path, encoding='utf-8') as f:
      text = f.read()
    new = rewrite(path, text)
    rel = os.path.relpath(path, args.root)
    manual += [f'{rel}: {line}' for line in by_hand(new if path.endswith('.py') else '')]
    if new != text:
      changed.append(rel)
      if not args.check:
        with open(path, 'w', encoding='utf-8') as f:
          f.write(new)
  for line in changed:
    print(('needs rewriting: ' if args.check else 'rewrote: ') + line)
  for line in manual:
    print(f'rewrite by hand: {line}', file=sys.stderr)
  if manual:
    return 2
  return 1 if args.check and changed else 0


if __name__ == '__main__':
  sys.exit(main())
