"""Where measurements go: `metrics.jsonl` (one JSON object per logged step) and TensorBoard event files.

Only process 0 writes. On resume the log is cut back to the restored step, so the file of a resumed run has
exactly the rows of an uninterrupted one.

The event files are written here, without TensorFlow (tensorboard's own `EventFileWriter` imports TensorFlow on
first use, and tensorboardX imports torch, comet_ml and PIL whenever they are installed). An event file is a
sequence of TFRecords, each
`uint64 length | uint32 masked_crc32c(length) | Event proto | uint32 masked_crc32c(proto)` (little-endian),
the first Event declaring `file_version='brain.Event:2'`; the Event and Summary messages are tensorboard's
(`tensorboard.compat.proto`, plain protobuf). Rows are written twice: in `tensorboard/` with the iteration as
the step, and in a second TensorBoard run named after the row's time field (`tensorboard/sim_time/`, or
`tensorboard/measured_time/` for a measured run) with the run's millisecond as the step, so that a loss can be
plotted against the run's time.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
from typing import Any, Iterator

import google_crc32c
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2

from waitless.experiments.harness import atomic_files

METRICS_FILE = 'metrics.jsonl'
TENSORBOARD_DIR = 'tensorboard'
# A row's time, one field named after the clock that produced it: the simulated cluster's or the measured one.
TIME_FIELDS = ('sim_time', 'measured_time')


def time_of(record: dict[str, Any]) -> float | None:
  """A metrics row's or summary's time, whichever clock produced it (None if it has none)."""
  for field in TIME_FIELDS:
    if record.get(field) is not None:
      return float(record[field])
  return None


def milliseconds(row: dict[str, Any]) -> int:
  """A metrics row's time in whole milliseconds: its step in the TensorBoard run of its time field."""
  return int(round(time_of(row) * 1000.0))


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli) of `data`, from Google's C library."""
  return google_crc32c.value(data)


def masked_crc32c(data: bytes) -> int:
  """TFRecord's checksum: crc32c rotated right by 15 bits plus a constant."""
  crc = crc32c(data)
  return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _record(data: bytes) -> bytes:
  header = struct.pack('<Q', len(data))
  return header + struct.pack('<I', masked_crc32c(header)) + data + struct.pack('<I', masked_crc32c(data))


def read_records(path: str) -> Iterator[bytes]:
  """The payloads of a TFRecord file, checksums verified; stops at a record cut short by a kill."""
  with open(path, 'rb') as f:
    while True:
      header = f.read(12)
      if len(header) < 12:
        return
      (length,), (header_crc,) = struct.unpack('<Q', header[:8]), struct.unpack('<I', header[8:])
      if header_crc != masked_crc32c(header[:8]):
        raise ValueError(f'{path}: corrupt record header')
      data, footer = f.read(length), f.read(4)
      if len(data) < length or len(footer) < 4:
        return
      if struct.unpack('<I', footer)[0] != masked_crc32c(data):
        raise ValueError(f'{path}: corrupt record')
      yield data


class EventFileWriter:
  """Appends TensorBoard `Event`s to a new `events.out.tfevents.*` file in `logdir` (what TensorBoard reads)."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    seconds, nanoseconds = divmod(time.time_ns(), 10**9)  # names sort by creation time: TensorBoard's read order
    self.path = os.path.join(logdir, f'events.out.tfevents.{seconds:010d}.{socket.gethostname()}.'
                                     f'{nanoseconds:09d}.{os.getpid()}')
    self._file = open(self.path, 'wb')
    self.add_event(event_pb2.Event(wall_time=time.time(), file_version='brain.Event:2'), flush=True)

  def add_event(self, event: event_pb2.Event, flush: bool = False) -> None:
    self._file.write(_record(event.SerializeToString()))
    if flush:
      self.flush()

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    self._file.close()


class CutLog(ValueError):
  """A finished run's metrics.jsonl is cut (a line that is not JSON), missing, or disagrees with its summary.json:
  its figures cannot be read, and counting it as a run that missed its target would change the verdicts."""


_RETRAIN = "remove that run's workdir and rerun the comparison to train it again"


def check_finished_log(workdir: str, rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
  """Raises CutLog (one line naming the file) unless the rows of a finished run end where its `summary` says:
  at its last step, with its final evaluation."""
  path = os.path.join(workdir, METRICS_FILE)
  steps = summary.get('steps')
  if not rows:
    raise CutLog(f'{path} is missing or empty although its run finished (summary.json: {steps} steps): {_RETRAIN}')
  if steps is not None and rows[-1].get('step') != steps:
    raise CutLog(f'{path} ends at step {rows[-1].get("step")} but summary.json says the run finished at step '
                 f'{steps}: {_RETRAIN}')
  evals = [r for r in rows if r.get('eval_accuracy') is not None]
  final = summary.get('final_eval_accuracy')
  if final is not None and (not evals or evals[-1]['eval_accuracy'] != final):
    last = f'{evals[-1]["eval_accuracy"]} at step {evals[-1]["step"]}' if evals else 'none'
    raise CutLog(f'{path} disagrees with summary.json: its last eval accuracy is {last}, summary.json says '
                 f'{final}: {_RETRAIN}')


def read_rows(workdir: str, complete: bool = False) -> list[dict[str, Any]]:
  """The rows of `workdir`'s metrics.jsonl. A line cut by a kill ends the log (everything after it is newer than
  any checkpoint, and a resume cuts it away); `complete=True` (a finished run, whose log must be whole) raises
  CutLog there instead."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      line = line.strip()
      if line:
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as e:
          if complete:
            raise CutLog(f'{path} is cut at line {number} although its run finished: its figures would be '
                         f'incomplete; {_RETRAIN}') from e
          break
  return rows


