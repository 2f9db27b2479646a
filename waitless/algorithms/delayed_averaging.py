"""Delayed averaging: snapshot a tree at one step, all-reduce it, apply the mean d local steps later.

The mechanism shared by DaSGD (`dasgd`), LAP-SGD / LPP-SGD (`lap_sgd`, `lpp_sgd`) and Streaming DiLoCo: each
worker stores a snapshot s_i of some tree (the weights, one fragment, ...), the all-reduce of the snapshots
runs while the worker keeps taking local steps, and d steps later the worker corrects its current tree W_i
with the mean:
    `local_progress`: W_i <- mean(s) + (W_i - s_i)      (DaSGD's default; LAP-SGD's W_i + (mean(s) - s_i))
    `mix`:            W_i <- p W_i + (1 - p) mean(s)     (DaSGD authors' code, cited in `dasgd`; p = `mix`)
With d = 0 the snapshot is the current tree and the average is blocking: `local_progress` gives W_i <- mean(s)
exactly (local SGD), `mix` gives p W_i + (1 - p) mean(s).

Pure per-worker functions, like every algorithm: `axis_name` names the worker axes (`collectives`), None is
one worker (the mean is the tree itself). The caller picks the tree: pass only the leaves that are averaged
(LAP: weights only, no momentum or batch-norm statistics; Streaming DiLoCo: one fragment, with one buffer per
fragment) and put the result back. Leaves must be floating point.

State: one buffer per averaged tree, `init(tree)`, the same structure as the tree (no other field). Between a
snapshot and the all-reduce it holds s_i; after the all-reduce has been issued (only inside a round, below) it
holds what was received, `received(mean, s_i)`: mean(s) - s_i for `local_progress` (applied as W_i + buffer),
mean(s) for `mix`. The per-iteration path issues the all-reduce at the apply step, so at every iteration
boundary outside a round, and at every round boundary, the buffer holds the snapshot; both paths compute the
same floating-point operations, so they give the same trajectory and a block may take either.

Two ways to run it, both applied after the iteration's local step (the caller's `W_i + U_i(g_i)`):
  `step(tree, buffer, snapshot, apply_average, average_age, ...)`: one iteration, events from the uniform
    schedule fields of `DelayedAverageSchedule` below (unbatched scalars, so the
    conditionals stay conditionals when workers are vmapped). Order, as the rule defines it: if
    apply_average and average_age > 0, apply the mean of the buffered snapshot; then, if snapshot, buffer the
    tree; then, if apply_average and average_age == 0 (d = 0), apply the blocking average of that snapshot.
    `schedule_at(step, period, delay)` gives the same fields from the step number for a fixed period (a
    library loop without a time rule).
  `round_step(tree, buffer, position, period, delay, in_flight=..., ...)`: one iteration at static
    `position` in 0..period-1 of a round whose events repeat every `period` iterations from step 0 (for a
    spec that declares `round_length = period`; the step passes `round_position`): snapshot after the last
    position; the all-reduce of the buffered snapshot is issued at position 0, before anything of the round
    depends on it and with no conditional, and consumed after the local step at position delay - 1, i.e.
    after d local steps, so XLA can run it under them. d = 0: blocking average at the last position. Needs
    0 <= delay <= period (one average in flight, always applied within the next round). `in_flight` (a
    traced bool, False in the first round) masks the apply when no snapshot was taken yet.

Use (as `algorithms/dasgd.py` does), after the local step `stepped = W_i + U_i(g_i)`:
    if round_position is not None:
      new, buffer = round_step(stepped, state.buffer, round_position, tau, d, in_flight=step >= tau,
                               axis_name=axis_name, correction=correction, mix=p)
    else:
      new, buffer = delayed_averaging.step(stepped, state.buffer, *events(schedule), axis_name=axis_name, ...)
`events(schedule)` reads the three fields by name from any schedule that has them (`DelayedAverageSchedule`,
`NodeThreadsSchedule`); `schedule_at` when there is no schedule.

Every function is written for any (possibly vmapped) per-worker pytree and issues exactly one all-reduce
(`collectives.worker_mean`) per average.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from waitless.algorithms import collectives
from waitless.algorithms import spec

LOCAL_PROGRESS = 'local_progress'
MIX = 'mix'
CORRECTIONS = (LOCAL_PROGRESS, MIX)


class DelayedAverageSchedule(NamedTuple):
  """Schedule of DaSGD: the three events of this mechanism (`cluster/rules/delayed_averaging_time.py` says when)."""
  microbatches_done: np.ndarray  # int32 (P,), = m
  snapshot: np.ndarray           # bool (), snapshot after the local step and start the all-reduce
  apply_average: np.ndarray      # bool (), apply the mean of the snapshots in flight
  average_age: np.ndarray        # int32 (), iterations between the snapshot applied and this one
  UNIFORM = ('snapshot', 'apply_average', 'average_age')


class Events(NamedTuple):
  """The uniform schedule fields this mechanism reads (shape () each)."""
  snapshot: jax.Array       # bool: buffer the tree after this iteration's local step
  apply_average: jax.Array  # bool: apply the mean of the buffered snapshot in this iteration
  average_age: jax.Array    # int32: iterations since that snapshot (0: the snapshot of this very iteration)


def _check(correction: str, mix: float) -> None:
  if correction not in CORRECTIONS:
    raise ValueError(f'correction must be one of {CORRECTIONS}, got {correction!r}')
  if spec.is_static_number(mix) and not 0.0 <= mix <= 1.0:  # a traced mix was validated in its config
    raise ValueError(f'mix must be in [0, 1], got {mix}')


def init(tree: Any) -> Any:
  """The buffer for `tree`: zeros of the same structure (no snapshot yet)."""
  return jax.tree.map(jnp.zeros_like, tree)


def events(schedule: Any) -> Events:
  """The three fields, read by name from a schedule (`DelayedAverageSchedule`, `NodeThreadsSchedule`, ...)."""
  return Events(schedule.snapshot, schedule.apply_average, schedule.average_age)


def schedule_at(step, period: int, delay: int) -> Events:
  """The events of a fixed period (snapshot after every `period`-th step, applied `delay` steps later).

  What `cluster.rules.dasgd.DelayedAverage` produces for 0 <= delay <= period; works on ints and
  traced ints.
  """
  step = jnp.asarray(step, jnp.int32)
  snapshot = (step + 1) % period == 0
  if delay == 0:
    return Events(snapshot, snapshot, jnp.zeros((), jnp.int32))
  applying = (step + 1 - delay > 0) & ((step + 1 - delay) % period == 0)
  return Events(snapshot, applying, jnp.where(applying, delay, 0).astype(jnp.int32))


def received(mean: Any, snapshot: Any, correction: str) -> Any:
  """What the buffer holds once the mean has arrived: mean - s (`local_progress`) or the mean (`mix`)."""
  if correction == LOCAL_PROGRESS:
    return jax.tree.map(lambda m, s: m - s, mean, snapshot)
  return mean


def issue(buffer: Any, axis_name: collectives.AxisName, correction: str) -> Any:
  """Starts the average of the buffered snapshots: the all-reduce, then `received(mean, s_i)`."""
  return received(collectives.worker_mean(buffer, axis_name), buffer, correction)


def apply(tree: Any, arrived: Any, correction: str, mix: float) -> Any:
  """The correction with an arrived buffer (`received`): W + (mean - s), or p W + (1 - p) mean."""
  if correction == LOCAL_PROGRESS:
    return jax.tree.map(lambda w, r: w + r, tree, arrived)
  return jax.tree.map(lambda w, m: (mix * w + (1.0 - mix) * m).astype(w.dtype), tree, arrived)


def blocking_average(tree: Any, axis_name: collectives.AxisName, correction: str, mix: float) -> Any:
  """d = 0: the snapshot is the tree itself; `local_progress` is then the plain mean (local SGD)."""
  mean = collectives.worker_mean(tree, axis_name)
  if correction == LOCAL_PROGRESS:
    return mean
  return apply(tree, mean, correction, mix)


def step(tree: Any, buffer: Any, snapshot, apply_average, average_age, *,
         axis_name: collectives.AxisName, correction: str = LOCAL_PROGRESS, mix: float = 0.25):
  """One iteration's averaging events from the schedule fields (see the module docstring for their order).

  Args:
    tree: this worker's averaged leaves after the iteration's local step.
    buffer: its buffer (holds the snapshot in flight, if any).
    snapshot, apply_average, average_age: the uniform schedule fields, unbatched scalars (`events`).
    axis_name: the worker axes; None for one worker.
    correction: `local_progress` or `mix`.
    mix: p of the `mix` correction.

  Returns:
    (new tree, new buffer).
  """
  _check(correction, mix)
  average_age = jnp.asarray(average_age)

  def delayed(operands):
    t, b = operands
    return apply(t, issue(b, axis_name, correction), correction, mix)

  tree = lax.cond(apply_average & (average_age > 0), delayed, lambda o: o[0], (tree, buffer))
  buffer = lax.cond(snapshot, lambda o: o[0], lambda o: o[1], (tree, buffer))
  tree = lax.cond(apply_average & (average_age == 0),
                  lambda t: blocking_average(t, axis_name, correction, mix), lambda t: t, tree)
  return tree, buffer


def round_step(tree: Any, buffer: Any, position: int, period: int, delay: int, *, in_flight,
               axis_name: collectives.AxisName, correction: str = LOCAL_PROGRESS, mix: float = 0.25):
  """One iteration at a static position of a round: no conditional; the all-reduce is issued at position 0.

  Same events as `step` with `schedule_at(k * period + position, period, delay)`, except that the mean of
  the buffered snapshot is computed at position 0 instead of at the apply position (same values).

  Args:
    tree, buffer: as for `step`.
    position: static int in [0, period).
    period: the round length (snapshot after position period - 1).
    delay: static d in [0, period].
    in_flight: bool, whether a snapshot was taken in the previous round (False in the first round, e.g.
      `step >= period`, an unbatched scalar): without it the apply at position delay - 1 is skipped (a
      select, not a conditional; the all-reduce of the empty buffer still runs).
    axis_name, correction, mix: as for `step`.

  Returns:
    (new tree, new buffer).
  """
  _check(correction, mix)
  if not 0 <= delay <= period or not 0 <= position < period:
    raise ValueError(f'round_step needs 0 <= delay <= period and 0 <= position < period, '
                     f'got delay={delay}, period={period}, position={position}')
  last = position == period - 1
  if delay == 0:  # the buffer keeps the snapshot, as in `step`
    return (blocking_average(tree, axis_name, correction, mix), tree) if last else (tree, buffer)
  if position == 0:  # issue the all-reduce of the snapshot carried from the previous round
    buffer = issue(buffer, axis_name, correction)
  if position == delay - 1:
    applied = apply(tree, buffer, correction, mix)
    tree = jax.tree.map(lambda new, old: jnp.where(in_flight, new, old), applied, tree)
  if last:
    buffer = tree
  return tree, buffer

