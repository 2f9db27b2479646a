"""Test session setup: 8 host CPU devices (before JAX initialises), quiet TensorFlow."""

import os

os.environ['XLA_FLAGS'] = ' '.join(
    [f for f in os.environ.get('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
    + ['--xla_force_host_platform_device_count=8'])
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# No user-level compilation cache in tests (experiments.main's default): a test that counts compiles, or times a
# cold start, must not find programs a previous test or the user's runs left.
os.environ['WAITLESS_COMPILATION_CACHE_DIR'] = ''
os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')

from absl import flags  # noqa: E402

# absltest helpers (create_tempdir) read absl flags; under pytest nobody parses them.
flags.FLAGS.mark_as_parsed()
