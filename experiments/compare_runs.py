"""Running a comparison's runs: one process, one run after another, finished ones skipped.

A run that diverges or stalls is recorded in its workdir (`FAILED_FILE`) so that a rerun does not repeat it;
an interrupted run resumes from its checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional, Sequence

from experiments.compare_plan import PlannedRun

FAILED_FILE = 'compare_failed.json'  # a diverged or stalled run: rerunning would fail the same way
SUMMARY_FILE = 'summary.json'

log = logging.getLogger('waitless')


def run_status(workdir: str) -> Optional[str]:
  """'finished', 'diverged' or 'stalled' when the run needs no more work; None otherwise."""
  if os.path.exists(os.path.join(workdir, SUMMARY_FILE)):
    return 'finished'
  path = os.path.join(workdir, FAILED_FILE)
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)['status']
  return None


class _Progress(logging.Filter):
  """Prefixes the training loop's lines with the run (i/N) and adds the whole comparison's ETA."""

  def __init__(self, runs: Sequence[PlannedRun]):
    super().__init__()
    self.runs, self.index, self.done_steps, self.done_seconds = runs, 0, 0, 0.0

  def remaining_steps(self) -> int:
    return sum(r.config.num_steps for r in self.runs[self.index + 1:] if run_status(r.workdir) is None)

  def overall_eta(self, run_eta: float = 0.0) -> str:
    """This run's ETA plus the remaining runs' iterations at the seconds per iteration of the finished runs
    (their start-up and compilation included)."""
    if not self.done_steps:
      return 'after the first run'
    return format_duration(run_eta + self.remaining_steps() * self.done_seconds / self.done_steps)

  def filter(self, record):
    prefix = f'[{self.index + 1}/{len(self.runs)} {self.runs[self.index].name}] '
    if isinstance(record.msg, str) and record.msg.startswith('step %d/%d') and len(record.args) == 6:
      record.msg = prefix + record.msg + '  (comparison ETA %s)'
      record.args = tuple(record.args) + (self.overall_eta(record.args[5]),)
    elif isinstance(record.msg, str):
      record.msg = prefix + record.msg
    return True


def format_duration(seconds: float) -> str:
  seconds = max(0, int(round(seconds)))
  return f'{seconds // 60}m{seconds % 60:02d}s' if seconds >= 60 else f'{seconds}s'


def run_all(runs: Sequence[PlannedRun], stop_requests_factory=None) -> None:
  """Trains every unfinished run in this process, in order; finished ones are skipped.

  A run that diverges or stalls is recorded (`compare_failed.json` in its workdir) and the others go on.
  `train.Preempted`, KeyboardInterrupt and user errors propagate: rerunning resumes where it stopped.
  """
  from experiments import preemption  # pylint: disable=g-import-not-at-top
  from experiments import train  # pylint: disable=g-import-not-at-top
  progress = _Progress(runs)
  log.addFilter(progress)
  try:
    for i, run in enumerate(runs):
      progress.index = i
      status = run_status(run.workdir)
      if status is not None:
        log.info('%s already (%s), skipped', status, run.workdir)
        continue
      log.info('-> %s, %d steps  (comparison ETA %s)', run.workdir, run.config.num_steps, progress.overall_eta())
      start = time.time()
      stop_requests = (stop_requests_factory or preemption.StopRequests)()
      try:
        summary = train.train_and_evaluate(run.config.copy_and_resolve_references(), run.workdir, stop_requests)
        log.info('done in %s: eval accuracy %.4f, loss %.4f, sim time %.3g s', format_duration(time.time() - start),
                 summary['final_eval_accuracy'], summary['final_eval_loss'], summary['sim_time'])
      except (train.TrainingDiverged, train.ClusterStalled) as e:
        failed = 'diverged' if isinstance(e, train.TrainingDiverged) else 'stalled'
        with open(os.path.join(run.workdir, FAILED_FILE), 'w') as f:
          json.dump({'status': failed, 'error': str(e)}, f)
        log.info('%s: %s', failed, e)
      progress.done_steps += run.config.num_steps
      progress.done_seconds += time.time() - start
  finally:
    log.removeFilter(progress)

