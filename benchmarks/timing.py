"""Timing the jitted block step of a config, and ratios measured side by side.

A `BlockTimer` builds a run the way training does (`experiments.harness.train`: the state, one block of schedules from
the run's own clock, every worker's micro-batches, the compiled block step), runs it once to warm up, and then
times one call at a time. `round_robin` times several of them in turn, one call each per round, so that a
shared machine's load drifts hit every config alike: a ratio is the median over rounds of the two calls'
quotient in the same round, not a quotient of medians taken minutes apart.
"""

from __future__ import annotations

import time
from typing import Mapping

import jax
import numpy as np

from waitless.experiments.harness import block_program
from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import inputs as inputs_lib
from waitless.experiments.harness import setup
from waitless.experiments.harness import xla_cpu


class BlockTimer:
  """The compiled block step of `config` (n iterations per call) with its inputs, ready to be timed."""

  def __init__(self, config, n: int = 8):
    config.steps_per_call = n
    self.iterations = n
    run = setup.build(config)
    self.state = setup.init_state(run)
    _, nbytes = setup.param_count_and_bytes(self.state.params)
    clock = setup.clock_for(run, nbytes)
    self.inputs, _ = inputs_lib.block_inputs(run, clock.next_block(n), np.zeros(config.workers, np.int64), 0)
    self.step = block_step_lib.BlockStep(run)
    self.memory = self.step.lower(self.state, *self.inputs).compile().memory_analysis()
    self.seconds_per_iteration()  # compiles and warms up

  def seconds_per_iteration(self) -> float:
    """One call, timed to its results: seconds per iteration."""
    begin = time.perf_counter()
    self.state, out = self.step(self.state, *self.inputs)
    jax.block_until_ready(out)
    return (time.perf_counter() - begin) / self.iterations


def median_seconds(timer: BlockTimer, repeats: int) -> float:
  """The median over `repeats` calls of the seconds per iteration."""
  return float(np.median([timer.seconds_per_iteration() for _ in range(repeats)]))


def round_robin(timers: Mapping[str, BlockTimer], base: str, repeats: int) -> dict[str, tuple[float, float]]:
  """name -> (median seconds per iteration, median over rounds of its time / `base`'s in the same round)."""
  seconds = {name: [] for name in timers}
  for _ in range(repeats):
    for name, timer in timers.items():
      seconds[name].append(timer.seconds_per_iteration())
  reference = np.asarray(seconds[base])
  return {name: (float(np.median(s)), float(np.median(np.asarray(s) / reference))) for name, s in seconds.items()}


def gradient_ratio(config, iterations: int = 2000) -> float:
  """Micro-batch gradients the block step computes / those the simulated cluster pushes, over `iterations` of
  the config's own clock in blocks of `steps_per_call` (host only: `block_program.gradients_computed` counts what the
  program computes, `microbatches_done` what the cluster pushes)."""
  run = setup.build(config)
  clock = setup.clock_for(run, 4.0 * 10_000)
  computed = pushed = 0
  for _ in range(iterations // config.steps_per_call):
    done = clock.next_block(config.steps_per_call).schedule.microbatches_done
    computed += block_program.gradients_computed(done, run.layout.devices, run.microbatches, run.finished_only,
                                                 xla_cpu.busy_loop_pays_off(run.layout.platform))
    pushed += int(done.sum())
  return computed / max(pushed, 1)
