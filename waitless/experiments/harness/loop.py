"""The training loop: a group of runs (a run alone is a group of one) trained block by block.

Each block: the replicas' clocks sample the schedules (who finished what, how long it took), the data streams
serve every worker the micro-batches at its own positions (`Loop.prepare`; where the data set lives on the
devices, for up to `AHEAD_BLOCKS` blocks at once, all placed on the devices together), one jitted call runs the
block (`Loop.dispatch`), and the host takes each replica's share of its measurements (`Loop.accept`), then logs,
evaluates the consensus model and checkpoints at fixed step boundaries (`Loop.record`); the blocks read together
are recorded together, after the last of them, from one fetch of their measurements (`Loop.defers`). Block
lengths depend only on absolute step numbers (`inputs.block_length`), so a resumed run executes the same programs
on the same inputs as an uninterrupted one. `Loop.run` is the loop itself; the tests drive the same `prepare`,
`dispatch`, `measurements` and `accept` (tests/harness.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Optional

import jax
import numpy as np

from waitless.cluster import clock as clock_lib
from waitless.experiments.harness import atomic_files
from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import checkpointing
from waitless.experiments.harness import evaluation
from waitless.experiments.harness import inputs as inputs_lib
from waitless.experiments.harness import measured_time
from waitless.experiments.harness import preemption
from waitless.experiments.harness import setup
from waitless.experiments.harness import window as window_lib

log = logging.getLogger('waitless')

AHEAD_BLOCKS = 16  # the most blocks `Loop.prepare` draws and reads at once


class TrainingDiverged(RuntimeError):
  """The training loss became NaN or infinite; the last good checkpoint is kept."""


class ClusterStalled(RuntimeError):
  """The simulated cluster cannot go on: the algorithm waits for a worker that failed for good."""


def reports(run: setup.Run) -> dict[str, str]:
  """The window's reductions beyond the step's: the rule's reports, and a measured run's counts and times."""
  return {**run.rule.reports, **(measured_time.reports(run.config) if run.measured else {})}


@dataclasses.dataclass
class Replica:
  """The host side of one replica of a group: its run's clock, data positions, metrics, checkpoints, outcome."""
  run: setup.Run
  workdir: Optional[str]
  clock: Any
  checkpointer: Optional[checkpointing.Checkpointer]
  positions: np.ndarray
  window: window_lib.Window
  writer: Any = None
  wall_offset: float = 0.0
  time_to_target: Optional[float] = None
  last_eval: dict = dataclasses.field(default_factory=dict)
  last_train_loss: float = float('nan')
  sim_time: float = 0.0
  summary: Optional[dict] = None       # set when the run finished
  failure: Optional[Exception] = None  # TrainingDiverged or ClusterStalled: the run stopped there

  @classmethod
  def start(cls, run: setup.Run, clock, workdir: Optional[str] = None) -> 'Replica':
    """A replica at step 0; with a `workdir`, its checkpointer there (without one, it only trains: the tests)."""
    checkpointer = None if workdir is None else checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'))
    return cls(run=run, workdir=workdir, clock=clock, checkpointer=checkpointer,
               positions=np.zeros(run.config.workers, np.int64), window=window_lib.Window(reports(run)))

  @property
  def config(self):
    return self.run.config

  @property
  def done(self) -> bool:
    return self.summary is not None or self.failure is not None


@dataclasses.dataclass
class Prepared:
  """A block ready to dispatch: each replica's clock Block (None: frozen) and the step's inputs."""
  step: int
  blocks: list
  inputs: tuple
  stalled: dict  # replica index -> StalledError raised while sampling this block: it stops before it
  seconds: float = 0.0  # host seconds spent preparing it (a measured run's clock counts them)
  host: Optional[tuple] = None  # (inputs.HostInputs, start, stop): its inputs on the host, until `Loop.place`
  span: int = -1  # the first step of the blocks read with it (`Loop.prepare`): a new span is a new read
  finished: Optional[float] = None  # time.time() when its results were known (`Loop.run`; its rows' wall time)

  @property
  def live(self) -> list[int]:
    """The replicas that run this block."""
    return [i for i, b in enumerate(self.blocks) if b is not None]

  @property
  def length(self) -> int:
    return len(self.blocks[self.live[0]].duration)


