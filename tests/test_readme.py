"""The README and the docs: their library examples run and do what they say, their commands and links resolve.

The configs of the commands are checked by tests/test_docs_commands.py; here: the python blocks marked as
examples execute, every `bash launch/...` script, `python -m ...` program and `python benchmarks/...` file
exists, every table named to `launch/reproduce.sh` is one it knows, every relative link and figure resolves
inside the repository (a heading for a `#anchor`), and no link leaves the repository.
"""

import contextlib
import glob
import importlib.util
import io
import os
import re

from absl.testing import absltest
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, 'README.md')
LIBRARY = os.path.join(ROOT, 'docs', 'library.md')
DOCS = [README] + sorted(glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True))
_LINK_RE = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def _run_example(path: str, marker: str) -> dict:
  """Executes the python block after `<!-- marker -->` in `path`; returns its namespace."""
  match = re.search(rf'<!-- {marker} -->\s*```python\n(.*?)```', _read(path), re.S)
  assert match is not None, f'{path} lost its example <!-- {marker} -->'
  namespace = {}
  with contextlib.redirect_stdout(io.StringIO()):
    exec(compile(match.group(1), path, 'exec'), namespace)
  return namespace


def _slug(heading: str) -> str:
  """GitHub's anchor of a markdown heading."""
  return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


def _reproduce_tables() -> set[str]:
  script = _read(os.path.join(ROOT, 'launch', 'reproduce.sh'))
  default = re.search(r'\|\| TABLES=\(([^)]*)\)', script).group(1)
  return set(default.split())


class ReadmeTest(absltest.TestCase):

  def test_library_example(self):
    namespace = _run_example(README, 'library-example')
    w = np.asarray(namespace['w'])
    self.assertEqual(w.shape, (namespace['n'], 3))
    np.testing.assert_allclose(w, np.broadcast_to(w[0], w.shape), rtol=1e-6)  # averaged after step 8
    self.assertGreater(np.abs(w[0]).sum(), 0.1)

  def test_library_guide_example(self):
    namespace = _run_example(LIBRARY, 'library-guide-example')
    w = np.asarray(namespace['w'])
    self.assertEqual(w.shape, (namespace['n'], 3))
    np.testing.assert_allclose(w, np.broadcast_to(w[0], w.shape), rtol=1e-6)  # the last step was an outer step
    np.testing.assert_allclose(w[0], [1.0, -2.0, 0.5], atol=0.1)  # and it learned the problem

  def test_library_matcha_example(self):
    namespace = _run_example(LIBRARY, 'library-matcha-example')
    np.testing.assert_allclose(np.asarray(namespace['w']).mean(axis=0), [1.0, -2.0, 0.5], atol=0.05)

  def test_library_measured_step_example(self):
    namespace = _run_example(LIBRARY, 'library-measured-step-example')
    self.assertEqual(np.asarray(namespace['params']).shape, (4, 3))
    self.assertLess(float(namespace['mean_loss']), 1e-2)
    counts = np.asarray(namespace['step'].last_counts)
    self.assertTrue(((counts >= 1) & (counts <= 4)).all(), counts)

  def test_readme_is_the_first_screen(self):
    text = _read(README)
    self.assertLessEqual(len(text.splitlines()), 250)
    self.assertLess(text.index('<!-- library-example -->'), text.index('## What the quickstart shows'))
    for command in ('bash launch/quickstart.sh', 'bash launch/test.sh', 'bash launch/test.sh --all'):
      self.assertIn(command, text)

  def test_commands_exist(self):
    tables = _reproduce_tables()
    for path in DOCS:
      text = _read(path)
      name = os.path.relpath(path, ROOT)
      for script in re.findall(r'bash (launch/\S+\.sh)', text):
        self.assertTrue(os.path.exists(os.path.join(ROOT, script)), f'{name}: {script}')
      for script in re.findall(r'python ((?:benchmarks|examples)/[a-z0-9_]+\.py)', text):
        self.assertTrue(os.path.exists(os.path.join(ROOT, script)), f'{name}: {script}')
      for modules in re.findall(r'python -m ([\w.|]+)', text):
        first, *others = modules.split('|')
        for module in [first] + [first.rsplit('.', 1)[0] + '.' + other for other in others]:
          if module.startswith('benchmarks.'):
            self.assertTrue(os.path.exists(os.path.join(ROOT, *module.split('.')) + '.py'), f'{name}: {module}')
          elif module.startswith('waitless.'):
            self.assertIsNotNone(importlib.util.find_spec(module), f'{name}: {module}')
      for span in re.findall(r'`([^`]+)`', text):
        words = span.split()
        if words[:2] == ['bash', 'launch/reproduce.sh']:
          named = [w for w in words[3:] if re.fullmatch(r'[a-z0-9_]+', w)]
          self.assertContainsSubset(named, tables, f'{name}: {span}')

  def test_links_resolve_inside_the_repository(self):
    for path in DOCS:
      name = os.path.relpath(path, ROOT)
      for target in _LINK_RE.findall(_read(path)):
        self.assertNotRegex(target, r'^[a-z]+:', f'{name}: a link outside the repository: {target}')
        file, _, anchor = target.partition('#')
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        self.assertTrue(resolved.startswith(ROOT + os.sep), f'{name}: {target} leaves the repository')
        self.assertTrue(os.path.exists(resolved), f'{name}: {target} does not exist')
        if anchor:
          headings = re.findall(r'^#+ (.*)$', _read(resolved), re.M)
          self.assertIn(anchor, [_slug(h) for h in headings], f'{name}: {target}: no such heading')

  def test_every_page_is_linked(self):
    linked = set()
    for path in DOCS:
      for target in _LINK_RE.findall(_read(path)):
        linked.add(os.path.normpath(os.path.join(os.path.dirname(path), target.partition('#')[0])))
    for path in DOCS[1:]:
      self.assertIn(path, linked, f'{os.path.relpath(path, ROOT)} is linked from no page')


if __name__ == '__main__':
  absltest.main()
