"""What a run leaves in its workdir, written the same way by both runtimes: the run recorder.

A `RunRecorder` owns one run's files: config.json, metrics.jsonl and TensorBoard rows (`metrics_io`), the metrics
window those rows reduce (`window.Window`), orbax checkpoints (`checkpointing`) and summary.json. The lock-step
loop (`loop.py`) and the Ray driver (`ray_runtime/driver.py`) differ only in how updates arrive and how time is
read; each hands the recorder its measurements, and the recorder

- resumes: every valid row up to the restored step is kept (a damaged line is skipped and named), rows the log
  lacks up to that step are named in one line, and again when the run finishes; the window, first time at the
  target and last evaluation come back from the checkpoint's meta;
- stops a run whose training loss is not finite (`TrainingDiverged`, naming the step and the checkpoint kept);
- writes a row every `log_every` steps and at each evaluation, with ONE time field named after the clock that
  produced it: `sim_time` for the simulated cluster's clock, `measured_time` for a measured run (`TIME_FIELDS`);
- flushes the rows before each checkpoint (a resume keeps exactly the rows up to its checkpoint's step);
- writes the summary, whose schema is `summary()`'s.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Callable, Mapping, Optional

import ml_collections
import numpy as np

from waitless.experiments.harness import atomic_files
from waitless.experiments.harness import checkpointing
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import window as window_lib

log = logging.getLogger('waitless')

SIMULATED, MEASURED = 'simulated', 'measured'
TIME_FIELDS = dict(zip((SIMULATED, MEASURED), metrics_io.TIME_FIELDS))  # the clock -> its time field
SUMMARY_FILE = 'summary.json'


class TrainingDiverged(RuntimeError):
  """The training loss became NaN or infinite; the last good checkpoint is kept."""


class ClusterStalled(RuntimeError):
  """The simulated cluster cannot go on: the algorithm waits for a worker that failed for good."""


def write_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  """config.json, written atomically (other processes may be reading it to check the workdir)."""
  os.makedirs(workdir, exist_ok=True)
  atomic_files.write_text(os.path.join(workdir, 'config.json'), config.to_json_best_effort(indent=2))


class RunRecorder:
  """One run's metrics, checkpoints and summary (see the module docstring).

  Attributes:
    workdir: the run's directory (None: a run that trains and writes nothing, as the tests drive it).
    clock: SIMULATED or MEASURED; `time_field` is the name of its time in rows and the summary.
    time: the run's time so far on that clock (seconds).
    window: the measurements since the last row.
    time_to_target, last_eval, last_train_loss: what the summary and the next checkpoint report.
    summary: set once the run finished; failure: the `TrainingDiverged` or `ClusterStalled` it stopped with.
  """

  def __init__(self, workdir: Optional[str], config: ml_collections.ConfigDict, reports: Mapping[str, str],
               clock: str = SIMULATED, runtime: str = 'spmd', writes: bool = True,
               finish_row: Optional[Callable[[dict], dict]] = None):
    """`reports`: the window's reductions beyond the step's (`window.Window`); `writes`: this process writes the
    files (process 0 of a multi-process run; every process saves its checkpoint shards); `finish_row`: the
    runtime's last touch to a row before it is written (a measured run folds its per-worker counts)."""
    self.workdir, self.config, self.clock, self.runtime, self.writes = workdir, config, clock, runtime, writes
    self.finish_row = finish_row
    self.time_field = TIME_FIELDS[clock]
    self.reports = dict(reports)
    self.window = window_lib.Window(self.reports)
    self._checkpointer: Optional[checkpointing.Checkpointer] = None
    self.writer: Optional[metrics_io.MetricsWriter] = None
    self.time = 0.0
    self.time_to_target: Optional[float] = None
    self.last_eval: dict = {}
    self.last_train_loss = math.nan
    self.wall_offset, self.start_wall = 0.0, time.time()
    self.summary: Optional[dict] = None
    self.failure: Optional[Exception] = None

  @property
  def checkpointer(self) -> Optional[checkpointing.Checkpointer]:
    """The run's orbax checkpoints (made on first use: its directory is created then); None without a workdir."""
    if self._checkpointer is None and self.workdir is not None:
      self._checkpointer = checkpointing.Checkpointer(os.path.join(self.workdir, 'checkpoints'))
    return self._checkpointer

  @property
  def done(self) -> bool:
    return self.summary is not None or self.failure is not None

  # ---- resume ----

  def restore(self, step: int, meta: Mapping[str, Any]) -> None:
    """The recorder as it was at the checkpoint of `step` (its `meta`, see `checkpoint`)."""
    self.wall_offset = float(meta['wall_time'])
    self.time = float(meta[self.time_field])
    self.time_to_target, self.last_eval = meta['time_to_target'], meta['last_eval']
    self.window = window_lib.Window(self.reports, meta['window'])
    self.last_train_loss = float(meta['train_loss'])
    log.info('Resumed from the checkpoint at step %d in %s', step, self.workdir)

  def open(self, resumed_step: int = 0) -> None:
    """Starts the metrics files: a fresh log, or the rows up to `resumed_step` of an earlier one."""
    counts = [self.config.get(field) for field in ('log_every', 'eval_every', 'num_steps')]
    cadence = tuple(int(c) for c in counts) if all(c is not None for c in counts) else None
    self.writer = metrics_io.MetricsWriter(self.workdir, keep_through_step=resumed_step or None,
                                           enabled=self.writes, time_field=self.time_field, cadence=cadence)
    for problem in self.writer.problems:  # rows lost before this resume: said, never silent
      log.warning('%s', problem)

  def wall(self, now: Optional[float] = None) -> float:
    """Wall-clock seconds of this run at `now` (a `time.time()`; default: now), counted over its resumes."""
    return self.wall_offset + (time.time() if now is None else now) - self.start_wall

  # ---- per update ----

  def check_finite(self, losses: np.ndarray, first_step: int) -> bool:
    """Whether the training `losses` of the iterations from `first_step` are finite; if not, the run stops with
    a `TrainingDiverged` naming the step (`failure`), and False."""
    if np.all(np.isfinite(losses)):
      return True
    losses = np.atleast_1d(losses)
    bad = int(np.argmin(np.isfinite(losses)))
    kept = None if self.checkpointer is None else self.checkpointer.latest_step()
    where = (f'the last good checkpoint (step {kept}) is kept in {self.workdir}' if kept is not None else
             f'before its first checkpoint; its metrics are in {self.workdir}')
    self.failure = TrainingDiverged(f'training loss is {losses[bad]} at step {first_step + bad + 1}; stopped, {where}')
    log.info('%s', self.failure)
    return False

  def log(self, step: int, evaluation: Optional[dict] = None, extra: Optional[dict] = None,
          now: Optional[float] = None) -> dict:
    """Writes the metrics row of `step`: the window's reductions, the run's time, `extra` fields and, at an
    evaluation, its figures (the first time at `config.target_accuracy` is kept). Returns the row."""
    row = {'step': step, self.time_field: self.time, 'wall_time': self.wall(now), **self.window.row(), **(extra or {})}
    if self.finish_row is not None:
      row = self.finish_row(row)
    if evaluation is not None:
      self.last_eval = evaluation
      row.update({k: v for k, v in evaluation.items() if k != 'param_norm'})
      if self.time_to_target is None and evaluation['eval_accuracy'] >= self.config.target_accuracy:
        self.time_to_target = self.time
    if self.writer is not None:
      self.writer.write(row)
    return row

  def checkpoint(self, step: int, state: Any, meta: Optional[dict] = None, copy: bool = True) -> None:
    """Saves `state` at `step` with the recorder's meta and the runtime's own (`meta`: clock, data positions,
    ...), after the rows up to `step` reached the files (what a resume keeps)."""
    meta = {'step': step, 'wall_time': self.wall(), self.time_field: self.time, 'time_to_target': self.time_to_target,
            'window': self.window.sums, 'last_eval': self.last_eval, 'train_loss': self.last_train_loss,
            **(meta or {})}
    if self.writer is not None:
      self.writer.flush()
    self.checkpointer.save(step, state, meta, copy=copy)

  def finish(self, step: int, num_params: int, replicas: int = 1, extra: Optional[dict] = None) -> dict:
    """The run's summary (written to summary.json by the process that writes):

      clock, runtime, steps, sim_time or measured_time, wall_time, final_train_loss, final_eval_loss,
      final_eval_accuracy, param_norm, time_to_target (on the run's clock), num_params (per worker), replicas,
      final_<metric> for the task's other evaluation metrics, and the runtime's `extra` fields.
    """
    last = self.last_eval
    self.summary = {
        'clock': self.clock, 'runtime': self.runtime, 'steps': step, self.time_field: self.time,
        'wall_time': self.wall(), 'final_train_loss': self.last_train_loss,
        'final_eval_loss': last.get('eval_loss'), 'final_eval_accuracy': last.get('eval_accuracy'),
        'param_norm': last.get('param_norm'), 'time_to_target': self.time_to_target, 'num_params': num_params,
        'replicas': replicas,
        **{f'final_{k}': v for k, v in last.items() if k not in ('eval_loss', 'eval_accuracy', 'param_norm')},
        **(extra or {}),
    }
    if self.writes and self.workdir is not None:
      atomic_files.write_json(os.path.join(self.workdir, SUMMARY_FILE), self.summary, indent=2)
    if self.writer is not None and self.writer.gaps is not None:
      log.warning('%s: finished, but its %s has %s: a comparison refuses this run', self.workdir,
                  metrics_io.METRICS_FILE, self.writer.gaps)
    return self.summary

  def stall(self, error: Exception, step: int, first: bool) -> None:
    """The run stops: its clock raised `error` sampling the block after `step` (`first`: before any block of this
    call, else while the block before ran)."""
    where = f'Stopped at step {step}.' if first else f'Stopped after step {step}; its metrics are in {self.workdir}.'
    self.failure = ClusterStalled(f'{error} {where}')
    log.info('%s: %s', self.workdir, self.failure)

  def close(self) -> None:
    if self._checkpointer is not None:
      self._checkpointer.close()
    if self.writer is not None:
      self.writer.close()


