"""Where measurements go: `metrics.jsonl` (one JSON object per logged step) and TensorBoard event files.

Only process 0 writes. On resume the log is cut back to the restored step, so the file of a resumed run has
exactly the rows of an uninterrupted one. A damaged line is skipped, never the end of the log: the rows after it
are kept, and rows the log lacks are named (`log_gaps`), by the resumed run and by a comparison that reads it.

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
from typing import Any, Iterator, NamedTuple, Optional

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


def _same(a, b) -> bool:
  """Two figures of one run written by one process, one through metrics.jsonl and one through summary.json."""
  a, b = (None if x is None or not math.isfinite(float(x)) else float(x) for x in (a, b))  # NaN: null in a row
  if a is None or b is None:
    return a is None and b is None
  return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)


def check_finished_log(workdir: str, rows: list[dict[str, Any]], summary: dict[str, Any],
                       cadence: Optional[tuple[int, int]] = None, target_accuracy: Optional[float] = None) -> None:
  """Raises CutLog (one line naming the file) unless the rows of a finished run are those its `summary` says:
  ending at its last step with its final evaluation and time; with `cadence` = (log_every, eval_every), every
  row the run writes is there, once, in order (`log_gaps`); with `target_accuracy` (the run's config's), the
  first evaluation at the target is at summary.json's `time_to_target`."""
  path = os.path.join(workdir, METRICS_FILE)
  steps = summary.get('steps')
  if not rows:
    raise CutLog(f'{path} is missing or empty although its run finished (summary.json: {steps} steps): {_RETRAIN}')
  if steps is not None and rows[-1].get('step') != steps:
    raise CutLog(f'{path} ends at step {rows[-1].get("step")} but summary.json says the run finished at step '
                 f'{steps}: {_RETRAIN}')
  if cadence is not None and steps is not None:
    gaps = log_gaps([r['step'] for r in rows], steps, cadence[0], cadence[1], steps)
    if gaps is not None:
      raise CutLog(f'{path} has {gaps} (it logs every {cadence[0]} steps and evaluates every {cadence[1]}): its '
                   f'figures would come from a log with a gap; {_RETRAIN}')
  evals = [r for r in rows if r.get('eval_accuracy') is not None]
  final = summary.get('final_eval_accuracy')
  if final is not None and (not evals or evals[-1]['eval_accuracy'] != final):
    last = f'{evals[-1]["eval_accuracy"]} at step {evals[-1]["step"]}' if evals else 'none'
    raise CutLog(f'{path} disagrees with summary.json: its last eval accuracy is {last}, summary.json says '
                 f'{final}: {_RETRAIN}')
  for field, logged in (('final_eval_loss', evals[-1].get('eval_loss') if evals else None),
                        ('time', time_of(rows[-1]))):
    said = time_of(summary) if field == 'time' else summary.get(field)
    if said is not None and not _same(logged, said):
      name = 'its time' if field == 'time' else field
      raise CutLog(f'{path} disagrees with summary.json: {name} is {logged} in its last row, summary.json says '
                   f'{said}: {_RETRAIN}')
  if target_accuracy is not None and 'time_to_target' in summary:
    hit = next((time_of(r) for r in evals if r['eval_accuracy'] >= target_accuracy), None)
    if not _same(hit, summary['time_to_target']):
      raise CutLog(f'{path} disagrees with summary.json: its first evaluation at accuracy >= {target_accuracy} is '
                   f'at time {hit}, summary.json says time_to_target {summary["time_to_target"]}: {_RETRAIN}')


class Log(NamedTuple):
  """A metrics.jsonl as read: its rows, and the numbers of the lines that are not rows (not a JSON object with an
  integer `step`). `cut_end`: the last of them is the file's last line and lacks its newline, as a kill leaves
  the line it was writing."""
  rows: list[dict[str, Any]]
  damaged: list[int]
  cut_end: bool = False


def _row(line: str) -> Optional[dict[str, Any]]:
  try:
    row = json.loads(line)
  except ValueError:
    return None
  if not isinstance(row, dict) or not isinstance(row.get('step'), int) or isinstance(row['step'], bool):
    return None
  return row


