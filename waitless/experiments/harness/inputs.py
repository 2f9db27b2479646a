"""A block's inputs: its length, every worker's micro-batches read at its own data positions (or their indices),
the schedule and the steps packed (`experiments.harness.transfer`) and placed on the devices, for a run or
stacked on a replica axis for a group."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import jax
import numpy as np

from waitless.cluster import schedules
from waitless.experiments.harness import measured_time
from waitless.experiments.harness import setup
from waitless.experiments.harness import transfer
from waitless.experiments.harness import block_program


class Cadence(NamedTuple):
  """A run's step counts that place its blocks and what follows them (logs, evaluations, checkpoints), read from
  its config once: the loop consults them every block, and a config field costs a microsecond a read."""
  num_steps: int
  steps_per_call: int
  log_every: int
  eval_every: int
  checkpoint_every: int

  @classmethod
  def of(cls, config) -> 'Cadence':
    return cls(*(int(config[field]) for field in cls._fields))


def _next_boundary(step: int, config) -> int:
  candidates = [config.num_steps]
  for every in (config.log_every, config.eval_every, config.checkpoint_every):
    candidates.append((step // every + 1) * every)
  return min(candidates)


def block_length(step: int, config, round_length: int | None = None) -> int:
  """Iterations in the block starting at `step` of a run with this `config` (or its `Cadence`): never crosses a
  log, eval or checkpoint boundary.

  With a round length R the block is whole rounds where it can be (max(1, steps_per_call // R) of them); after
  a boundary that falls inside a round, a shorter block reaches the next round boundary. Lengths depend only on
  absolute step numbers, so a resumed run runs the same blocks.
  """
  limit = _next_boundary(step, config) - step
  if round_length is None:
    return min(config.steps_per_call, limit)
  if step % round_length:
    return min(round_length - step % round_length, limit)
  return min(round_length * max(1, config.steps_per_call // round_length), limit)


def _to_devices(layout, packed: transfer.Packed, leading: int = 1) -> transfer.Packed:
  """`packed` on the devices, one transfer per array, sharded on the worker dimension (after `leading` others)
  from this process's workers' rows."""
  sharding = layout.sharding(*([None] * leading))
  if jax.process_count() == 1:
    return jax.tree.map(lambda v: transfer.put(v, sharding), packed)
  shape = lambda v: v.shape[:leading] + (layout.workers,) + v.shape[leading + 1:]
  return jax.tree.map(lambda v: jax.make_array_from_process_local_data(sharding, v, shape(v)), packed)


def batch_slots(run: setup.Run, blocks) -> int:
  """Micro-batch slots in each worker's batch of these blocks: all of them, or for `run.finished_only` the most
  any worker finished in one iteration rounded up to a power of two (the same on every process). Measured
  nonblocking keeps all m: its counts change with every fit, and a new batch shape is a new program whose first
  execution is slow (it landed in the probe at n = 1 and made the fast device look slow for a block)."""
  if not run.finished_only or measured_time.counts_measured(run.config):
    return run.microbatches
  done = max(int(block.schedule.microbatches_done.max()) for block in blocks)
  return min(run.microbatches, 1 << max(done - 1, 0).bit_length())


def reads_ahead(run: setup.Run) -> bool:
  """Whether the loop may read several blocks' inputs at once (`reader.BlockReader.prepare`): where the data set
  lives on the devices (the host sends indices, a few bytes per example, so a span's inputs are small) and every
  block has all its micro-batch slots (`batch_slots`: one batch shape whatever the schedule)."""
  return run.dataset.train.resident is not None and (not run.finished_only or
                                                     measured_time.counts_measured(run.config))


def host_inputs(run: setup.Run, block, positions: np.ndarray, slots: int):
  """This process's host arrays for `block`: (the examples of every worker's micro-batches read at its own
  positions, or their indices when the data set lives on the devices; per-worker schedule fields; uniform ones),
  and the data positions after the block."""
  done = block.schedule.microbatches_done.astype(np.int64)
  starts = positions[None] + np.cumsum(done, axis=0) - done
  local_ids = run.layout.local_worker_ids()
  streams = run.dataset.train
  if streams.resident is not None:
    examples = streams.read_indices(local_ids, starts[:, local_ids], slots)
  else:
    examples = streams.read(local_ids, starts[:, local_ids], slots)
  per_worker, same = schedules.split(block.schedule)
  per_worker = {name: v[:, local_ids] for name, v in per_worker.items()}
  return (examples, per_worker, same), positions + done.sum(axis=0)


def _pack(run: setup.Run, examples, per_worker, shared, own, steps):
  if run.dataset.train.resident is not None:
    return transfer.pack(per_worker, shared, own, steps, indices=examples)
  return transfer.pack(per_worker, shared, own, steps, batches=examples)


class HostInputs(NamedTuple):
  """The inputs of a span of iterations on the host (`read_block`, `read_stacked`), placed on the devices one
  block of them at a time (`place`): the blocks prepared ahead together are read together
  (`reader.BlockReader.prepare`)."""
  packed: transfer.Packed  # host arrays; the iterations on axis 0 for a run, 1 for a group
  packing: transfer.Packing
  steps: np.ndarray        # int32 (N,)
  done: np.ndarray         # every worker's microbatches_done (the same on every process): (N, P) for a run,
                           # (R, N, P) for a group (0 for a frozen replica)
  live: Optional[np.ndarray] = None  # a group's (R,) replicas with a block; None: a run

  @property
  def leading(self) -> int:
    """The dimensions before the workers'."""
    return 1 if self.live is None else 2


def place(layout, host: HostInputs, start: int = 0, stop: Optional[int] = None):
  """The step's (packed inputs on the devices, their packing, steps, slots) for iterations `start:stop` of `host`.

  slots: the block's gradient slots (`step.gradient_slots`); for a group, None while every live replica's
  workers are all busy (the dense program: a frozen replica's zero gradients are computed for nothing, see
  `read_stacked`)."""
  rows = (slice(None),) * (host.leading - 1) + (slice(start, stop),)
  packed = jax.tree.map(lambda x: x[rows], host.packed)
  done = host.done[rows]
  if host.live is None or not np.all(done[host.live] > 0):
    slots = block_program.gradient_slots(done, layout.devices)
  else:
    slots = None
  return _to_devices(layout, packed, host.leading), host.packing, host.steps[start:stop], slots


def read_block(run: setup.Run, block, positions: np.ndarray, step: int) -> tuple[HostInputs, np.ndarray]:
  """`block`'s inputs on the host (every worker's micro-batches at its own positions, or their indices, the
  schedule and the steps packed: `experiments.harness.transfer`), and the data positions after it."""
  (examples, per_worker, same), positions = host_inputs(run, block, positions, batch_slots(run, [block]))
  steps = np.arange(step, step + len(block.duration), dtype=np.int32)
  packed, packing = _pack(run, examples, per_worker, same, {}, steps)
  return HostInputs(packed, packing, steps, block.schedule.microbatches_done), positions


def block_inputs(run: setup.Run, block, positions: np.ndarray, step: int):
  """The step's (packed inputs, their packing, steps, slots) for `block` (`read_block`, `place`): the four
  arguments after the state, and the data positions after the block."""
  host, positions = read_block(run, block, positions, step)
  return place(run.layout, host), positions


def read_stacked(group: setup.Group, blocks: Sequence[Any], positions: Sequence[np.ndarray],
                 step: int) -> tuple[HostInputs, list[np.ndarray]]:
  """The inputs on the host of replica r's `blocks[r]` at `positions[r]`, stacked on a leading replica axis,
  and each replica's data positions after its block.

  A replica with no block (`None`: frozen, its budget spent or its run failed) gets a copy of the first
  replica's inputs with no finished micro-batch: it takes no gradient, its update is never read, and the uniform
  fields stay shared. While every live replica's worker is busy, the block runs the dense program (slots None,
  `place`), the frozen replicas' zero gradients computed for nothing: a group whose seeds' budgets end a few
  blocks apart (an `experiments.compare --sim_time` budget) does not compile a second program for its last
  blocks (a compile costs more than the tail's wasted gradients). A uniform field that every replica shares is
  read by the program once, (n,), from the first replica's rows (`transfer.unpack`), so its conditionals over it
  stay conditionals; one that differs is read as (R, n).
  """
  run = group.lead
  live = [b for b in blocks if b is not None]
  slots = batch_slots(run, live)
  made, read = [], {}
  for r, b in enumerate(blocks):
    if b is None:
      made.append(None)
      continue
    # Replicas that share a clock (`loop.share_clocks`) and a seed read the same examples at the same positions:
    # once for all of them.
    key = (id(b), group.runs[r].config.seed, positions[r].tobytes())
    if key not in read:
      read[key] = host_inputs(group.runs[r], b, positions[r], slots)
    made.append(read[key])
  first = next(m for m in made if m is not None)
  host = [first[0] if m is None else m[0] for m in made]
  after = [positions[r] if m is None else m[1] for r, m in enumerate(made)]
  stack = lambda *xs: np.stack(xs)
  examples = jax.tree.map(stack, *[h[0] for h in host])
  per_worker = jax.tree.map(stack, *[h[1] for h in host])
  frozen = np.array([m is None for m in made])
  per_worker['microbatches_done'] = np.where(frozen[:, None, None], 0, per_worker['microbatches_done'])
  shared, own = {}, {}
  for k in host[0][2]:
    if all(np.array_equal(h[2][k], host[0][2][k]) for h in host[1:]):
      shared[k] = host[0][2][k]
    else:
      own[k] = np.stack([h[2][k] for h in host])
  done = np.stack([np.zeros_like(live[0].schedule.microbatches_done) if b is None
                   else b.schedule.microbatches_done for b in blocks])  # every worker's, on every process
  steps = np.arange(step, step + len(live[0].duration), dtype=np.int32)
  packed, packing = _pack(run, examples, per_worker, shared, own, steps)
  return HostInputs(packed, packing, steps, done, live=~frozen), after


def stacked_inputs(group: setup.Group, blocks: Sequence[Any], positions: Sequence[np.ndarray], step: int):
  """The step's (packed inputs, packing, steps, slots) for replica r's `blocks[r]` at `positions[r]`
  (`read_stacked`, `place`), and each replica's data positions after its block."""
  host, after = read_stacked(group, blocks, positions, step)
  return place(group.lead.layout, host), after
