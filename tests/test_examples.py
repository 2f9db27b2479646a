"""Every script in examples/ runs as a user runs it, on 8 host CPU devices, and checks what it claims.

Each example asserts its own property against a plain reference (synchronous SGD on the mean gradient, local SGD
as DiLoCo with outer rate 1, one call per round against one per step, the D-PSGD mean and WAGMA's groups, the
server model of a K-of-P schedule) and prints one line; here it runs in a fresh interpreter from an empty
directory, with the checkout on PYTHONPATH as `launch/setup_env.sh` puts it.
"""

import glob
import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, 'examples', '*.py')))


class ExamplesTest(parameterized.TestCase):

  def test_one_per_family(self):
    names = {os.path.basename(p)[:-3] for p in EXAMPLES}
    self.assertEqual(names, {'sync_like', 'local_sgd_diloco', 'dasgd_overlap', 'partner_exchange',
                             'parameter_server'})

  @parameterized.named_parameters((os.path.basename(p)[:-3], p) for p in EXAMPLES)
  def test_runs(self, path):
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS='--xla_force_host_platform_device_count=8',
               TF_CPP_MIN_LOG_LEVEL='2')
    result = subprocess.run([sys.executable, path], cwd=self.create_tempdir().full_path, env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    self.assertLen(result.stdout.strip().splitlines(), 1, result.stdout)


if __name__ == '__main__':
  absltest.main()
