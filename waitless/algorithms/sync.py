"""Synchronous all-reduce SGD: the baseline every other algorithm is measured against.

Update rule (every worker, every iteration):
    g = (1/P) sum_i g_i          (all-reduce of the workers' gradients)
    W <- W + U(g)                (U: the inner optimizer, identical on every worker)
With P workers of local batch b this is single-device SGD with batch P*b.
Time per iteration: max_i X_i + allreduce(P) (`Barrier` below).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, TYPE_CHECKING

import numpy as np
import optax

from waitless.algorithms import collectives
from waitless.algorithms import spec
from waitless.cluster import network as network_lib
from waitless.cluster import rules
from waitless.cluster.rules import synchronous

if TYPE_CHECKING:
  from waitless.cluster.clock import Clock


class SyncState(NamedTuple):
  inner: optax.OptState  # the inner optimizer's state, identical on every worker


def sync_sgd(inner: optax.GradientTransformation,
             axis_name: collectives.AxisName = None) -> optax.GradientTransformationExtraArgs:
  """All-reduce the gradients over `axis_name`, then apply `inner`.

  Args:
    inner: the optimizer U (e.g. `optax.sgd(0.1, momentum=0.9)`).
    axis_name: the worker axes to average over; None for one worker (plain `inner`).

  Returns:
    A transformation whose `update(grads, state, params, **extra)` returns this worker's updates. Extra
    arguments (`schedule`) are accepted and ignored.

  Example:
    >>> tx = sync_sgd(optax.sgd(0.1), axis_name='workers')  # inside shard_map over 'workers'
  """
  inner = optax.with_extra_args_support(inner)

  @spec.owns_its_buffers
  def init_fn(params):
    return SyncState(inner=inner.init(params))

  def update_fn(grads, state, params=None, **extra):
    del extra
    grads = collectives.worker_mean(grads, axis_name)
    updates, inner_state = inner.update(grads, state.inner, params)
    return updates, SyncState(inner=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class Barrier(synchronous.WaitsForEveryone):
  """Fully synchronous: all start together, compute m micro-batches, all-reduce, everybody waits.

  Time per iteration: max_i sum_k X_{i,k} + allreduce(P).
  Idle: max_j finish_j - finish_i (the all-reduce itself is communication, not idle).

  Schedule: `EveryoneSchedule` (microbatches_done = m for every worker).
  """
  microbatches: int = 1

  vectorized = True

  def iterate(self, clock: 'Clock', iteration: int) -> rules.Iteration:
    del iteration
    p = clock.workers
    finished = self.everyone_computes(clock, clock.times.max())
    arrival = finished.max()
    clock.times[:] = arrival + clock.network.allreduce(clock.model_bytes, p)
    return rules.Iteration(
        schedule=self.everyone_done(p),
        idle=arrival - finished, bytes_communicated=network_lib.ring_bytes(clock.model_bytes, p),
        staleness=np.zeros(p))

  def iterate_block(self, clock: 'Clock', iteration: int, n: int) -> Optional[rules.Steps]:
    """n calls of `iterate` with numpy: the iteration ends are one scalar chain start + max_i X_i + allreduce
    (rounding is monotone, so max_i (start + X_i) = start + max_i X_i exactly), summed in order by
    `np.add.accumulate`. Failures: None (one `iterate` at a time)."""
    del iteration
    jobs = synchronous.job_seconds(clock, n, self.microbatches)
    if jobs is None:
      return None
    p = clock.workers
    chain = np.empty(2 * n + 1)  # start, arrival_0, end_0 (= start_1), arrival_1, end_1, ...
    chain[0] = clock.times.max()
    chain[1::2] = jobs.max(axis=1)
    chain[2::2] = clock.network.allreduce(clock.model_bytes, p)
    np.add.accumulate(chain, out=chain)
    idle = chain[1::2, None] - (chain[0:-1:2, None] + jobs)
    times = np.repeat(chain[2::2, None], p, axis=1)
    clock.times[:] = times[-1]
    return self.everyone_steps(idle, np.full(n, network_lib.ring_bytes(clock.model_bytes, p)), times)


def time_rule(config):
  return Barrier(microbatches=config.microbatches)


SPEC = spec.AlgorithmSpec(
    name='sync', defaults={},
    build=lambda config, inner, axis_name: sync_sgd(inner, axis_name=axis_name),
    time_rule=time_rule)
