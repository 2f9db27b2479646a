"""The timing of delayed (non-blocking) model averaging, shared by the rules that use it.

DaSGD's rule (`DelayedAverage`, `cluster/rules/dasgd.py`) and LAP-SGD / LPP-SGD's (`NodeThreads`,
`cluster/rules/lap_sgd.py`) both advance the clock with `delayed_average_step` below; their schedules carry the
fields of `algorithms.delayed_averaging.DelayedAverageSchedule`.

Both take a snapshot of every model at selected iterations, start an all-reduce of the snapshots, keep
stepping, and apply the mean some iterations later. The all-reduce can start only when every worker has
reached the snapshot, so the mean is ready at
    R = max_j (time worker j took the snapshot) + allreduce(P),
and worker i at the apply step waits until R, or not at all when R is earlier: communication is hidden when
allreduce(P) <= d x step time. A failed worker stalls the all-reduce, so these rules tolerate no failure.

Shared schedule fields (uniform: the same for every worker, shape () per iteration):
  snapshot: bool (), after this iteration's local step worker i stores s_i = W_i and the all-reduce of the
    snapshots starts.
  apply_average: bool (), in this iteration worker i applies the mean of the snapshots in flight
    (DaSGD: W_i <- mean(s) + (W_i - s_i), or the `mix` variant; LAP-SGD: W_i <- W_i + (mean(s) - s_i)).
  average_age: int32 (), iterations between the snapshot being applied and this one (0 if not applying).
    Order within an iteration: local step first; then, if apply_average and average_age > 0, apply the older
    snapshot's mean, then take the new snapshot if `snapshot`; if apply_average and average_age == 0 (delay
    d = 0), take the snapshot first and apply its mean at once (a blocking average: local SGD).
  At most one average is in flight: a snapshot that comes before the previous mean was applied (period
  shorter than the delay) first applies that mean (waiting for it), so average_age may be < d then.

`delayed_average_step` is one iteration (the reference); `delayed_average_block` is n of them at once for the
rules' vectorised `iterate_block`: the events depend on the iteration numbers only, so they are found first,
and between two events each worker's times are a running sum of its compute times.
"""

from __future__ import annotations

from typing import Callable, Optional, TYPE_CHECKING

import numpy as np

from waitless.cluster import network as network_lib

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


def delayed_average_step(clock: "Clock", iteration: int, finished: np.ndarray, snapshot: bool, delay: int):
  """Advances `clock.times` past this iteration's averaging events; returns (idle, uniform fields, bytes)."""
  p = clock.workers
  state = clock.rule_state
  pending = int(state.get('pending_iteration', -1))  # iteration of the snapshot in flight, -1: none
  end, idle = finished, np.zeros(p)
  applied, age, communicated = False, 0, 0.0
  if pending >= 0 and (iteration - pending >= delay or snapshot):
    ready = float(state['pending_ready_s'])
    end = np.maximum(finished, ready)
    idle = end - finished  # blocked on a mean that is not there yet: communication not hidden
    applied, age = True, iteration - pending
    state['pending_iteration'] = -1
  if snapshot:
    arrival = end.max()
    ready = arrival + clock.network.allreduce(clock.model_bytes, p)
    communicated = network_lib.ring_bytes(clock.model_bytes, p)
    if delay == 0:  # blocking average, as local SGD: wait for the last worker, then the all-reduce
      idle = idle + (arrival - end)
      end = np.full(p, ready)
      applied, age = True, 0
    else:
      state['pending_iteration'] = iteration
      state['pending_ready_s'] = ready
  clock.times[:] = end
  uniform = {'snapshot': np.bool_(snapshot), 'apply_average': np.bool_(applied), 'average_age': np.int32(age)}
  return idle, uniform, communicated


Chain = Callable[[np.ndarray, int, int, np.ndarray], None]


