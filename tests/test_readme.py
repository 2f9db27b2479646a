"""The README's library example runs as written and does what it says."""

import contextlib
import io
import os
import re

from absl.testing import absltest
import numpy as np

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'README.md')


class ReadmeTest(absltest.TestCase):

  def test_library_example(self):
    text = open(README).read()
    match = re.search(r'<!-- library-example -->\s*```python\n(.*?)```', text, re.S)
    self.assertIsNotNone(match, 'README lost its library example')
    namespace = {}
    with contextlib.redirect_stdout(io.StringIO()):
      exec(compile(match.group(1), 'README.md', 'exec'), namespace)  # pylint: disable=exec-used
    w = np.asarray(namespace['w'])
    self.assertEqual(w.shape, (namespace['n'], 3))
    np.testing.assert_allclose(w, np.broadcast_to(w[0], w.shape), rtol=1e-6)  # averaged after step 8
    self.assertGreater(np.abs(w[0]).sum(), 0.1)

  def test_commands_exist(self):
    text = open(README).read()
    root = os.path.dirname(README)
    for script in re.findall(r'bash (launch/\S+\.sh)', text):
      self.assertTrue(os.path.exists(os.path.join(root, script)), script)


if __name__ == '__main__':
  absltest.main()
