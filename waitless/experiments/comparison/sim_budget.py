"""A budget of simulated seconds instead of a number of iterations (experiments.compare --sim_time, benchmarks).

An asynchronous iteration is one gradient and a synchronous one P of them, so the same `num_steps` is not the same
time for every algorithm: `steps_for_sim_time` asks the run's own seeded clock how many iterations reach a
simulated time, before anything compiles, and `even_blocks` spreads evaluations over them in blocks of one length.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from waitless.cluster import registry
from waitless.cluster import clock as clock_lib
from waitless.cluster import factory as cluster_factory
from waitless.experiments.harness import tasks


MAX_STEPS = 10 ** 7  # the iterations a budget may buy without --max_steps


def steps_for_sim_time(config, sim_time: float, max_steps: Optional[int] = None, model_bytes: Optional[float] = None,
                       cost: Optional[cluster_factory.Effective] = None) -> int:
  """The iterations after which the run's simulated clock first reaches `sim_time` (at most `max_steps`).

  `config` passed `validation.validate`, and `cost` is what it returned (None: read again from the config's
  profile, `cluster.factory.effective`); `model_bytes` None: counted from the config's model.
  Drives the run's own seeded clock (`cluster.factory.make_clock`), nothing compiles: exact where the schedules
  do not depend on the training (every compute model; not AdaSync, whose K follows the loss: there the clock
  runs at K0 and the real run may end later). Without `max_steps`, a budget that the clock's pace so far puts
  beyond twice MAX_STEPS returns MAX_STEPS at once (refused by the caller) instead of running the clock that far.
  """
  nbytes = tasks.model_bytes(config) if model_bytes is None else model_bytes
  cost = cluster_factory.effective(config) if cost is None else cost
  clock = cluster_factory.make_clock(config, registry.time_rule(config), nbytes, cost)
  limit, step = max_steps or MAX_STEPS, 0
  while step < limit:
    try:
      block = clock.next_block(min(1000, limit - step))
    except clock_lib.StalledError:  # somewhere in this block: replay it one iteration at a time
      clock = cluster_factory.make_clock(config, registry.time_rule(config), nbytes, cost)
      if step:
        clock.next_block(step)
      for step in range(step + 1, limit + 1):  # noqa: B020  the search goes on from where it stopped
        try:
          clock.next_block(1)
        except clock_lib.StalledError:
          return step  # the run gets to the stall and stops there with its one line
      return limit
    reached = np.nonzero(block.sim_time >= sim_time)[0]
    if len(reached):
      return step + int(reached[0]) + 1
    step += len(block.duration)
    if max_steps is None and block.sim_time[-1] > 0 and step * sim_time / block.sim_time[-1] > 2 * limit:
      return limit  # at this pace far beyond MAX_STEPS: the caller refuses it now, not after 10^7 iterations
  return limit


def sim_time_of_steps(config, steps: int, model_bytes: Optional[float] = None,
                      cost: Optional[cluster_factory.Effective] = None) -> float:
  """The simulated time at which the run's seeded clock ends iteration `steps` (the inverse of
  `steps_for_sim_time`, whose arguments these are): `experiments.compare --sim_baseline_steps` turns the
  baseline's iterations into the budget of seconds every run gets."""
  nbytes = tasks.model_bytes(config) if model_bytes is None else model_bytes
  clock = cluster_factory.make_clock(config, registry.time_rule(config), nbytes, cost)
  done, sim_time = 0, 0.0
  while done < steps:
    block = clock.next_block(min(1000, steps - done))
    done, sim_time = done + len(block.duration), float(block.sim_time[-1])
  return sim_time


def even_blocks(config, steps: int, evals: int, max_steps: Optional[int] = None,
                cadence_steps: Optional[int] = None) -> dict[str, int]:
  """`num_steps`, `eval_every` = `log_every`, `steps_per_call` and `checkpoint_every` for about `steps`
  iterations evaluated `evals` times, such that every block of the run has the same length (a block never
  crosses an evaluation or checkpoint, and each block length compiles its own program).

  steps_per_call is the config's (a multiple of the algorithm's round, if it has one, and at most the
  evaluation period); eval_every the period steps // evals rounded up to a multiple of it, so that blocks divide
  the period (a period chosen first, then blocks dividing it, can leave blocks of one iteration: one jitted call
  and one transfer per iteration); num_steps a multiple of it: `steps` rounded up (down when that would pass
  `max_steps`); checkpoint_every the multiple of it at or past the most steps a run may have (`max_steps`, else
  `MAX_STEPS`), the same for every seed: by step, a run checkpoints at its end only, and in between at the
  config's wall-clock period (`checkpoint_every_s`), so that a kill loses at most that much of a long run and a
  short one does not spend its time saving; SIGTERM and Ctrl-C still checkpoint where they stop.
  `cadence_steps` (default `steps`) sets the cadence instead: the seeds of one comparison entry take their first
  seed's, so that they share one program
  (`experiments/harness/replicas.py`) and differ only in their own `num_steps`.
  """
  r = registry.get(config.algorithm.name).round_length(config) or 1
  every = -(-max(1, (steps if cadence_steps is None else cadence_steps) // evals) // r) * r
  per_call = r * max(1, min(config.steps_per_call, every) // r)
  every = -(-every // per_call) * per_call
  num_steps = -(-steps // every) * every
  if max_steps is not None and num_steps > max_steps:
    num_steps = max(every, max_steps // every * every)
  return {'num_steps': num_steps, 'eval_every': every, 'log_every': every, 'steps_per_call': per_call,
          'checkpoint_every': -(-(MAX_STEPS if max_steps is None else max_steps) // every) * every}
