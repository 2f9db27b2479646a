"""Running a comparison's runs: one process, one run after another, finished ones skipped.

A run that diverges or stalls is recorded in its workdir (`FAILED_FILE`) so that a rerun does not repeat it;
an interrupted run resumes from its checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional, Sequence

from waitless.experiments.comparison.plan import PlannedRun
from waitless.experiments.harness import atomic_files

FAILED_FILE = 'compare_failed.json'  # a diverged or stalled run: rerunning would fail the same way
SUMMARY_FILE = 'summary.json'

log = logging.getLogger('waitless')


def run_status(workdir: str) -> Optional[str]:
  """'finished', 'diverged' or 'stalled' when the run needs no more work; None otherwise."""
  if atomic_files.read_json(os.path.join(workdir, SUMMARY_FILE)) is not None:
    return 'finished'
  failed = atomic_files.read_json(os.path.join(workdir, FAILED_FILE))
  if failed is not None and failed.get('status') in ('diverged', 'stalled'):
    return failed['status']
  return None


class _Progress(logging.Filter):
  """Prefixes the training loop's lines with the program (i/G) and its runs, and adds the comparison's ETA."""

  def __init__(self, groups: Sequence[Sequence[PlannedRun]]):
    super().__init__()
    self.groups, self.index, self.done_steps, self.done_seconds = groups, 0, 0, 0.0

  def label(self) -> str:
    group = self.groups[self.index]
    if len(group) == 1:
      return group[0].name
    return f'{group[0].entry}, {len(group)} runs'

  def remaining_steps(self) -> int:
    """The iterations the loop still has to run after this program: each program runs as many as its longest run."""
    return sum(max(r.config.num_steps for r in group) for group in self.groups[self.index + 1:])

  def overall_eta(self, run_eta: float = 0.0) -> str:
    """This program's ETA plus the remaining programs' iterations at the seconds per iteration of the finished
    ones (their start-up and compilation included)."""
    if not self.done_steps:
      return 'after the first program'
    return format_duration(run_eta + self.remaining_steps() * self.done_seconds / self.done_steps)

  def filter(self, record):
    prefix = f'[{self.index + 1}/{len(self.groups)} {self.label()}] '
    if isinstance(record.msg, str) and record.msg.startswith('step %d/%d') and len(record.args) == 6:
      record.msg = prefix + record.msg + '  (comparison ETA %s)'
      record.args = tuple(record.args) + (self.overall_eta(record.args[5]),)
    elif isinstance(record.msg, str):
      record.msg = prefix + record.msg
    return True


def workdirs_text(workdirs: Sequence[str]) -> str:
  """A program's workdirs in a short line: the one, or how many under their common directory."""
  if len(workdirs) == 1:
    return workdirs[0]
  common = os.path.commonpath(workdirs)
  names = [os.path.relpath(w, common) for w in workdirs]
  shown = ', '.join(names) if len(names) <= 3 else f'{names[0]} .. {names[-1]}'
  return f'{len(workdirs)} runs in {common}/ ({shown})'


def format_duration(seconds: float) -> str:
  seconds = max(0, int(round(seconds)))
  return f'{seconds // 60}m{seconds % 60:02d}s' if seconds >= 60 else f'{seconds}s'


def run_all(runs: Sequence[PlannedRun], stop_requests_factory=None, max_replicas: Optional[int] = None) -> None:
  """Trains every unfinished run in this process; finished ones are skipped.

  The runs are grouped into programs (`setup.plan_groups`: seeds and sweep values that change no shape and no
  time rule train as the replicas of one compiled program, at most `max_replicas` or as many as fit in memory),
  one program after another. A run that diverges or stalls is recorded (`compare_failed.json` in its workdir)
  and the others go on. `preemption.Preempted`, KeyboardInterrupt and user errors propagate: rerunning resumes where
  it stopped.
  """
  from waitless.experiments.harness import metrics_io
  from waitless.experiments.harness import recorder as recorder_lib
  from waitless.experiments.harness import preemption
  from waitless.experiments.harness import setup
  from waitless.experiments.harness import train
  pending = [run for run in runs if run_status(run.workdir) is None]
  if len(pending) < len(runs):
    log.info('%d of %d runs finished already (summary.json or %s in their workdirs): skipped',
             len(runs) - len(pending), len(runs), FAILED_FILE)
  if not pending:
    return
  planned = setup.plan_groups([r.config for r in pending], [r.workdir for r in pending], max_replicas)
  groups = [[pending[i] for i in group.indices] for group in planned]
  log.info('%d runs to train in %d programs', len(pending), len(groups))
  progress = _Progress(groups)
  log.addFilter(progress)
  try:
    for i, (group, built) in enumerate(zip(groups, (p.built for p in planned))):
      progress.index = i
      steps = max(r.config.num_steps for r in group)
      log.info('-> %s, %d steps  (comparison ETA %s)', workdirs_text([r.workdir for r in group]), steps,
               progress.overall_eta())
      start = time.time()
      stop_requests = (stop_requests_factory or preemption.StopRequests)()
      outcomes = train.train_group([r.config.copy_and_resolve_references() for r in group],
                                   [r.workdir for r in group], stop_requests, built=built)
      for run, outcome in zip(group, outcomes):
        if isinstance(outcome, (recorder_lib.TrainingDiverged, recorder_lib.ClusterStalled)):
          failed = 'diverged' if isinstance(outcome, recorder_lib.TrainingDiverged) else 'stalled'
          atomic_files.write_json(os.path.join(run.workdir, FAILED_FILE), {'status': failed, 'error': str(outcome)})
          log.info('%s %s: %s', run.name, failed, outcome)
        else:
          log.info('%s done in %s: eval accuracy %.4f, loss %.4f, %s %.3g s', run.name,
                   format_duration(time.time() - start), outcome['final_eval_accuracy'],
                   outcome['final_eval_loss'], 'measured time' if outcome.get('measured_time') is not None
                   else 'sim time', metrics_io.time_of(outcome))
      progress.done_steps += steps
      progress.done_seconds += time.time() - start
  finally:
    log.removeFilter(progress)


