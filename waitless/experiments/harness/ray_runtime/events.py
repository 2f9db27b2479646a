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
  """The log's lines; a damaged one (a last line cut short by a kill, or one damaged on disk) is skipped, the
  lines after it kept."""
  return _read(workdir)[0]


def _read(workdir: str) -> tuple[list[dict], list[int], bool]:
  """(lines, numbers of the damaged lines, whether the last damaged one is the file's unterminated last line)."""
  path = os.path.join(workdir, EVENTS_FILE)
  lines, damaged, cut_end = [], [], False
  with open(path, errors='replace') as f:
    for number, text in enumerate(f, 1):
      if not text.strip():
        continue
      try:
        line = json.loads(text)
      except ValueError:
        line = None
      if not isinstance(line, dict) or not isinstance(line.get('step'), int):
        damaged.append(number)
        cut_end = not text.endswith('\n')
        continue
      lines.append(line)
      cut_end = False
  return lines, damaged, cut_end


class EventLog:
  """Appends updates to `events.jsonl`; a resumed run first cuts it back to its checkpoint's step."""

  def __init__(self, workdir: str, keep_through_step: Optional[int]):
    """Starts a fresh log, or keeps every valid line up to `keep_through_step`: what is wrong with them (damaged
    lines, updates missing, one line each) is in `problems` for the run to say; the replay needs every update."""
    path = os.path.join(workdir, EVENTS_FILE)
    kept = []
    self.problems: list[str] = []
    if keep_through_step is not None:
      lines, damaged, cut_end = _read(workdir) if os.path.exists(path) else ([], [], False)
      kept = [line for line in lines if line['step'] <= keep_through_step]
      damaged = damaged[:-1] if cut_end else damaged  # the line a kill cut: newer than any checkpoint
      if damaged:
        self.problems.append(f'{path}: line(s) {", ".join(map(str, damaged[:5]))}'
                             f'{" and more" if len(damaged) > 5 else ""} are not events (damaged): skipped')
      steps = [line['step'] for line in kept]
      if steps != list(range(1, keep_through_step + 1)):
        missing = sorted(set(range(1, keep_through_step + 1)) - set(steps))
        what = (f'lacks the updates of steps {missing[0]}..{missing[-1]} ({len(missing)} of them)' if missing
                else 'holds an update twice or out of order')
        self.problems.append(f'{path} {what} up to the checkpoint at step {keep_through_step}: the run goes on, but '
                             'its replay cannot reproduce the parameters')
    atomic_files.write_text(path, ''.join(json.dumps(line) + '\n' for line in kept))
    self._file = open(path, 'a')

  def write(self, step: int, update: arrivals_lib.Update, pushes) -> None:
    self._file.write(json.dumps(to_json(step, update, pushes)) + '\n')

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    self._file.close()