def restore_common_step(recorders: list[RunRecorder], like_state: Any) -> Optional[tuple[int, list[tuple]]]:
  """(step, [(state, meta) per recorder]) of the newest checkpoint step that every recorder's run has and that
  reads back for all of them, or None when none has a checkpoint. A checkpoint that does not read back is moved
  aside (`checkpointing.quarantine_step`) and the choice made again (a kill between the saves of a group's runs
  leaves some a checkpoint ahead: they go back one).

  Raises:
    ValueError: the runs have checkpoints but no step in common.
  """
  unreadable: dict[str, list[int]] = {}  # workdir -> the steps moved aside
  while True:
    steps = [set(r.checkpointer.all_steps()) for r in recorders]
    if not any(steps):
      for workdir, lost in unreadable.items():  # said: a run that starts over must not look like a resume
        log.warning('%s: no readable checkpoint is left (unreadable: step(s) %s, moved to corrupt_checkpoints/): '
                    'the run trains again from step 0', workdir, ', '.join(map(str, sorted(lost))))
      return None
    common = set.intersection(*steps)
    if not common:
      raise ValueError('the runs of this group have no checkpoint step in common (latest: '
                       + ', '.join(f'{r.workdir}: {max(s) if s else None}' for r, s in zip(recorders, steps))
                       + '): train them in separate groups (experiments.harness.replicas.partition does)')
    step = max(common)
    restored = [r.checkpointer.restore_step(step, like_state, checkpointing.quarantine_step(r.workdir))
                for r in recorders]
    for r, x in zip(recorders, restored):
      if x is None:
        unreadable.setdefault(r.workdir, []).append(step)
    if all(x is not None for x in restored):
      return step, restored