@dataclasses.dataclass
class Ahead:
  """Blocks drawn and read together with the one being run (`Loop.prepare`), and where their span started, to go
  back to the end of any of them (`Loop.rewind`)."""
  blocks: list        # the Prepared blocks not handed out yet, in order
  step: int           # the first step of the span
  clocks: dict        # id(clock) -> (clock, its state_dict at `step`)
  positions: list     # each replica's data positions at `step`
  done: list          # each replica's microbatches_done (N, P) over the span (None: frozen)


def share_clocks(replicas: list[Replica]) -> None:
  """Replicas that would draw the same simulated times share one clock, so that each block is sampled once for
  them: the step sizes of a sweep at one seed. A group's runs differ only in fields that change no time rule
  (`replicas.replica_fields`), so equal seeds give equal clocks; they must also be in the same state (e.g. after
  a restore), and the rule must not adapt to the loss (AdaSync: each replica's own feedback); a measured run
  times its own program. Same draws, same schedules: only the host's work is shared."""
  leaders: dict[tuple, Replica] = {}
  for r in replicas:
    if r.done or r.run.measured or r.run.rule.uses_feedback or not isinstance(r.clock, clock_lib.Clock):
      continue
    key = (r.config.seed, type(r.run.rule))  # not the rule itself: some hold a function (local SGD's period)
    leader = leaders.setdefault(key, r)
    if leader is not r and leader.clock.state_dict() == r.clock.state_dict():
      r.clock = leader.clock


