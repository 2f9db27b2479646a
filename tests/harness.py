"""Drives the real training harness for a few iterations and exposes what tests compare."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from cluster import rules
from experiments import train
from experiments.configs import synthetic


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
