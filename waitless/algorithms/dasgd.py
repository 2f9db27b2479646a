"""DaSGD: local SGD with delayed averaging.

Update rule for worker i (tau = `local_steps`, d = `delay`, 0 <= d <= tau):
    W_i <- W_i + U_i(g_i)                                   (local step, local optimizer state)
    after step t with (t+1) mod tau == 0:  s_i <- W_i, start the all-reduce of the snapshots
    after step t + d:  `local_progress` (default, choice):  W_i <- mean(s) + (W_i - s_i)
                       `mix` (the authors' code, below):    W_i <- p W_i + (1 - p) mean(s),  p = `mix`
d = 0 is a blocking average: with `local_progress` exactly local SGD with H = tau. Only weights are averaged;
the optimizer state (momentum) stays local. The mechanism (snapshot, all-reduce, apply through carried state)
is `algorithms.delayed_averaging`, shared with LAP-SGD.

Overlap: the period is fixed, so the spec declares `round_length = tau`. On accelerators a block of whole rounds
runs each round unrolled with static positions (`experiments.harness.block_step.rounds_pay_off`; on CPU nothing
overlaps): the all-reduce of the snapshot carried from the previous round is issued at position 0 with no conditional
around it and consumed after the local step at position d - 1, so XLA can run it under d local steps. Other
blocks (and library loops) take the per-iteration path, whose conditionals read the schedule's uniform fields;
both give the same trajectory.

Time (`DelayedAverage`, `cluster/rules/dasgd.py`): worker i steps without waiting; at the apply step it waits until
R = max_j(time j took the snapshot) + allreduce(P), or not at all when that is earlier: communication is
fully hidden when allreduce(P) <= d x step time, else allreduce(P) - d x step time of it is exposed per round.

Reference: Zhou et al., "DaSGD: Squeezing SGD Parallelization Performance in Distributed Training Using
Delayed Averaging", 2020 (arXiv:2006.00441). Author's defaults: tau = 4, d = 1, p = 0.25.
The authors' code: github.com/sweetwenwen/fastai-dasgd, train.py, `fit_asynchronous_average_models_one_cycle`:
`mix` with p = `update_proportion` (8/32) is their rule, and a float64 test ports their loop
line by line (tests/algorithms/test_dasgd.py). Two departures, both deliberate: `local_progress`, the default,
is the paper's description, not their code; and at d = 0 their loop mixes only the last worker (its loop
variable after the worker loop), which this module does not copy: every worker mixes. As in their code (which
mixes the state_dict entries named weight or bias), only parameters are averaged: batch-norm statistics stay
each worker's own.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from waitless import config_errors as errors
from waitless.algorithms import collectives
from waitless.algorithms import delayed_averaging
from waitless.algorithms import spec


# ---- the math ----

class DaSGDState(NamedTuple):
  """State of `dasgd` on one worker.

  Attributes:
    count: int32 (): local steps taken so far (the same on every worker).
    inner: this worker's own inner optimizer state.
    buffer: like params: the snapshot s_i in flight (see `delayed_averaging`), zeros at first.
  """
  count: jax.Array
  inner: optax.OptState
  buffer: optax.Params


def dasgd(inner: optax.GradientTransformation, local_steps: int = 4, delay: int = 1,
          correction: str = delayed_averaging.LOCAL_PROGRESS, mix: float = 0.25,
          axis_name: collectives.AxisName = None) -> optax.GradientTransformationExtraArgs:
  """Local steps of `inner`; the average of each round's snapshot is applied `delay` steps into the next.

  Args:
    inner: the optimizer U, applied by each worker to its own gradient.
    local_steps: tau >= 1, steps per round.
    delay: d in 0..tau, steps between a snapshot and applying its mean.
    correction: `local_progress` or `mix` (see the module docstring).
    mix: p in [0, 1] of the `mix` correction.
    axis_name: the worker axes; None for one worker (then the mean is the snapshot itself).

  Returns:
    A transformation whose `update(grads, state, params, *, schedule=None, step=None, round_position=None)`
    moves each worker's params. `schedule`: a `DelayedAverageSchedule` (uniform `snapshot`, `apply_average`,
    `average_age`); None (a library loop): the events of the fixed period from the step. `step`: the
    replicated iteration number (None: the state's counter). `round_position`: static step mod tau, for a
    caller that runs whole rounds.
  """
  if correction not in delayed_averaging.CORRECTIONS:
    raise ValueError(f'correction must be one of {delayed_averaging.CORRECTIONS}, got {correction!r}')
  if not (errors.is_int(local_steps) and local_steps >= 1 and errors.is_int(delay) and 0 <= delay <= local_steps):
    raise ValueError(f'need local_steps >= 1 and 0 <= delay <= local_steps, got {local_steps}, {delay}')
  inner = optax.with_extra_args_support(inner)
  options = dict(axis_name=axis_name, correction=correction, mix=mix)

  @spec.owns_its_buffers
  def init_fn(params):
    return DaSGDState(count=jnp.zeros((), jnp.int32), inner=inner.init(params),
                      buffer=delayed_averaging.init(params))

  def update_fn(grads, state, params=None, *, schedule=None, step: Optional[jax.Array] = None,
                round_position: Optional[int] = None, **extra):
    del extra
    stepped, inner_state = spec.local_step('dasgd', inner, grads, state.inner, params)
    t = state.count if step is None else step
    if round_position is not None:
      new_params, buffer = delayed_averaging.round_step(
          stepped, state.buffer, round_position, local_steps, delay, in_flight=t >= local_steps, **options)
    else:
      events = (delayed_averaging.schedule_at(t, local_steps, delay) if schedule is None
                else delayed_averaging.events(schedule))
      new_params, buffer = delayed_averaging.step(stepped, state.buffer, *events, **options)
    updates = jax.tree.map(lambda new, old: new - old, new_params, params)
    return updates, DaSGDState(count=optax.safe_increment(state.count), inner=inner_state, buffer=buffer)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ---- config glue ----

def validate(config):
  a = config.algorithm
  errors.require_int(a.local_steps, 'algorithm.local_steps', 1)
  errors.require(errors.is_int(a.delay) and 0 <= a.delay <= a.local_steps,
                 'algorithm.delay', a.delay,
                 f'must be an integer in 0..algorithm.local_steps (= {a.local_steps})')
  errors.require(a.correction in delayed_averaging.CORRECTIONS, 'algorithm.correction', a.correction,
                 f'must be one of {", ".join(delayed_averaging.CORRECTIONS)}')
  errors.require(errors.is_number(a.mix) and 0.0 <= a.mix <= 1.0, 'algorithm.mix', a.mix,
                 'must be a number in [0, 1]')


def round_length(config):
  """tau: the snapshot (end of a round) and the apply (d steps into the next) repeat every tau steps."""
  return config.algorithm.local_steps


SPEC = spec.AlgorithmSpec(
    name='dasgd',
    defaults={'local_steps': 4, 'delay': 1, 'correction': delayed_averaging.LOCAL_PROGRESS, 'mix': 0.25},
    build=lambda config, inner, axis_name: dasgd(
        inner, local_steps=config.algorithm.local_steps, delay=config.algorithm.delay,
        correction=config.algorithm.correction, mix=config.algorithm.mix, axis_name=axis_name),
    validate=validate, round_length=round_length, hyperparameters=('mix',))
