"""Verdicts across clusters: the rows whose verdict changes with the profile are marked, the others not."""

import json
import os

from absl.testing import absltest

from waitless.experiments.comparison import across_clusters


def _write(root: str, profile: str | None, verdicts: dict[str, str | None]) -> str:
  directory = os.path.join(root, profile or 'none')
  os.makedirs(os.path.join(directory, 'wagma'))
  # experiments.compare's titles, with a profile and without
  cluster = f'cluster profile {profile}' if profile else 'no cluster profile (configured times, ideal network)'
  report = {'title': f'digits.py: 16 workers, 300 steps per run, {cluster}', 'baseline': 'sync',
            'algorithms': [{'entry': entry, 'verdict': verdict, 'speedup': 1.5 if verdict == 'faster' else 0.9,
                            'beats_baseline': {'time_to_target_accuracy': {}}}
                           for entry, verdict in verdicts.items()]}
  with open(os.path.join(directory, 'wagma', 'comparison.json'), 'w') as f:
    json.dump(report, f)
  return directory


class AcrossClustersTest(absltest.TestCase):

  def test_a_verdict_that_changes_is_marked(self):
    root = self.create_tempdir().full_path
    fast = _write(root, 'dgx_h100', {'sync': None, 'wagma': 'tied', 'local_sgd': 'faster'})
    slow = _write(root, 'commodity_10gbe', {'sync': None, 'wagma': 'faster', 'local_sgd': 'faster'})
    text = across_clusters.markdown([fast, slow])
    self.assertIn('| table | entry | dgx_h100 | commodity_10gbe | depends on the cluster |', text)
    self.assertIn('| wagma (vs sync) | wagma | tied (0.90x) | faster (1.50x) | **yes** |', text)
    self.assertIn('| wagma (vs sync) | local_sgd | faster (1.50x) | faster (1.50x) |  |', text)
    self.assertIn('| wagma (vs sync) | sync | baseline | baseline |  |', text)

  def test_the_tables_without_a_profile_are_named_so(self):
    root = self.create_tempdir().full_path
    configured = _write(root, None, {'sync': None, 'wagma': 'faster'})
    fast = _write(root, 'dgx_h100', {'sync': None, 'wagma': 'tied'})
    text = across_clusters.markdown([configured, fast])
    self.assertIn('| table | entry | no profile | dgx_h100 | depends on the cluster |', text)
    self.assertIn('| wagma (vs sync) | wagma | faster (1.50x) | tied (0.90x) | **yes** |', text)

  def test_too_few_directories_is_one_line_and_exit_2(self):
    self.assertEqual(across_clusters.main(['only_one']), 2)


if __name__ == '__main__':
  absltest.main()
