"""Result files are replaced whole: a failure while writing leaves the previous file as it was."""

import json
import os
from unittest import mock

from absl.testing import absltest
import matplotlib
matplotlib.use('Agg')
from matplotlib import pyplot as plt

from waitless.experiments.harness import atomic_files


class AtomicFilesTest(absltest.TestCase):

  def test_json_and_text_are_written_and_read_back(self):
    root = self.create_tempdir().full_path
    atomic_files.write_json(os.path.join(root, 'a.json'), {'x': [1, 2.5]}, indent=2)
    atomic_files.write_text(os.path.join(root, 'b.md'), '# table\n')
    with open(os.path.join(root, 'a.json')) as f:
      self.assertEqual(json.load(f), {'x': [1, 2.5]})
    with open(os.path.join(root, 'b.md')) as f:
      self.assertEqual(f.read(), '# table\n')
    self.assertEqual(sorted(os.listdir(root)), ['a.json', 'b.md'])

  def test_a_failed_write_leaves_the_old_file(self):
    path = os.path.join(self.create_tempdir().full_path, 'summary.json')
    atomic_files.write_json(path, {'steps': 1})
    with mock.patch.object(json, 'dumps', side_effect=RuntimeError('killed')):
      with self.assertRaises(RuntimeError):
        atomic_files.write_json(path, {'steps': 2})
    with open(path) as f:
      self.assertEqual(json.load(f), {'steps': 1})

  def test_a_figure_keeps_its_format_and_a_failed_save_leaves_the_old_one(self):
    path = os.path.join(self.create_tempdir().full_path, 'comparison.png')
    fig = plt.figure()
    atomic_files.save_figure(fig, path, dpi=20)
    with open(path, 'rb') as f:
      first = f.read()
    self.assertTrue(first.startswith(b'\x89PNG'))
    with mock.patch.object(fig, 'savefig', side_effect=RuntimeError('killed')):
      with self.assertRaises(RuntimeError):
        atomic_files.save_figure(fig, path)
    with open(path, 'rb') as f:
      self.assertEqual(f.read(), first)
    plt.close(fig)


if __name__ == '__main__':
  absltest.main()
