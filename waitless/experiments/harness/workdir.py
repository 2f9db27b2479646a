"""The workdir check: a workdir holds one run's config, and a resumed run must bring the same one."""

from __future__ import annotations

import json
import os

# Fields that may differ when a run is resumed: they do not change the trajectory.
RESUMABLE_CHANGES = frozenset({'progress_every_s', 'checkpoint_every_s', 'devices', 'eval_batch_size', 'bleu'})


class WorkdirConflict(ValueError):
  """The workdir holds a run with another config."""


def check_workdir(workdir: str, config) -> None:
  """Raises WorkdirConflict (one line naming the fields) if `workdir` holds a run of another config, or a
  config.json that does not read back; a workdir without one (new, or killed before it was written) is free."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    return
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise WorkdirConflict(f'workdir {workdir} holds an unreadable config.json ({type(e).__name__}); remove that '
                          'workdir or use a new --workdir') from e
  if not isinstance(saved, dict):
    raise WorkdirConflict(f'workdir {workdir} holds a config.json that is not a config; remove that workdir or '
                          'use a new --workdir')
  current = json.loads(config.to_json_best_effort())
  differ = sorted(k for k in set(saved) | set(current)
                  if k not in RESUMABLE_CHANGES and saved.get(k) != current.get(k))
  if differ:
    raise WorkdirConflict(f'workdir {workdir} holds a run with a different config (fields: {", ".join(differ)}); '
                          'use a new --workdir or the same config to resume')


