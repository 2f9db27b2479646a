"""The training loop: a group of runs (a run alone is a group of one) trained block by block.

    while a replica goes on:
      prepare   each live replica's clock samples the block's schedules (who finished what, how long it took),
                its data stream serves every worker the micro-batches at its own positions (`inputs.py`)
      dispatch  one jitted call runs the block on every worker (`block_step.BlockStep`)
      record    each replica's share of the measurements goes to its recorder (`recorder.RunRecorder`): the
                metrics window, a row every `log_every` steps, the evaluation of the consensus model every
                `eval_every`, a checkpoint every `checkpoint_every` (and every `checkpoint_every_s` seconds)

While the devices run a block, the host prepares and dispatches the next one (`lookahead`; the blocks come from
`reader.BlockReader`, which may draw and read several at once). Block lengths depend only on absolute step numbers
(`inputs.block_length`), so a resumed run executes the same programs on the same inputs as an uninterrupted
one. The tests drive the same `reader.prepare`, `dispatch`, `measurements` and `accept` (tests/harness.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Optional

import jax
import numpy as np

from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import evaluation
from waitless.experiments.harness import measured_time
from waitless.experiments.harness import preemption
from waitless.experiments.harness import reader as reader_lib
from waitless.experiments.harness import recorder as recorder_lib
from waitless.experiments.harness import setup

log = logging.getLogger('waitless')

def reports(run: setup.Run) -> dict[str, str]:
  """The window's reductions beyond the step's: the rule's reports, and a measured run's counts and times."""
  return {**run.rule.reports, **(measured_time.reports(run.config) if run.measured else {})}


@dataclasses.dataclass
class Replica:
  """The host side of one replica of a group: its run's clock, data positions and recorder (metrics,
  checkpoints, outcome)."""
  run: setup.Run
  clock: Any
  positions: np.ndarray
  recorder: recorder_lib.RunRecorder

  @classmethod
  def start(cls, run: setup.Run, clock, workdir: Optional[str] = None) -> 'Replica':
    """A replica at step 0, its recorder writing to `workdir` (without one it only trains: the tests)."""
    workers = run.config.workers
    recorder = recorder_lib.RunRecorder(
        workdir, run.config, reports(run), recorder_lib.MEASURED if run.measured else recorder_lib.SIMULATED,
        writes=jax.process_index() == 0,
        finish_row=(lambda row: measured_time.finish_row(row, workers)) if run.measured else None)
    return cls(run=run, clock=clock, positions=np.zeros(workers, np.int64), recorder=recorder)

  @property
  def config(self):
    return self.run.config

  @property
  def workdir(self) -> Optional[str]:
    return self.recorder.workdir

  @property
  def done(self) -> bool:
    return self.recorder.done


class Loop:
  """The block loop of a group: each replica's measurements, evaluations and checkpoints go to its recorder.

  Attributes:
    group: the runs (`setup.Group`); `lead` its first run (what every run shares: layout, rule, cadence).
    replicas: one `Replica` per run.
    block_step: the group's `block_step.BlockStep`.
    num_params: parameters per worker (for the summaries).
    lookahead: whether the next block is sampled and dispatched while this one runs (see `run`).
  """

  def __init__(self, group: setup.Group, replicas: list[Replica], block_step: block_step_lib.BlockStep,
               num_params: int = 0):
    self.group, self.lead = group, group.lead
    self.replicas, self.block_step, self.num_params = replicas, block_step, num_params
    # Keep the device busy: while it runs a block, the host samples the next block's schedules and reads its
    # data, and dispatches it before this one's results are read (an evaluation first takes its consensus model
    # of this block's state, which the next block donates). Not across a checkpoint (the saved clocks and data
    # positions must be those after the saved step), and not for a rule that adapts to this block's loss
    # (AdaSync) or a measured run (its next block's counts need this block's times, and its clock times one
    # block at a time): their schedules, and so their trajectories, stay exactly the same.
    self.measured = self.lead.measured
    self.lookahead = not self.lead.rule.uses_feedback and not self.measured
    self.progress_every_s = float(self.lead.config.progress_every_s)
    self.checkpoint_every_s = float(self.lead.config.checkpoint_every_s)
    self.evaluator: Optional[evaluation.Evaluator] = None
    self.last_checkpoint = time.time()  # the wall time of the last checkpoint (`checkpoint_due`)
    self.reader = reader_lib.BlockReader(group, replicas, self.lookahead, self.checkpoint_due)
    self.cadences = self.reader.cadences

  def dispatch(self, state, prepared: reader_lib.Prepared):
    """Runs the block on the devices (asynchronously): (new state, packed measurements)."""
    return self.block_step(state, *prepared.inputs)

  def measurements(self, prepared: reader_lib.Prepared, measured) -> dict[str, np.ndarray]:
    """The block's measurements on the host (`step.unpack_measurements`); a measured run's clock records the
    block's measured times here (`prepared.blocks[0]` becomes the recorded block)."""
    run = self.lead
    if self.measured:  # wait with the Python lock released: the program's clock reads need it
      jax.block_until_ready(measured)
      ready = time.perf_counter()  # before the all-gather below, which compiles once per block length
    host = block_step_lib.measurements_to_host(measured, timed=self.measured)
    if self.measured:  # group of one (a measured run never shares its program)
      seconds = measured_time.block_seconds(prepared.seconds, self.block_step.stopwatch.origin, ready,
                                            self.block_step.compiled,
                                            host['started_s'][0, run.layout.local_worker_ids()])
      prepared.blocks[0] = self.replicas[0].clock.record(prepared.blocks[0], host['compute_s'], seconds)
    return host

  def accept(self, i: int, block, host: dict[str, np.ndarray], at: int,
             reduced: Optional[dict] = None) -> bool:
    """Replica i's share of the measurements of its `block` from step `at`: into its recorder's window, and its
    training loss to its clock (`clock.feedback`). False, the run stopped, when the loss is not finite.
    `reduced`: the block's host reductions for every replica at once (`reduce_measurements`; default: computed
    here for this one)."""
    r = self.replicas[i]
    if reduced is None:
      blocks = [None] * len(self.replicas)
      blocks[i] = block
      reduced = self.reduce_measurements(blocks, host)
    losses = reduced['train_loss'][i]
    if not r.recorder.check_finite(losses, at):
      return False
    if id(block) not in reduced['blocks']:  # what the window takes from the clock's block: once per block
      reduced['blocks'][id(block)] = r.recorder.window.reduce_block(block)
    r.recorder.window.add_reduced(reduced['blocks'][id(block)], train_loss=losses, l2_grads=reduced['l2_grads'][i],
                                  l2_params=reduced['l2_params'][i])
    if r.run.rule.uses_feedback:  # AdaSync adapts K from the loss; the other rules ignore it
      r.clock.feedback(train_loss=float(losses.mean()))
    r.recorder.time, r.recorder.last_train_loss = float(block.sim_time[-1]), float(losses[-1])
    return True

  def reduce_measurements(self, blocks: list, host: dict[str, np.ndarray]) -> dict:
    """The block's per-replica reductions of the step's measurements, for every replica at once: `train_loss`
    (R, n), the mean loss over the workers that contributed (a frozen replica, `None` in `blocks`, counts none),
    `l2_grads` (R, n) and `l2_params` (R,) means over the workers; `blocks` starts the cache of each clock
    block's own reductions (`Window.reduce_block`)."""
    lead = (slice(None),) if self.group.batched else (None,)  # (R, n, P), a run's R = 1 added
    loss, l2_grads, l2_params = host['loss'][lead], host['l2_grads'][lead], host['l2_params'][lead]
    workers = loss.shape[2]
    if len(blocks) == 1 and blocks[0] is not None:
      contributed = blocks[0].schedule.microbatches_done[None] > 0
    else:
      contributed = np.stack([np.zeros(loss.shape[1:], bool) if b is None else b.schedule.microbatches_done > 0
                              for b in blocks])
    losses = np.where(contributed, loss, 0.0).sum(2) / np.maximum(contributed.sum(2), 1)
    # x.sum(k) / count is x.mean(k) (float32 stays float32).
    return {'train_loss': losses, 'l2_grads': l2_grads.sum(2) / workers, 'l2_params': l2_params.sum(1) / workers,
            'blocks': {}}

  def record(self, prepared: reader_lib.Prepared, host: dict[str, np.ndarray], state, snapshot,
             evaluates: dict[int, bool], checkpoints: dict[int, bool]) -> None:
    """Each live replica's metrics row, evaluation (of `snapshot`, the consensus model), checkpoint and summary
    at the end of the block."""
    at, end = prepared.step, prepared.step + prepared.length
    evaluated = None
    reduced = self.reduce_measurements(prepared.blocks, host)
    for i in prepared.live:
      r = self.replicas[i]
      if r.recorder.failure is not None:  # diverged in the previous block, whose successor was already dispatched
        continue
      if not self.accept(i, prepared.blocks[i], host, at, reduced):
        continue
      if evaluates[i] or end % self.cadences[i].log_every == 0:
        evaluation = None
        if evaluates[i]:
          if evaluated is None:
            evaluated = self.evaluator.measure(snapshot)
          evaluation = evaluated[i] if self.group.batched else evaluated
        r.recorder.log(end, evaluation, now=prepared.finished)
      if checkpoints[i]:
        self.checkpoint(i, setup.replica_state(self.group, state, i), end)
      if end == self.cadences[i].num_steps:
        self.finish(r, end)

  def checkpoint(self, i: int, state, end: int) -> None:
    """Replica i's checkpoint at step `end`: its `state` (P, ...) (`setup.replica_state`), its clock and data
    positions."""
    r = self.replicas[i]
    r.recorder.checkpoint(end, state, {'positions': r.positions.tolist(), 'clock': r.clock.state_dict()},
                          copy=not self.group.batched)
    if self.measured:  # not under the next timed block: it is left out of the clock, and must not slow it
      r.recorder.checkpointer.wait()

  def finish(self, r: Replica, at: int) -> None:
    """The replica's summary (a measured run's adds its fitted device speeds)."""
    r.recorder.finish(at, self.num_params, self.group.size, r.clock.summary() if self.measured else None)

  def run(self, state, step: int, stop_requests: preemption.StopRequests | None = None) -> None:
    """Trains from `step` until every replica finished, failed, or a stop was requested.

    Raises:
      preemption.Preempted: a stop was requested; every unfinished replica finished its block and checkpointed.
    """
    run, replicas, cadences = self.lead, self.replicas, self.cadences
    num_steps = max(c.num_steps for c in cadences)
    names = ', '.join(os.path.basename(os.path.normpath(r.workdir)) for r in replicas)
    log.info('%s: %d workers on %d %s device(s), %d parameters per worker, %d steps%s',
             run.config.algorithm.name, run.config.workers, run.layout.devices, jax.devices()[0].platform,
             self.num_params, num_steps,
             f'; {self.group.size} runs in one program ({names})' if self.group.batched else '')
    self.evaluator = evaluation.make_evaluator(self.group)
    log.info('compiling the block step (or loading it from the compilation cache); the first block waits for it')
    start_wall, start_step = time.time(), step
    last_progress = self.last_checkpoint = start_wall
    for r in replicas:
      r.recorder.start_wall = start_wall
      if r.config.num_steps <= step:  # resumed at its end (killed before its summary was written)
        self.finish(r, step)
    stop_requests = preemption.StopRequests() if stop_requests is None else stop_requests
    try:
      stop_requests.install()
      current, measured = self.reader.prepare(step), None
      while current is not None:
        for i, e in current.stalled.items():
          replicas[i].recorder.stall(e, step, first=True)
        if not current.live:
          break
        if measured is None:
          state, measured = self.dispatch(state, current)
        live, end = current.live, step + current.length
        evaluates = {i: end % cadences[i].eval_every == 0 or end == cadences[i].num_steps for i in live}
        # A stop makes this block the last: checkpoint after it, no lookahead. So does the wall-clock period.
        stop, due = stop_requests.agreed(step, self.checkpoint_due())
        checkpoints = {i: end % cadences[i].checkpoint_every == 0 or end == cadences[i].num_steps or due
                       for i in live}
        if stop or any(checkpoints.values()):  # the clocks and positions saved are those after `end`
          self.reader.rewind(end)
        # The evaluation's consensus model is taken before the next block is dispatched (it donates `state`).
        # A measured run takes it after its block's results: compiling it on this thread while the block runs
        # would hold the Python lock that the block's clock reads wait for.
        snapshot = self.evaluator.consensus(state) if any(evaluates.values()) and not self.measured else None
        following = next_measured = None
        if self.lookahead and not any(checkpoints.values()):
          following = self.reader.prepare(end)
          if following is not None and following.live:
            state, next_measured = self.dispatch(state, following)
        host = self.measurements(current, measured)
        current.finished = time.time()
        if self.measured and any(evaluates.values()):
          snapshot = self.evaluator.consensus(state)
        self.record(current, host, state, snapshot, evaluates, checkpoints)
        if following is not None and any(replicas[i].recorder.failure is not None for i in following.live):
          self.reader.rewind(following.step + following.length)  # the blocks after it are read without the failed
        if any(checkpoints.values()):
          self.last_checkpoint = time.time()
        step = end
        if time.time() - last_progress >= self.progress_every_s or not self.reader.running(step):
          last_progress = time.time()
          self.log_progress(step, live, num_steps, (step - start_step) / max(time.time() - start_wall, 1e-9))
        if stop and self.reader.running(step):
          raise preemption.Preempted(step, ', '.join(replicas[i].workdir for i in self.reader.running(step)),
                                     stop_requests.signal_name)
        if following is None:
          current = self.reader.prepare(step) if self.reader.running(step) else None
          measured = None
        else:
          for i, e in following.stalled.items():  # found while this block ran: it stops after this block
            replicas[i].recorder.stall(e, step, first=False)
          following.stalled = {}
          current, measured = following, next_measured
    finally:
      stop_requests.uninstall()

  def checkpoint_due(self) -> bool:
    """Whether the group's wall-clock checkpoint period (`checkpoint_every_s`; 0: none) has passed since its
    last checkpoint (or the start of this call): then the block being dispatched ends with a checkpoint of every
    live replica, wherever it ends. Blocks never depend on it (their lengths come from step numbers alone), so
    neither does the trajectory; it bounds what a crash loses to that period, whatever the run's length."""
    period = self.checkpoint_every_s
    return period > 0 and time.time() - self.last_checkpoint >= period

  def log_progress(self, step: int, live: list[int], num_steps: int, rate: float) -> None:
    recorders = [self.replicas[i].recorder for i in live]
    losses = [r.last_train_loss for r in recorders if not r.failure]
    log.info('step %d/%d  loss %.4f  %s %.2fs  %.1f steps/s  ETA %.0fs', step, num_steps,
             float(np.mean(losses)) if losses else float('nan'), 'measured' if self.lead.measured else 'sim',
             max(r.time for r in recorders), rate, (num_steps - step) / max(rate, 1e-9))