class Loop:
  """The block loop of a group: fills each replica's metrics, checkpoints and outcome.

  Attributes:
    group: the runs (`setup.Group`); `lead` its first run (what every run shares: layout, rule, cadence).
    replicas: one `Replica` per run.
    block_step: the group's `block_step.BlockStep`.
    num_params: parameters per worker (for the summaries).
    lookahead: whether the next block is sampled and dispatched while this one runs (see `run`).
  """

  records_by_span = True  # False: each block recorded as soon as it ran (tests/.../test_span_records.py compares)

  def __init__(self, group: setup.Group, replicas: list[Replica], block_step: block_step_lib.BlockStep,
               num_params: int = 0):
    self.group, self.lead = group, group.lead
    self.replicas, self.block_step, self.num_params = replicas, block_step, num_params
    # Keep the device busy: while it runs a block, the host samples the next block's schedules and reads its
    # data, and dispatches it before this one's results are read (an evaluation first takes its consensus model
    # of this block's state, which the next block donates). Not across a checkpoint (the saved clocks and data
    # positions must be those after the saved step), and not at all for a rule that adapts to this block's loss
    # (AdaSync): the schedules, and so the trajectory, stay exactly the same.
    # A measured run never looks ahead: its next block's counts need this block's times, and its clock times one
    # block at a time (`measured_time`).
    self.measured = self.lead.measured  # read once: a property of the config (a group shares it)
    self.lookahead = not self.lead.rule.uses_feedback and not self.measured
    self.cadences = [inputs_lib.Cadence.of(r.config) for r in replicas]
    self.progress_every_s = float(self.lead.config.progress_every_s)
    self.checkpoint_every_s = float(self.lead.config.checkpoint_every_s)
    self.evaluator: Optional[evaluation.Evaluator] = None
    self.start_wall = time.time()
    self.last_checkpoint = self.start_wall  # the wall time of the last checkpoint (`checkpoint_due`)
    # Blocks drawn and read ahead together (`prepare`): where the program's block is small, the host's fixed
    # costs per call (the clock's, the data read's, the packing's) were a tenth of the block's time.
    self.reads_ahead = self.lookahead and inputs_lib.reads_ahead(self.lead)
    self.ahead: Optional[Ahead] = None
    # A span's blocks are recorded together, after its last one (`run`): their measurements come to the host in
    # one fetch (`block_step.measurements_to_host_each`), not one per block. The trajectory, rows and checkpoints
    # are the same; rows reach the files a span later, a divergence is found at its span's end (the blocks
    # already read run on, as they did while they were in flight). Evaluations, checkpoints and stops end a span's
    # records, and so does the progress period (`progress_every_s`) where blocks are slow.
    self.defers = self.reads_ahead and self.records_by_span
    share_clocks(replicas)

  def running(self, at: int) -> list[int]:
    """The replicas that go on after step `at`."""
    return [i for i, (r, c) in enumerate(zip(self.replicas, self.cadences)) if not r.done and c.num_steps > at]

  def wall(self, r: Replica, now: Optional[float] = None) -> float:
    """Replica r's wall-clock seconds at `now` (a `time.time()`; default: now), counted over its resumes."""
    return r.wall_offset + (time.time() if now is None else now) - self.start_wall

  def prepare(self, at: int, length: Optional[int] = None) -> Optional[Prepared]:
    """Samples every running replica's next block and reads its data, moving its clock and data positions past
    the block; None when no replica goes on. `length`: the block's iterations (default: `inputs.block_length`,
    never across a log, eval or checkpoint boundary).

    Without a `length`, a run that looks ahead (`reads_ahead`) draws and reads up to `AHEAD_BLOCKS` blocks at
    once, up to its next checkpoint step: one clock draw (a block of n iterations is n of one: `Block.iterations`),
    one data read and one pack for all of them, and each block's inputs placed on the devices. The clocks and data
    positions are then past the last of them; a checkpoint after an earlier one goes back to it (`rewind`).
    Schedules, data and programs are the blocks' own: the trajectory is the same to the bit.
    """
    if self.ahead is not None:
      if length is None and self.ahead.blocks and self.ahead.blocks[0].step == at:
        return self.ahead.blocks.pop(0)
      self.rewind(at)
    live = self.running(at)
    if not live:
      return None
    begin = time.perf_counter()
    run = self.lead
    lengths = [length] if length else self.span(at, live)
    clocks = {id(self.replicas[i].clock): self.replicas[i].clock for i in live}
    saved = {key: (clock, clock.state_dict()) for key, clock in clocks.items()} if len(lengths) > 1 else None
    blocks, stalled = self.draw(live, sum(lengths))
    if stalled and saved:  # a stall inside the span: each block on its own, so that the blocks before it run
      for clock, state in saved.values():
        clock.load_state_dict(state)
      lengths, saved = lengths[:1], None
      blocks, stalled = self.draw(live, lengths[0])
    if all(b is None for b in blocks):
      return Prepared(at, blocks, (), stalled, span=at)
    positions = [r.positions for r in self.replicas]
    if self.group.batched:
      host, after = inputs_lib.read_stacked(self.group, blocks, positions, at)
    else:
      host, position = inputs_lib.read_block(run, blocks[0], positions[0], at)
      after = [position]
    for r, position in zip(self.replicas, after):
      r.positions = position
    if len(lengths) == 1:
      first = self.place(Prepared(at, blocks, (), stalled, host=(host, 0, None), span=at))
    else:
      bounds = np.cumsum([0] + lengths).tolist()
      spans = list(zip(bounds[:-1], bounds[1:]))
      pieces = {id(b): [b.iterations(*span) for span in spans] for b in blocks if b is not None}
      parts = [Prepared(at + start, [None if b is None else pieces[id(b)][k] for b in blocks], (), {},
                        host=(host, start, stop), span=at) for k, (start, stop) in enumerate(spans)]
      # All placed now, one after another: placing each between two blocks cost the digits MLP's loop about 1%.
      parts = [self.place(part) for part in parts]
      self.ahead = Ahead(parts[1:], at, saved, positions,
                         [None if b is None else b.schedule.microbatches_done for b in blocks])
      first = parts[0]
    first.seconds = time.perf_counter() - begin
    return first

  def span(self, at: int, live: list[int]) -> list[int]:
    """The lengths of the blocks from `at` that `prepare` draws and reads at once: one block, or for a run that
    `reads_ahead` up to `AHEAD_BLOCKS` of them, none past a live replica's next checkpoint step or its end; one
    while the wall-clock checkpoint period has passed (a period shorter than a block checkpoints every block)."""
    cadences = [self.cadences[i] for i in live]
    block = lambda step: min(inputs_lib.block_length(step, c, self.lead.round_length) for c in cadences)
    lengths = [block(at)]
    if not self.reads_ahead or self.checkpoint_due():  # a checkpoint at this block's end would rewind the rest
      return lengths
    limit = min(min(c.num_steps, (at // c.checkpoint_every + 1) * c.checkpoint_every) for c in cadences)
    step = at + lengths[0]
    while len(lengths) < AHEAD_BLOCKS and step < limit:
      lengths.append(block(step))
      step += lengths[-1]
    return lengths

  def draw(self, live: list[int], n: int) -> tuple[list, dict]:
    """Each replica's next `n` iterations (None: not live, or its clock stalled) and the stalls (replica index ->
    StalledError); a clock that replicas share (`share_clocks`) draws once."""
    blocks, stalled, drawn = [None] * len(self.replicas), {}, {}
    for i in live:
      clock = self.replicas[i].clock
      if id(clock) not in drawn:
        try:
          drawn[id(clock)] = clock.next_block(n)
        except clock_lib.StalledError as e:
          drawn[id(clock)] = e
      if isinstance(drawn[id(clock)], clock_lib.StalledError):
        stalled[i] = drawn[id(clock)]
      else:
        blocks[i] = drawn[id(clock)]
    return blocks, stalled

  def place(self, prepared: Prepared) -> Prepared:
    """`prepared` with its inputs on the devices (`inputs.place`), from what `prepare` read ahead."""
    if prepared.host is not None:
      host, start, stop = prepared.host
      prepared.inputs, prepared.host = inputs_lib.place(self.lead.layout, host, start, stop), None
    return prepared

  def rewind(self, step: int) -> None:
    """Drops the blocks read ahead from `step` on (a checkpoint at `step`, or a stop): each clock and each
    replica's data positions back to where they were after step `step`, as if drawn block by block."""
    ahead, self.ahead = self.ahead, None
    if ahead is None or not ahead.blocks:
      return
    for clock, state in ahead.clocks.values():
      clock.load_state_dict(state)
      if step > ahead.step:
        clock.next_block(step - ahead.step)
    for r, position, done in zip(self.replicas, ahead.positions, ahead.done):
      r.positions = position if done is None else position + done[:step - ahead.step].sum(axis=0)

  def dispatch(self, state, prepared: Prepared):
    """Runs the block on the devices (asynchronously): (new state, packed measurements)."""
    return self.block_step(state, *prepared.inputs)

  def measurements(self, prepared: Prepared, measured) -> dict[str, np.ndarray]:
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
    """Replica i's share of the measurements of its `block` from step `at`: into its metrics window, and its
    training loss to its clock (`clock.feedback`). False, its failure set, when the loss is not finite.
    `reduced`: the block's host reductions for every replica at once (`reduce_measurements`; default: computed
    here for this one)."""
    r = self.replicas[i]
    if reduced is None:
      blocks = [None] * len(self.replicas)
      blocks[i] = block
      reduced = self.reduce_measurements(blocks, host)
    losses = reduced['train_loss'][i]
    if not np.all(np.isfinite(losses)):
      bad = at + int(np.argmin(np.isfinite(losses)))
      kept = None if r.checkpointer is None else r.checkpointer.latest_step()
      r.failure = TrainingDiverged(
          f'training loss is {losses[bad - at]} at step {bad + 1}; stopped, ' +
          (f'the last good checkpoint (step {kept}) is kept in {r.workdir}' if kept is not None else
           f'before its first checkpoint; its metrics are in {r.workdir}'))
      log.info('%s', r.failure)
      return False
    if id(block) not in reduced['blocks']:  # what the window takes from the clock's block: once per block
      reduced['blocks'][id(block)] = r.window.reduce_block(block)
    r.window.add_reduced(reduced['blocks'][id(block)], train_loss=losses, l2_grads=reduced['l2_grads'][i],
                         l2_params=reduced['l2_params'][i])
    if r.run.rule.uses_feedback:  # AdaSync adapts K from the loss; the other rules ignore it
      r.clock.feedback(train_loss=float(losses.mean()))
    r.sim_time, r.last_train_loss = float(block.sim_time[-1]), float(losses[-1])
    return True

  def reduce_measurements(self, blocks: list, host: dict[str, np.ndarray]) -> dict:
    """The block's per-replica reductions of the step's measurements, for every replica at once (one numpy call
    each, not one per replica): `train_loss` (R, n), the mean loss over the workers that contributed (a frozen
    replica, `None` in `blocks`, counts none), `l2_grads` (R, n) and `l2_params` (R,) means over the workers;
    `blocks` starts the cache of each clock block's own reductions (`Window.reduce_block`)."""
    lead = (slice(None),) if self.group.batched else (None,)  # (R, n, P), a run's R = 1 added
    loss, l2_grads, l2_params = host['loss'][lead], host['l2_grads'][lead], host['l2_params'][lead]
    workers = loss.shape[2]
    if len(blocks) == 1 and blocks[0] is not None:
      contributed = blocks[0].schedule.microbatches_done[None] > 0
    else:
      contributed = np.stack([np.zeros(loss.shape[1:], bool) if b is None else b.schedule.microbatches_done > 0
                              for b in blocks])
    losses = np.where(contributed, loss, 0.0).sum(2) / np.maximum(contributed.sum(2), 1)
    # x.sum(k) / count is what x.mean(k) computes (float32 stays float32), without its Python wrapper.
    return {'train_loss': losses, 'l2_grads': l2_grads.sum(2) / workers, 'l2_params': l2_params.sum(1) / workers,
            'blocks': {}}

  def record(self, prepared: Prepared, host: dict[str, np.ndarray], state, snapshot, evaluates: dict[int, bool],
             checkpoints: dict[int, bool]) -> None:
    """Each live replica's metrics row, evaluation (of `snapshot`, the consensus model), checkpoint and summary
    at the end of the block."""
    at, end = prepared.step, prepared.step + prepared.length
    evaluated = None
    reduced = self.reduce_measurements(prepared.blocks, host)
    for i in prepared.live:
      r = self.replicas[i]
      if r.failure is not None:  # diverged in the previous block, whose successor was already dispatched
        continue
      if not self.accept(i, prepared.blocks[i], host, at, reduced):
        continue
      if evaluates[i] or end % self.cadences[i].log_every == 0:
        row = {'step': end, 'sim_time': r.sim_time, 'wall_time': self.wall(r, prepared.finished), **r.window.row()}
        if self.measured:
          row = measured_time.finish_row(row, r.config.workers)
        if evaluates[i]:
          if evaluated is None:
            evaluated = self.evaluator.measure(snapshot)
          r.last_eval = evaluated[i] if self.group.batched else evaluated
          row.update({k: v for k, v in r.last_eval.items() if k != 'param_norm'})
          if r.time_to_target is None and r.last_eval['eval_accuracy'] >= r.config.target_accuracy:
            r.time_to_target = row['sim_time']
        r.writer.write(row)
      if checkpoints[i]:
        self.checkpoint(i, setup.replica_state(self.group, state, i), end)
      if end == self.cadences[i].num_steps:
        self.finish(r, end)

  def checkpoint(self, i: int, state, end: int) -> None:
    """Replica i's checkpoint at step `end`: its `state` (P, ...) (`setup.replica_state`) and the loop's meta."""
    r = self.replicas[i]
    meta = {'step': end, 'wall_time': self.wall(r), 'positions': r.positions.tolist(),
            'clock': r.clock.state_dict(), 'time_to_target': r.time_to_target, 'window': r.window.sums,
            'last_eval': r.last_eval, 'train_loss': r.last_train_loss}
    if r.writer is not None:  # the rows up to `end` are what a resume keeps: in the file before the checkpoint
      r.writer.flush()
    r.checkpointer.save(end, state, meta, copy=not self.group.batched)
    if self.measured:  # not under the next timed block: it is left out of the clock, and must not slow it
      r.checkpointer.wait()

  def finish(self, r: Replica, at: int) -> None:
    """The replica's summary, written to its workdir."""
    last_eval = r.last_eval
    measured = r.clock.summary() if self.measured else {}
    r.summary = {
        **measured,
        'steps': at, 'sim_time': r.sim_time, 'wall_time': self.wall(r),
        'final_train_loss': r.last_train_loss, 'final_eval_loss': last_eval.get('eval_loss'),
        'final_eval_accuracy': last_eval.get('eval_accuracy'), 'param_norm': last_eval.get('param_norm'),
        'time_to_target': r.time_to_target, 'num_params': self.num_params, 'replicas': self.group.size,
        **{f'final_{k}': v for k, v in last_eval.items() if k not in ('eval_loss', 'eval_accuracy', 'param_norm')},
    }
    if jax.process_index() == 0:
      atomic_files.write_json(os.path.join(r.workdir, 'summary.json'), r.summary, indent=2)

  def stall(self, i: int, error: Exception, at: int, first: bool) -> None:
    """Replica i stops: its clock raised `error` sampling the block after step `at` (`first`: before any block
    of this call, else while the block before ran)."""
    r = self.replicas[i]
    where = f'Stopped at step {at}.' if first else f'Stopped after step {at}; its metrics are in {r.workdir}.'
    r.failure = ClusterStalled(f'{error} {where}')
    log.info('%s: %s', r.workdir, r.failure)

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
    self.start_wall, start_step, last_progress = time.time(), step, time.time()
    self.last_checkpoint = self.start_wall
    for r in replicas:  # a run resumed at its end (killed before its summary was written)
      if r.config.num_steps <= step:
        self.finish(r, step)
    stop_requests = preemption.StopRequests() if stop_requests is None else stop_requests
    try:
      stop_requests.install()
      current, measured = self.prepare(step), None
      pending = []  # (block, its measurements on the devices): run, and recorded with their span's last (`defers`)
      pending_since = 0.0  # time.time() when the first of them was run
      while current is not None:
        for i, e in current.stalled.items():
          self.stall(i, e, step, first=True)
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
          self.rewind(end)
        following = next_measured = None
        # The evaluation's consensus model is taken before the next block is dispatched (it donates `state`).
        # A measured run takes it after its block's results (`measured_time`): compiling it on this thread while
        # the block runs would hold the Python lock that the block's clock reads wait for.
        snapshot = self.evaluator.consensus(state) if any(evaluates.values()) and not self.measured else None
        if self.lookahead and not any(checkpoints.values()):
          following = self.prepare(end)
        if not pending:
          pending_since = time.time()
        pending.append((current, measured))
        # Never longer than the progress period: where blocks are slow, rows, progress and a divergence stay prompt.
        flush = (not self.defers or stop or any(evaluates.values()) or any(checkpoints.values()) or
                 following is None or not following.live or following.span != current.span or
                 time.time() - pending_since >= self.progress_every_s)
        # The span's measurements joined before the next block is dispatched: their fetch waits for this block only.
        joined = (block_step_lib.join_measurements([m for _, m in pending], run.layout.platform)
                  if flush and len(pending) > 1 else None)
        if following is not None and following.live:
          state, next_measured = self.dispatch(state, following)
        if flush:
          if joined is None:
            hosts = [self.measurements(current, measured)]
          else:
            hosts = block_step_lib.measurements_to_host_each(joined, [m.shape[-2] for _, m in pending])
          current.finished = time.time()
          if self.measured and any(evaluates.values()):
            snapshot = self.evaluator.consensus(state)
          for (block, _), host in zip(pending, hosts):
            if block is current:
              self.record(current, host, state, snapshot, evaluates, checkpoints)
            else:  # recorded with its span: no evaluation or checkpoint at its end (those end a span's records)
              none = {i: False for i in block.live}
              self.record(block, host, state, None, evaluates=none, checkpoints=none)
          pending = []
          if following is not None and any(replicas[i].failure is not None for i in following.live):
            self.rewind(following.step + following.length)  # the blocks after it are read without the failed
        else:
          jax.block_until_ready(measured)  # at most this block and the next in flight, as without `defers`
          current.finished = time.time()
        if any(checkpoints.values()):
          self.last_checkpoint = time.time()
        step = end
        if flush and (time.time() - last_progress >= self.progress_every_s or not self.running(step)):
          last_progress = time.time()
          self.log_progress(step, live, num_steps, (step - start_step) / max(time.time() - self.start_wall, 1e-9))
        if stop and self.running(step):
          raise preemption.Preempted(step, ', '.join(replicas[i].workdir for i in self.running(step)),
                                     stop_requests.signal_name)
        if following is None:
          current = self.prepare(step) if self.running(step) else None
          measured = None
        else:
          for i, e in following.stalled.items():  # found while this block ran: it stops after this block
            self.stall(i, e, step, first=False)
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
    replicas = self.replicas
    losses = [replicas[i].last_train_loss for i in live if not replicas[i].failure]
    log.info('step %d/%d  loss %.4f  %s %.2fs  %.1f steps/s  ETA %.0fs', step, num_steps,
             float(np.mean(losses)) if losses else float('nan'), 'measured' if self.lead.measured else 'sim',
             max(replicas[i].sim_time for i in live), rate, (num_steps - step) / max(rate, 1e-9))