def _json_safe(value):
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


class MetricsWriter:
  """Appends rows to metrics.jsonl and scalars to TensorBoard.

  Rows reach the files at least every `FLUSH_EVERY_S` seconds, at `flush` and at `close`, not one by one. A
  crash loses nothing that a resume keeps, as long as the rows are flushed before each checkpoint
  (`recorder.RunRecorder.checkpoint` does): a resume keeps only the rows up to its checkpoint's step.
  """

  FLUSH_EVERY_S = 1.0

  def __init__(self, workdir: str, keep_through_step: int | None, enabled: bool = True,
               time_field: str = TIME_FIELDS[0]):
    """Starts a fresh log, or keeps the rows with step <= `keep_through_step` of an earlier one; `time_field`:
    the rows' time (`TIME_FIELDS`), the name of the second TensorBoard run."""
    self._enabled = enabled
    if not enabled:
      return
    path = os.path.join(workdir, METRICS_FILE)
    kept = [] if keep_through_step is None else [r for r in read_rows(workdir) if r['step'] <= keep_through_step]
    atomic_files.write_text(path, ''.join(json.dumps(row) + '\n' for row in kept))
    self._file = open(path, 'a')
    self._flushed = time.monotonic()
    self._events = EventFileWriter(os.path.join(workdir, TENSORBOARD_DIR))
    # The same scalars against the run's time: a second TensorBoard run whose step is its millisecond.
    self._sim_events = EventFileWriter(os.path.join(workdir, TENSORBOARD_DIR, time_field))
    if keep_through_step is not None:  # TensorBoard drops the earlier files' events from this step on
      restart = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
      self._events.add_event(event_pb2.Event(wall_time=time.time(), step=keep_through_step + 1, session_log=restart))
      if kept:
        self._sim_events.add_event(event_pb2.Event(wall_time=time.time(), step=milliseconds(kept[-1]) + 1,
                                                   session_log=restart))

  def write(self, row: dict[str, Any]) -> None:
    if not self._enabled:
      return
    row = {k: _json_safe(v) for k, v in row.items()}
    self._file.write(json.dumps(row) + '\n')
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=k, simple_value=float(v))
                                         for k, v in row.items()
                                         if k != 'step' and isinstance(v, (int, float)) and not isinstance(v, bool)])
    now = time.time()
    self._events.add_event(event_pb2.Event(wall_time=now, step=int(row['step']), summary=summary))
    if time_of(row) is not None:
      self._sim_events.add_event(event_pb2.Event(wall_time=now, step=milliseconds(row), summary=summary))
    if time.monotonic() - self._flushed >= self.FLUSH_EVERY_S:
      self.flush()

  def flush(self) -> None:
    """Every row written so far into the files (the operating system's: a killed process loses none of them)."""
    if self._enabled:
      for f in (self._file, self._events, self._sim_events):
        f.flush()
      self._flushed = time.monotonic()

  def close(self) -> None:
    if self._enabled:
      self._file.close()
      self._events.close()
      self._sim_events.close()