def read_log(workdir: str) -> Log:
  """Every row of `workdir`'s metrics.jsonl, a damaged line anywhere skipped (and named in `damaged`): the rows
  after it are as valid as those before."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return Log([], [])
  rows, damaged, cut_end = [], [], False
  with open(path, errors='replace') as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      row = _row(line)
      if row is None:
        damaged.append(number)
        cut_end = not line.endswith('\n')
      else:
        rows.append(row)
        cut_end = False
  return Log(rows, damaged, cut_end)


def read_rows(workdir: str, complete: bool = False) -> list[dict[str, Any]]:
  """The rows of `workdir`'s metrics.jsonl; a damaged line (a kill cut the last one, or the file was damaged) is
  skipped, the rows after it kept. `complete=True` (a finished run, whose log must be whole) raises CutLog at the
  first damaged line instead."""
  log = read_log(workdir)
  if complete and log.damaged:
    path = os.path.join(workdir, METRICS_FILE)
    raise CutLog(f'{path} is cut at line {log.damaged[0]} although its run finished: its figures would be '
                 f'incomplete; {_RETRAIN}')
  return log.rows


def logged_steps(through: int, log_every: int, eval_every: int, num_steps: int) -> Iterator[int]:
  """The steps of the rows a run writes up to step `through`, in order: every multiple of `log_every` and of
  `eval_every`, and `num_steps` (both runtimes log there: the lock-step loop's blocks never cross those
  boundaries, the Ray driver logs update by update)."""
  step = next_logged_step(0, log_every, eval_every, num_steps)
  while step is not None and step <= through:
    yield step
    step = next_logged_step(step, log_every, eval_every, num_steps)


def next_logged_step(after: int, log_every: int, eval_every: int, num_steps: int) -> Optional[int]:
  """The step of the row a run writes after the one at step `after` (None: `after` is its last)."""
  following = min((after // log_every + 1) * log_every, (after // eval_every + 1) * eval_every, num_steps)
  return following if following > after else None


def _ranges(steps: list[int], noun: str) -> str:
  shown = []
  for first, last, count in steps[:3]:
    shown.append(f'{first}' if count == 1 else f'{first}-{last} ({count} rows)')
  more = f' and {len(steps) - 3} more ranges' if len(steps) > 3 else ''
  return f'{noun} {", ".join(shown)}{more}'


def log_gaps(steps: list[int], through: int, log_every: int, eval_every: int, num_steps: int) -> Optional[str]:
  """None when `steps` (a log's, in file order) are exactly the steps the run logs up to `through`
  (`logged_steps`); else what is wrong, in a few words: the missing steps (as ranges of the rows the run writes),
  a step logged twice or out of order, a step the run never logs."""
  for a, b in zip(steps, steps[1:]):
    if b <= a:
      return f'step {b} follows step {a}'
  present = set(steps)
  missing, run = [], None  # [first, last, count] runs of consecutive missing rows
  expected = 0
  for step in logged_steps(through, log_every, eval_every, num_steps):
    expected += 1
    if step in present:
      run = None
      continue
    if run is None:
      run = [step, step, 0]
      missing.append(run)
    run[1], run[2] = step, run[2] + 1
  if missing:
    return _ranges(missing, 'no rows for steps')
  if len(present) != expected:
    extra = sorted(present - set(logged_steps(through, log_every, eval_every, num_steps)))
    return f'rows at steps the run does not log ({", ".join(map(str, extra[:3]))}{"..." if len(extra) > 3 else ""})'
  return None


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
               time_field: str = TIME_FIELDS[0], cadence: Optional[tuple[int, int, int]] = None):
    """Starts a fresh log, or keeps the rows with step <= `keep_through_step` of an earlier one; `time_field`:
    the rows' time (`TIME_FIELDS`), the name of the second TensorBoard run.

    A resumed log keeps every valid row up to its step: a damaged line is skipped, and with `cadence` =
    (log_every, eval_every, num_steps) the rows kept are checked against those the run writes (`log_gaps`).
    What is wrong is in `problems` (one line each, for the run to say), and `gaps` stays set while the log
    misses rows."""
    self._enabled = enabled
    self.problems: list[str] = []
    self.gaps: Optional[str] = None
    self._cadence = cadence
    if not enabled:
      return
    path = os.path.join(workdir, METRICS_FILE)
    kept = []
    if keep_through_step is not None:
      log = read_log(workdir)
      kept = [r for r in log.rows if r['step'] <= keep_through_step]
      damaged = log.damaged[:-1] if log.cut_end else log.damaged  # the line a kill cut: newer than any checkpoint
      if damaged:
        lines = ', '.join(map(str, damaged[:5])) + (f' and {len(damaged) - 5} more' if len(damaged) > 5 else '')
        self.problems.append(f'{path}: line(s) {lines} are not metrics rows (damaged): skipped, the rows around '
                             'them kept')
      if cadence is not None:
        self.gaps = log_gaps([r['step'] for r in kept], keep_through_step, *cadence)
        if self.gaps is not None:
          self.problems.append(f'{path} has {self.gaps} up to the checkpoint at step {keep_through_step} the run '
                               'resumes from: those rows are lost, and a comparison refuses this run (remove the '
                               'workdir to train it again with a whole log)')
    self._last_step = keep_through_step or 0
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
    if self._cadence is not None and self.gaps is None:  # the row the run writes next, else a gap from here
      expected = next_logged_step(self._last_step, *self._cadence)
      if expected != row['step']:
        self.gaps = f'no row for step {expected} (the next row is at step {row["step"]})'
    self._last_step = row['step']
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