def _running_sum(times: np.ndarray, begin: int, end: int, start: np.ndarray) -> None:
  """times[begin:end] <- start + running sum of the compute seconds they hold (the additions of `iterate`)."""
  times[begin] += start
  if end - begin > 1:
    np.add.accumulate(times[begin:end], axis=0, out=times[begin:end])


def _events(pending: Optional[int], snapshot: np.ndarray, delay: int):
  """Where a block's averaging events fall (positions in the block), from the iteration numbers alone.

  Args:
    pending: position (< 0) of the snapshot in flight when the block starts, None: none.
    snapshot: bool (n,).
    delay: d.

  Returns:
    (apply_average bool (n,), average_age int32 (n,), sorted positions of every event (apply or snapshot),
    position of the snapshot still in flight at the end or None).
  """
  n = len(snapshot)
  applies, ages = np.zeros(n, bool), np.zeros(n, np.int32)
  stops = []
  for s in np.flatnonzero(snapshot).tolist() + [n]:  # n: the end of the block
    if pending is not None:
      a = min(max(pending + delay, 0), s)  # the first iteration with `iteration - pending >= d or snapshot`
      if a >= n:
        break
      applies[a], ages[a] = True, a - pending
      stops.append(a)
      pending = None
    if s == n:
      break
    if delay == 0:
      applies[s] = True
    else:
      pending = s
    if not stops or stops[-1] != s:
      stops.append(s)
  return applies, ages, stops, pending


def delayed_average_block(clock: "Clock", iteration: int, times: np.ndarray, snapshot: np.ndarray, delay: int,
                           chain: Chain = _running_sum):
  """n calls of `delayed_average_step` (with finished = previous times + compute seconds), for `iterate_block`.

  Args:
    clock: the clock, at iteration `iteration`; its times and `rule_state` are advanced as n calls would.
    iteration: the block's first iteration.
    times: float64 (n, P): on entry each worker's compute seconds in each iteration (unless `chain` fills
      them); on return each worker's time after each iteration.
    snapshot: bool (n,): the snapshot iterations.
    delay: d.
    chain: chain(times, begin, end, start) sets times[begin:end] to the finish times of iterations
      begin..end-1 for workers that were at `start` (P,) before `begin`, with no averaging event before `end`
      - 1; default: a running sum of the compute seconds already in `times`.

  Returns:
    (idle float64 (n, P), uniform fields as (n,) arrays, bytes float64 (n,)).
  """
  n, p = times.shape
  state = clock.rule_state
  pending = int(state.get('pending_iteration', -1))
  ready = state.get('pending_ready_s') if pending >= 0 else None
  applies, ages, stops, left = _events(pending - iteration if pending >= 0 else None, snapshot, delay)
  allreduce = clock.network.allreduce(clock.model_bytes, p)
  idle = np.zeros((n, p))
  start, begin = clock.times, 0
  for e in stops:
    chain(times, begin, e + 1, start)
    row = start = times[e]
    if ages[e] > 0:  # the mean of an earlier snapshot: wait until it is ready
      end = np.maximum(row, float(ready))
      np.subtract(end, row, out=idle[e])
      row[:] = end
    if snapshot[e]:
      arrival = row.max()
      ready = arrival + allreduce
      if delay == 0:  # blocking: wait for the last worker, then the all-reduce
        if ages[e] > 0:
          idle[e] += arrival - row
        else:
          np.subtract(arrival, row, out=idle[e])
        row[:] = ready
      else:
        state['pending_ready_s'] = ready
    begin = e + 1
  if begin < n:
    chain(times, begin, n, start)
  if stops and (delay > 0 or pending >= 0):
    state['pending_iteration'] = -1 if left is None else iteration + left
  clock.times[:] = times[-1]
  uniform = {'snapshot': snapshot.astype(bool), 'apply_average': applies, 'average_age': ages}
  communicated = np.where(snapshot, network_lib.ring_bytes(clock.model_bytes, p), 0.0)
  return idle, uniform, communicated
