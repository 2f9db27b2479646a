"""The schedule record shared by the algorithms whose every worker contributes every micro-batch.

A schedule is what the time rule hands the update for one iteration (`cluster/rules/base.py`): a NamedTuple
of per-worker arrays with a comment on each field and `UNIFORM`, the fields that hold one value for every
worker. An algorithm with fields of its own declares its schedule in its module (`ServerSchedule` in
`parameter_server`, `WagmaSchedule` in `wagma`, ...).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class EveryoneSchedule(NamedTuple):
  """Schedule of a rule in which every worker contributes all of its micro-batches (sync, local SGD, D-PSGD)."""
  microbatches_done: np.ndarray  # int32 (P,), = microbatches for every worker
  UNIFORM = ()
