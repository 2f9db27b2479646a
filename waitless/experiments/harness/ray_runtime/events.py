"""The event log of a Ray run, `events.jsonl`: one JSON object per server update, read back for the replay.

Each line: `step` (updates applied, this one included), `time_s` (measured seconds), the update's schedule
(`k`, per learner `contributions`, `staleness`, `refresh_view`, `fetch_current`, `discarded`), `positions`
(each learner's data position at the start of the update) and `pushes`, every arrival during the update as
[learner, version it read, delay, data position, outcome, time_s]. The schedules and positions are all the
float64 replay needs (tests/experiments/harness/ray_runtime/): the data a taken gradient used follows from them.
A resumed run keeps the lines up to its checkpoint's step, as metrics.jsonl does.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from waitless.algorithms import parameter_server as ps
from waitless.experiments.harness import atomic_files
from waitless.experiments.harness.ray_runtime import arrivals as arrivals_lib

EVENTS_FILE = 'events.jsonl'


def to_json(step: int, update: arrivals_lib.Update, pushes) -> dict:
  s = update.schedule
  return {'step': step, 'time_s': update.time_s, 'k': int(s.k), 'contributions': s.contributions.tolist(),
          'staleness': s.staleness.tolist(), 'refresh_view': s.refresh_view.tolist(),
          'fetch_current': s.fetch_current.tolist(), 'discarded': s.discarded.tolist(),
          'positions': np.asarray(update.positions).tolist(),
          'pushes': [[p.learner, p.version, p.delay, p.position, p.outcome, p.time_s] for p in pushes]}


def from_json(line: dict, microbatches: int) -> arrivals_lib.Update:
  contributions = np.asarray(line['contributions'], np.int32)
  schedule = ps.schedule(len(contributions), line['k'], microbatches, contributions, staleness=line['staleness'],
                         refresh_view=line['refresh_view'], fetch_current=line['fetch_current'],
                         discarded=line['discarded'])
  return arrivals_lib.Update(schedule, np.asarray(line['positions'], np.int64), float(line['time_s']))


def read(workdir: str) -> list[dict]:
  """The log's lines (a last line cut short by a kill is dropped)."""
  path = os.path.join(workdir, EVENTS_FILE)
  lines = []
  with open(path) as f:
    for text in f:
      try:
        lines.append(json.loads(text))
      except ValueError:
        break
  return lines


class EventLog:
  """Appends updates to `events.jsonl`; a resumed run first cuts it back to its checkpoint's step."""

  def __init__(self, workdir: str, keep_through_step: Optional[int]):
    path = os.path.join(workdir, EVENTS_FILE)
    kept = []
    if keep_through_step is not None and os.path.exists(path):
      kept = [line for line in read(workdir) if line['step'] <= keep_through_step]
    atomic_files.write_text(path, ''.join(json.dumps(line) + '\n' for line in kept))
    self._file = open(path, 'a')

  def write(self, step: int, update: arrivals_lib.Update, pushes) -> None:
    self._file.write(json.dumps(to_json(step, update, pushes)) + '\n')

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    self._file.close()
