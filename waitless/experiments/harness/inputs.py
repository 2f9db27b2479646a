"""A block's inputs: its length, every worker's micro-batches read at its own data positions (or their indices),
the schedule and the steps packed (`experiments.harness.transfer`) and placed on the devices, for a run or
stacked on a replica axis for a group."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import numpy as np

from waitless.cluster import rules as rules_lib
from waitless.experiments.harness import measured_time
from waitless.experiments.harness import setup
from waitless.experiments.harness import step as step_lib
from waitless.experiments.harness import transfer


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
    return jax.device_put(packed, jax.tree.map(lambda _: sharding, packed))
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
  per_worker, same = rules_lib.base.split(block.schedule)
  per_worker = {name: v[:, local_ids] for name, v in per_worker.items()}
  return (examples, per_worker, same), positions + done.sum(axis=0)


def _pack(run: setup.Run, examples, per_worker, shared, own, steps):
  if run.dataset.train.resident is not None:
    return transfer.pack(per_worker, shared, own, steps, indices=examples)
  return transfer.pack(per_worker, shared, own, steps, batches=examples)


def block_inputs(run: setup.Run, block, positions: np.ndarray, step: int):
  """The step's (packed inputs, their spec, steps, slots) for `block`: every worker's micro-batches at its own
  positions (or their indices), the schedule and the steps packed (`experiments.harness.transfer`), the steps on the
  host (`block_step.BlockStep` picks the program by them) and the block's gradient slots (`step.gradient_slots`).

  Returns the four arguments after the state, and the data positions after the block.
  """
  (examples, per_worker, same), positions = host_inputs(run, block, positions, batch_slots(run, [block]))
  steps = np.arange(step, step + len(block.duration), dtype=np.int32)
  packed, spec = _pack(run, examples, per_worker, same, {}, steps)
  slots = step_lib.gradient_slots(block.schedule.microbatches_done, run.layout.devices)
  return (_to_devices(run.layout, packed), spec, steps, slots), positions


def stacked_inputs(group: setup.Group, blocks: Sequence[Any], positions: Sequence[np.ndarray], step: int):
  """The step's (packed inputs, spec, steps, slots) for replica r's `blocks[r]` at `positions[r]`, stacked on a
  leading replica axis, and each replica's data positions after its block.

  A replica with no block (`None`: frozen, its budget spent or its run failed) gets a copy of the first
  replica's inputs with no finished micro-batch: it takes no gradient, its update is never read, and the uniform
  fields stay shared. While every live replica's worker is busy, the block runs the dense program (slots None),
  the frozen replicas' zero gradients computed for nothing: a group whose seeds' budgets end a few blocks apart
  (an `experiments.compare --sim_time` budget) does not compile a second program for its last blocks (0.76 s
  for 10 replicas of the MNIST-1D CNN, more than the tail's wasted gradients). A uniform field that every
  replica shares is read by the program once, (n,), from the first replica's rows (`transfer.unpack`), so its
  conditionals over it stay conditionals; one that differs is read as (R, n).
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
  stack = lambda *xs: np.stack(xs)  # pylint: disable=unnecessary-lambda-assignment
  examples = jax.tree.map(stack, *[h[0] for h in host])
  per_worker = jax.tree.map(stack, *[h[1] for h in host])
  frozen = np.array([m is None for m in made])
  per_worker['microbatches_done'] = np.where(frozen[:, None, None], 0, per_worker['microbatches_done'])
  done = np.stack([np.zeros_like(live[0].schedule.microbatches_done) if b is None
                   else b.schedule.microbatches_done for b in blocks])
  shared, own = {}, {}
  for k in host[0][2]:
    if all(np.array_equal(h[2][k], host[0][2][k]) for h in host[1:]):
      shared[k] = host[0][2][k]
    else:
      own[k] = np.stack([h[2][k] for h in host])
  steps = np.arange(step, step + len(live[0].duration), dtype=np.int32)
  packed, spec = _pack(run, examples, per_worker, shared, own, steps)
  every_live_busy = all(np.all(b.schedule.microbatches_done > 0) for b in live)
  slots = None if every_live_busy else step_lib.gradient_slots(done, run.layout.devices)
  return (_to_devices(run.layout, packed, leading=2), spec, steps, slots), after


