"""Where measurements go: `metrics.jsonl` (one JSON object per logged step) and TensorBoard event files.

Only process 0 writes. On resume the log is cut back to the restored step, so the file of a resumed run has
exactly the rows of an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

METRICS_FILE = 'metrics.jsonl'


def read_rows(workdir: str) -> list[dict[str, Any]]:
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError:
          break  # a line cut by a kill: everything after it is newer than any checkpoint
  return rows


def _json_safe(value):
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


class MetricsWriter:
  """Appends rows to metrics.jsonl and scalars to TensorBoard."""

  def __init__(self, workdir: str, keep_through_step: int | None, enabled: bool = True):
    """Starts a fresh log, or keeps the rows with step <= `keep_through_step` of an earlier one."""
    self._enabled = enabled
    if not enabled:
      return
    path = os.path.join(workdir, METRICS_FILE)
    kept = [] if keep_through_step is None else [r for r in read_rows(workdir) if r['step'] <= keep_through_step]
    with open(path + '.tmp', 'w') as f:
      for row in kept:
        f.write(json.dumps(row) + '\n')
    os.replace(path + '.tmp', path)
    self._file = open(path, 'a')
    self._events = EventFileWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, row: dict[str, Any]) -> None:
    if not self._enabled:
      return
    row = {k: _json_safe(v) for k, v in row.items()}
    self._file.write(json.dumps(row) + '\n')
    self._file.flush()
    values = [summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in row.items()
              if k != 'step' and isinstance(v, (int, float)) and not isinstance(v, bool)]
    self._events.add_event(event_pb2.Event(wall_time=time.time(), step=int(row['step']),
                                           summary=summary_pb2.Summary(value=values)))

  def close(self) -> None:
    if self._enabled:
      self._file.close()
      self._events.close()
