"""One host's compute, measured where it runs (`measure.host_compute_rows` starts one per host of the test bed).

  python -m waitless.experiments.harness.host_compute --config=experiments/configs/digits.py:sync \
      --rounds=3 --out=FILE.json

`measure.sustained_fits` of the config's model in this process (one worker's batch, its micro-batch call back to
back for `--window_s`, per round: the compute's sustained seconds per sample): on the bed the process lies in its
host's cgroup, so the figure is that host's at its own quota (a median call time would depend on where calls fall
in the quota's period, 10 ms on the bed; the rate over many periods does not). A quota need not slow compute in
proportion to the cores it grants (the hosts share the machine's caches and memory; runs found a host at 0.4 core
2.0-2.4x slower than one at 0.8): the slow host's factor is measured, not assumed.
Writes {"fits": [[seconds_per_sample, 0], ...] one per round, "size": samples per call}.
"""

from __future__ import annotations

import json

from absl import app
from absl import flags

from waitless.experiments import config_paths
from waitless.experiments.harness import atomic_files
from waitless.experiments.harness import measure

_CONFIG = config_paths.config_flag()
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Rounds of the fit.')
_WINDOW = flags.DEFINE_float('window_s', 2.0, 'Seconds of back-to-back calls per round.')
_OUT = flags.DEFINE_string('out', None, 'The JSON file to write.')


def main(argv):
  del argv
  fits = measure.sustained_fits(_CONFIG.value, _ROUNDS.value, _WINDOW.value)
  atomic_files.write_text(_OUT.value, json.dumps({'fits': fits.tolist(), 'size': _CONFIG.value.batch_size}))


if __name__ == '__main__':
  flags.mark_flag_as_required('out')
  app.run(main, flags_parser=lambda argv: config_paths.parse_flags(argv, _CONFIG))
