"""Drives the real training harness for a few iterations and exposes what tests compare."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from waitless.cluster import rules
from waitless.experiments.harness import train
from waitless.experiments.configs import synthetic


def synthetic_config(arg: str = 'sync', **overrides):
  """The least-squares config with `overrides` (dotted keys allowed) applied."""
  config = synthetic.get_config(arg)
  for key, value in overrides.items():
    node = config
    *path, last = key.split('.')
    for part in path:
      node = node[part]
    node[last] = value
  return config


@dataclasses.dataclass
class Trajectory:
  """What `run_iterations` saw, iteration by iteration."""
  run: train.Run
  initial_params: Any                      # host params (P, ...) before the first iteration
  params: list[Any]                        # host params (P, ...) after each block
  positions: list[np.ndarray]              # data positions (P,) at the start of each iteration
  schedules: list[Any]                     # the clock's schedule (NamedTuple) of each iteration
  losses: np.ndarray                       # (iterations, P)
  final_state: Any = None
  block_step: train.BlockStep | None = None  # the programs that ran (e.g. `block_step.rounds`)


def run_iterations(config, iterations: int, block: int = 1, rounds: bool = True) -> Trajectory:
  """Runs the harness's own `train.advance`, `block` iterations per jitted call, recording each block's params.

  `rounds`: blocks of whole rounds run the round-structured program (`train.BlockStep`), as on accelerators, so
  that the tests compare it with the per-iteration path (block=1) on CPU too, where training does not use it.
  """
  run = train.build(config)
  state = train.init_state(run)
  _, model_bytes = train.param_count_and_bytes(state.params)
  clock = train.make_clock(run, model_bytes)
  block_step = train.make_block_step(run, rounds=rounds)
  positions = np.zeros(config.workers, np.int64)
  out = Trajectory(run=run, initial_params=jax.device_get(state.params), params=[], positions=[], schedules=[],
                   losses=np.zeros((iterations, config.workers)))
  step = 0
  while step < iterations:
    n = min(block, iterations - step)
    before = positions
    state, measured, blk, positions = train.advance(run, block_step, state, clock, positions, step, n)
    done = blk.schedule.microbatches_done
    for k in range(n):
      out.positions.append(before + done[:k].sum(0))
      out.schedules.append(rules.base.take(blk.schedule, k))
    out.losses[step:step + n] = measured['loss']
    out.params.append(jax.device_get(state.params))
    clock.feedback(train_loss=float(measured['loss'].mean()))
    step += n
  out.final_state = state
  out.block_step = block_step
  return out


def worker_batch(run: train.Run, worker: int, position: int, count: int):
  """The micro-batches `position .. position+count-1` of `worker` as float64/int arrays (count, mb, ...)."""
  batch = run.dataset.train.read(np.array([worker]), np.array([[position]]), count)
  return {k: v[0, 0] for k, v in batch.items()}


def run_group_iterations(configs, iterations: int, block: int = 1, rounds: bool = True) -> list[Any]:
  """Trains `configs` as the replicas of one program (`train.Group`) for `iterations`, `block` per jitted call,
  through the harness's own stacked inputs; returns each replica's host params (P, ...) after the last block."""
  group = train.build_group(configs)
  state = train.init_state(group)
  _, model_bytes = train.param_count_and_bytes(train.replica_state(group, state, 0).params)
  clocks = [train.make_clock(run, model_bytes) for run in group.runs]
  block_step = train.make_block_step(group, rounds=rounds)
  positions = [np.zeros(c.workers, np.int64) for c in configs]
  step = 0
  while step < iterations:
    n = min(block, iterations - step)
    blocks = [clock.next_block(n) for clock in clocks]
    inputs, positions = train.stacked_inputs(group, blocks, positions, step)
    state, measured = block_step(state, *inputs)
    losses = train.measurements_to_host(measured)['loss']
    for clock, loss in zip(clocks, losses):
      clock.feedback(train_loss=float(loss.mean()))
    step += n
  params = jax.device_get(state.params)
  return [jax.tree.map(lambda x, r=r: x[r], params) for r in range(len(configs))]
