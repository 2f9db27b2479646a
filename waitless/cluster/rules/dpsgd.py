"""D-PSGD's time rule (`algorithms/dpsgd.py`): a worker waits only for its ring neighbours.

gossip_then_step: start_i(t+1) = max_{j in N(i)} c_j + 2 p2p(M); overlap: start_i(t+1) = max(c_i,
max_{j in N(i), j != i} start_j(t) + p2p(M)), with c_i = start_i + X_i.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, TYPE_CHECKING

import numpy as np

from waitless.algorithms import dpsgd
from waitless.cluster import schedules
from waitless.cluster.rules import ring
from waitless.cluster.rules.waits_for_everyone import WaitsForEveryone

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


@dataclasses.dataclass(frozen=True)
class RingGossip(WaitsForEveryone):
  """D-PSGD on a ring (`dpsgd`): a worker waits only for its ring neighbours, never for everyone.

  Worker i starts iteration t at start_i (its previous end) and finishes its gradient at
  c_i = start_i + sum_k X_{i,k}. N(i) = {i-1, i, i+1} (the distinct ones).
    gossip_then_step: it exchanges its stepped model with i-1 and i+1 once all three have computed:
        end_i = max_{j in N(i)} c_j + 2 p2p(M)    (two exchanges, counted back to back)
        Idle: max_{j in N(i)} c_j - c_i.
    overlap: every worker sends its model W_j(t) when it starts the iteration, so the neighbours' models
      travel during the gradient computation:
        end_i = max(c_i, max_{j in N(i), j != i} start_j + p2p(M))
        Idle: end_i - c_i. Idealised: both neighbours' messages travel at once (full-duplex links, no
        contention), as ALGORITHMS.md's rule states.
  Bytes: each worker sends M to each distinct neighbour per iteration.
  Reference: Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017.

  Schedule: `EveryoneSchedule` (microbatches_done = m for every worker).
  """
  microbatches: int = 1
  order: str = 'gossip_then_step'

  vectorized = True

  def __post_init__(self):
    super().__post_init__()
    if self.order not in dpsgd.ORDERS:
      raise ValueError(f'order={self.order!r} must be one of {dpsgd.ORDERS}')

  def iterate(self, clock: 'Clock', iteration: int) -> schedules.Iteration:
    del iteration
    p = clock.workers
    start = clock.times.copy()
    finished = self.everyone_computes(clock, start)
    exchanges = ring.ring_neighbours(p)
    p2p = clock.network.p2p(clock.model_bytes)
    if self.order == 'gossip_then_step':
      ready = ring.neighbourhood_max(finished)
      idle = ready - finished
      clock.times[:] = ready + exchanges * p2p
    else:
      # Worker i hears from i-1 and i+1 (np.roll by +1 / -1); for P = 2 both are the other worker, for P = 1
      # nobody sends anything.
      arrival = np.maximum(np.roll(start, 1), np.roll(start, -1)) + p2p if p > 1 else start
      end = np.maximum(finished, arrival)
      idle = end - finished
      clock.times[:] = end
    return schedules.Iteration(
        schedule=self.everyone_done(p), idle=idle,
        bytes_communicated=float(p * exchanges) * clock.model_bytes, staleness=np.zeros(p))

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> Optional[schedules.Steps]:
    """n calls of `iterate`: the compute times drawn ahead, then one iteration at a time on preallocated
    rows with the ring's wrap-around kept in two padding columns (a few small numpy operations each, the same
    float operations as `iterate`); idle after the loop. Failures: None (one `iterate` at a time)."""
    del iteration
    jobs = clock.job_seconds(n, self.microbatches)
    if jobs is None:
      return None
    p = clock.workers
    exchanges = ring.ring_neighbours(p)
    p2p = clock.network.p2p(clock.model_bytes)
    # Row k + 1 of `padded` holds the ring [x_{P-1}, x_0, ..., x_{P-1}, x_0] of this iteration's finish times
    # (gossip_then_step) or of the times after iteration k (overlap; row 0: the times before the block).
    padded = np.empty((n + 1, p + 2))
    padded[0, 1:-1] = clock.times
    padded[0, 0], padded[0, -1] = padded[0, p], padded[0, 1]
    times = np.empty((n, p))
    if self.order == 'gossip_then_step':
      ready = np.empty((n, p))
      comm = exchanges * p2p
      start = clock.times.copy()
      for k in range(n):
        row, out = padded[k + 1], ready[k]
        np.add(start, jobs[k], out=row[1:-1])
        row[0], row[-1] = row[p], row[1]
        np.maximum(row[:-2], row[2:], out=out)
        np.maximum(out, row[1:-1], out=out)
        start = times[k]
        np.add(out, comm, out=start)
      idle = ready - padded[1:, 1:-1]
    else:
      finished = np.empty((n, p))
      arrival = np.empty(p)
      for k in range(n):
        before, row = padded[k], padded[k + 1]
        np.add(before[1:-1], jobs[k], out=finished[k])
        if p > 1:
          np.maximum(before[:-2], before[2:], out=arrival)
          np.add(arrival, p2p, out=arrival)
          np.maximum(finished[k], arrival, out=row[1:-1])
        else:
          np.maximum(finished[k], before[1:-1], out=row[1:-1])
        row[0], row[-1] = row[p], row[1]
      times = padded[1:, 1:-1]
      idle = times - finished
    clock.times[:] = times[-1]
    return self.everyone_steps(idle, np.full(n, float(p * exchanges) * clock.model_bytes),
                               np.ascontiguousarray(times))


def time_rule(config):
  return RingGossip(microbatches=config.microbatches, order=config.algorithm.order)
