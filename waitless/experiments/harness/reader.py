"""The blocks a group's replicas run next: their schedules, drawn from each replica's clock, and their inputs,
read from its data streams at its own positions and placed on the devices (`BlockReader.prepare`).

Where the data set lives on the devices, the reader draws and reads up to `AHEAD_BLOCKS` blocks at once (one clock
draw, one data read and one pack for all of them); a checkpoint or stop after an earlier one rewinds the clocks and
data positions to it (`rewind`). Schedules, data and programs are each block's own either way: the trajectory is
the same to the bit.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import numpy as np

from waitless.cluster import clock as clock_lib
from waitless.experiments.harness import inputs as inputs_lib
from waitless.experiments.harness import setup

AHEAD_BLOCKS = 16  # the most blocks `BlockReader.prepare` draws and reads at once


@dataclasses.dataclass
class Prepared:
  """A block ready to dispatch: each replica's clock Block (None: frozen) and the step's inputs."""
  step: int
  blocks: list
  inputs: tuple
  stalled: dict  # replica index -> StalledError raised while sampling this block: it stops before it
  seconds: float = 0.0  # host seconds spent preparing it (a measured run's clock counts them)
  host: Optional[tuple] = None  # (inputs.HostInputs, start, stop): its inputs on the host, until `place`
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
  """Blocks drawn and read together with the one being run (`BlockReader.prepare`), and where their span started, to go
  back to the end of any of them (`BlockReader.rewind`)."""
  blocks: list        # the Prepared blocks not handed out yet, in order
  step: int           # the first step of the span
  clocks: dict        # id(clock) -> (clock, its state_dict at `step`)
  positions: list     # each replica's data positions at `step`
  done: list          # each replica's microbatches_done (N, P) over the span (None: frozen)


def share_clocks(replicas: list) -> None:
  """Replicas that would draw the same simulated times share one clock, so that each block is sampled once for
  them: the step sizes of a sweep at one seed. A group's runs differ only in fields that change no time rule
  (`replicas.replica_fields`), so equal seeds give equal clocks; they must also be in the same state (e.g. after
  a restore), and the rule must not adapt to the loss (AdaSync: each replica's own feedback); a measured run
  times its own program. Same draws, same schedules: only the host's work is shared."""
  leaders: dict[tuple, object] = {}
  for r in replicas:
    if r.done or r.run.measured or r.run.rule.uses_feedback or not isinstance(r.clock, clock_lib.Clock):
      continue
    key = (r.config.seed, type(r.run.rule))  # not the rule itself: some hold a function (local SGD's period)
    leader = leaders.setdefault(key, r)
    if leader is not r and leader.clock.state_dict() == r.clock.state_dict():
      r.clock = leader.clock


class BlockReader:
  """Prepares the next blocks of a group's replicas (`loop.Replica`: each one's run, clock and data positions).

  Attributes:
    reads_ahead: whether `prepare` draws and reads several blocks at once (a run that looks ahead, whose data
      set lives on the devices: `inputs.reads_ahead`).
    ahead: the blocks read ahead and not handed out yet, or None.
  """

  def __init__(self, group: setup.Group, replicas: list, lookahead: bool, checkpoint_due: Callable[[], bool]):
    """`lookahead`: the loop dispatches a block before the last one's results are read (then blocks may be read
    ahead); `checkpoint_due`: whether the wall-clock checkpoint period has passed (then one block at a time)."""
    self.group, self.lead, self.replicas = group, group.lead, replicas
    self.cadences = [inputs_lib.Cadence.of(r.config) for r in replicas]
    self.checkpoint_due = checkpoint_due
    self.reads_ahead = lookahead and inputs_lib.reads_ahead(self.lead)
    self.ahead: Optional[Ahead] = None
    share_clocks(replicas)

  def running(self, at: int) -> list[int]:
    """The replicas that go on after step `at`."""
    return [i for i, (r, c) in enumerate(zip(self.replicas, self.cadences)) if not r.done and c.num_steps > at]

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
      return Prepared(at, blocks, (), stalled)
    positions = [r.positions for r in self.replicas]
    if self.group.batched:
      host, after = inputs_lib.read_stacked(self.group, blocks, positions, at)
    else:
      host, position = inputs_lib.read_block(run, blocks[0], positions[0], at)
      after = [position]
    for r, position in zip(self.replicas, after):
      r.positions = position
    if len(lengths) == 1:
      first = self.place(Prepared(at, blocks, (), stalled, host=(host, 0, None)))
    else:
      bounds = np.cumsum([0] + lengths).tolist()
      spans = list(zip(bounds[:-1], bounds[1:]))
      pieces = {id(b): [b.iterations(*span) for span in spans] for b in blocks if b is not None}
      parts = [Prepared(at + start, [None if b is None else pieces[id(b)][k] for b in blocks], (), {},
                        host=(host, start, stop)) for k, (start, stop) in enumerate(spans)]
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
