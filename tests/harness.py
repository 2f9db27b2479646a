"""Drives the real training harness for a few iterations and exposes what tests compare."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from waitless.cluster import schedules
from waitless.experiments.configs import synthetic
from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import loop as loop_lib
from waitless.experiments.harness import replicas
from waitless.experiments.harness import setup


def synthetic_config(arg: str = 'sync', **overrides):
  """The least-squares config with `overrides` (dotted keys allowed) applied."""
  config = synthetic.get_config(arg)
  for key, value in overrides.items():
    replicas.set_path(config, key, value)
  return config


@dataclasses.dataclass
class Trajectory:
  """What `run_iterations` saw, iteration by iteration."""
  run: setup.Run
  initial_params: Any                      # host params (P, ...) before the first iteration
  params: list[Any]                        # host params (P, ...) after each block
  positions: list[np.ndarray]              # data positions (P,) at the start of each iteration
  schedules: list[Any]                     # the clock's schedule (NamedTuple) of each iteration
  losses: np.ndarray                       # (iterations, P)
  final_state: Any = None
  block_step: block_step_lib.BlockStep | None = None  # the programs that ran (e.g. `block_step.rounds`)


def _loop(group: setup.Group, model_bytes: float, rounds: bool) -> loop_lib.Loop:
  """The production loop (`loop.Loop`) over `group`, its replicas without workdirs: it trains, writes nothing."""
  members = [loop_lib.Replica.start(run, setup.clock_for(run, model_bytes)) for run in group.runs]
  return loop_lib.Loop(group, members, block_step_lib.BlockStep(group, rounds=rounds))


def _advance(loop: loop_lib.Loop, state, step: int, n: int):
  """One block of `n` iterations from `step` through the loop's own per-block methods, as `Loop.run` calls them:
  `reader.prepare` (schedules and inputs), `dispatch` (the block step), `measurements`, and `accept` for each replica
  (its metrics window and its clock's loss feedback). Returns the new state, the `Prepared` block and the host
  measurements."""
  prepared = loop.reader.prepare(step, n)
  assert prepared is not None and not prepared.stalled and len(prepared.live) == len(loop.replicas), (
      f'every replica must run the block at step {step}')
  state, measured = loop.dispatch(state, prepared)
  host = loop.measurements(prepared, measured)
  for i in prepared.live:
    loop.accept(i, prepared.blocks[i], host, step)
  return state, prepared, host


def run_iterations(config, iterations: int, block: int = 1, rounds: bool = True) -> Trajectory:
  """Runs the production loop's per-block step (`loop.Loop`: prepare, dispatch, measurements, accept), `block`
  iterations per jitted call, recording each block's params.

  `rounds`: blocks of whole rounds run the round-structured program (`block_step.BlockStep`), as on accelerators,
  so that the tests compare it with the per-iteration path (block=1) on CPU too, where training does not use it.
  """
  run = setup.build(config)
  group = setup.as_group(run)
  state = setup.init_state(run)
  _, model_bytes = setup.param_count_and_bytes(state.params)
  loop = _loop(group, model_bytes, rounds)
  replica = loop.replicas[0]
  out = Trajectory(run=run, initial_params=jax.device_get(state.params), params=[], positions=[], schedules=[],
                   losses=np.zeros((iterations, config.workers)))
  step = 0
  while step < iterations:
    n = min(block, iterations - step)
    before = replica.positions
    state, prepared, host = _advance(loop, state, step, n)
    done = prepared.blocks[0].schedule.microbatches_done
    for k in range(n):
      out.positions.append(before + done[:k].sum(0))
      out.schedules.append(schedules.take(prepared.blocks[0].schedule, k))
    out.losses[step:step + n] = host['loss']
    out.params.append(jax.device_get(state.params))
    step += n
  out.final_state = state
  out.block_step = loop.block_step
  return out


def worker_batch(run: setup.Run, worker: int, position: int, count: int):
  """The micro-batches `position .. position+count-1` of `worker` as float64/int arrays (count, mb, ...)."""
  batch = run.dataset.train.read(np.array([worker]), np.array([[position]]), count)
  return {k: v[0, 0] for k, v in batch.items()}


def run_group_iterations(configs, iterations: int, block: int = 1, rounds: bool = True) -> list[Any]:
  """Trains `configs` as the replicas of one program (`setup.Group`) for `iterations`, `block` per jitted call,
  through the production loop's per-block step (its stacked inputs); returns each replica's host params (P, ...)
  after the last block."""
  group = setup.build_group(configs)
  state = setup.init_state(group)
  _, model_bytes = setup.param_count_and_bytes(setup.replica_state(group, state, 0).params)
  loop = _loop(group, model_bytes, rounds)
  step = 0
  while step < iterations:
    n = min(block, iterations - step)
    state, _, _ = _advance(loop, state, step, n)
    step += n
  params = jax.device_get(state.params)
  return [jax.tree.map(lambda x, r=r: x[r], params) for r in range(len(configs))]
