"""Non-blocking SGD (He & Dube): micro-batches, a round cut at a trigger, every worker gives what it finished.

Each worker's batch of b samples is split into m micro-batches of b/m. In round t every worker starts from
the same W_t and runs micro-batches back to back, summing their gradients; at the trigger (the first worker
to finish all m, or a time budget) worker i has finished n_i in 0..m micro-batches with gradient sum G_i.
The micro-batch in progress is abandoned and its samples are NOT consumed: the worker's data stream resumes
there next round. Update rule (topology='allreduce'):
    weighting='microbatch' (default):  g = (sum_i G_i) / (sum_i n_i)
    weighting='worker':                g = mean over {i : n_i > 0} of G_i / n_i
    W_{t+1} = W_t + U(g)                                  (U: the inner optimizer, identical on every worker)
The step hands `update` the per-worker mean G_i / max(n_i, 1) (experiments/step.py), so the all-reduce sums
w_i * (G_i / n_i) and w_i with w_i = n_i ('microbatch': that is G_i) or w_i = [n_i > 0] ('worker') in one
collective, and divides. With no stragglers (n_i = m for all) both are sync SGD with batch b per worker and
optax.MultiSteps accumulation over m micro-batches; with m = 1 it is sync restricted to the finishers.
topology='ring' (decentralized, choice): D-PSGD gossip of the models in place of the all-reduce, in the
`gossip_then_step` order of `algorithms/dpsgd.py`: worker i steps with its own g_i = G_i / n_i (no step, inner
state kept, when n_i = 0), then mixes with its ring neighbours,
    W_i <- mix(W + U(g))_i,
so the two weightings coincide (each worker's step uses only its own micro-batches).
Time per round (`NonBlocking` below): min_i (time for worker i to finish m micro-batches) + activation
(log2 P network latencies) + allreduce(P) (ring: 2 p2p(M)).

Reference: He & Dube, "Accelerating Parallel Stochastic Gradient Descent via Non-blocking Mini-batches".
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import optax

import config_errors as errors
from algorithms import collectives
from algorithms import dpsgd
from algorithms import spec
from cluster import network as network_lib
from cluster import rules
from cluster.rules import synchronous

if TYPE_CHECKING:
  from cluster.clock import Clock

TRIGGERS = ('fastest', 'deadline')
TOPOLOGIES = ('allreduce', 'ring')
WEIGHTINGS = ('microbatch', 'worker')


class NonBlockingState(NamedTuple):
  inner: optax.OptState  # the inner optimizer's state (identical on every worker with the all-reduce; each
  #                        worker's own with the ring)


def nonblocking_sgd(inner: optax.GradientTransformation, weighting: str = 'microbatch',
                    topology: str = 'allreduce',
                    axis_name: collectives.AxisName = None) -> optax.GradientTransformationExtraArgs:
  """Combine the workers' partial gradient sums by finished micro-batches (all-reduce) or gossip (ring).

  Args:
    inner: the optimizer U.
    weighting: 'microbatch' (g = sum G_i / sum n_i) or 'worker' (mean of G_i / n_i over workers with n_i > 0).
    topology: 'allreduce' or 'ring' (see the module docstring).
    axis_name: the worker axes; None for one worker (then this is `inner` on the worker's own mean gradient).

  Returns:
    A transformation whose `update(grads, state, params, *, schedule=None, **extra)` expects `grads` =
    G_i / max(n_i, 1) (the worker's mean over its finished micro-batches) and `schedule.microbatches_done` =
    n_i. `schedule=None` (a library user's loop) means every worker finished its whole batch.
  """
  if weighting not in WEIGHTINGS:
    raise ValueError(f'weighting={weighting!r} must be one of {WEIGHTINGS}')
  if topology not in TOPOLOGIES:
    raise ValueError(f'topology={topology!r} must be one of {TOPOLOGIES}')
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return NonBlockingState(inner=inner.init(params))

  def allreduce(grads, state, params, done):
    weight = done if weighting == 'microbatch' else (done > 0)
    weighted = jax.tree.map(lambda g: g * weight.astype(g.dtype), grads)
    # One collective for the numerator and the count; the float32 count is exact up to 2^24 micro-batches.
    total, count = collectives.worker_sum((weighted, weight.astype(jnp.float32)), axis_name)
    # The rule never ends a round with no finished micro-batch; max(., 1) only keeps 0/0 out of a failed run.
    g = jax.tree.map(lambda s: s / jnp.maximum(count, 1.0).astype(s.dtype), total)
    updates, inner_state = inner.update(g, state.inner, params)
    return updates, NonBlockingState(inner=inner_state)

  def ring(grads, state, params, done):
    updates, inner_state = inner.update(grads, state.inner, params)
    contributed = done > 0
    # A per-worker predicate: a select, not a conditional (the gossip below runs for everyone anyway).
    updates = jax.tree.map(lambda u: jnp.where(contributed, u, jnp.zeros_like(u)), updates)
    inner_state = jax.tree.map(lambda new, old: jnp.where(contributed, new, old), inner_state, state.inner)
    new_params = dpsgd.ring_mix(optax.apply_updates(params, updates), axis_name)
    return jax.tree.map(lambda new, old: new - old, new_params, params), NonBlockingState(inner=inner_state)

  def update_fn(grads, state, params=None, *, schedule=None, **extra):
    del extra
    if params is None:
      raise ValueError('nonblocking_sgd needs params (the ring topology averages models).')
    done = jnp.ones((), jnp.int32) if schedule is None else jnp.asarray(schedule.microbatches_done)
    return (allreduce if topology == 'allreduce' else ring)(grads, state, params, done)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class NonBlockingSchedule(NamedTuple):
  """Schedule of one non-blocking round."""
  microbatches_done: np.ndarray  # int32 (P,), n_i in 0..m: finished micro-batches worker i contributes (these,
  #                                and only these, are consumed from its data stream)
  abandoned: np.ndarray          # bool (P,), n_i < m: worker i dropped an unfinished micro-batch at the trigger
  UNIFORM = ()


@dataclasses.dataclass(frozen=True)
class NonBlocking(rules.TimeRule):
  """Non-blocking rounds (`nonblocking`): m micro-batches each, cut at a trigger, partial work contributed.

  All workers start round t together at S (the end of the previous round's communication) from the same W_t
  and run micro-batches back to back: micro-batch k of worker i finishes at F_{i,k}. The trigger T is
    fastest:  T = min_i F_{i,m}  (the first worker to finish all m), and the round is activated at
              A = T + ceil(log2 P) alpha: the finisher's "I am done" reaches everyone over a binomial tree of
              one network latency alpha per hop (WAGMA's activation).
    deadline: the budget B = S + deadline_s is known to every worker's clock, so A = B with no message,
              except when the round ends on an event: everyone finished all m before B
              (A = min(max_i F_{i,m} + ceil(log2 P) alpha, B)), or nobody finished even one micro-batch by B
              (choice: a round never ends empty; A = min_i F_{i,1} + ceil(log2 P) alpha).
  Worker i keeps computing until A and contributes n_i = #{k : F_{i,k} <= A}. The micro-batch it was running
  at A (if n_i < m) is abandoned: its time is lost and its samples are NOT consumed; its data stream resumes
  at that micro-batch next round. Then the contributions are all-reduced (topology='allreduce':
  allreduce(P); 'ring': D-PSGD gossip, two neighbour exchanges 2 p2p(M)) and the next round starts at
  A + communication.
  Time per round (fastest): min_i (time for worker i to finish m micro-batches) + activation + communication.
  Idle: A - F_{i,m} for workers that finished all m (they wait for the activation), else 0.
  A worker that failed contributes n_i = 0; the rule proceeds without it.
  Still idealised: every worker learns of the trigger after the worst-case ceil(log2 P) hops (the tree's
  depth; nearer workers would learn earlier), there is no progress-thread or polling overhead (a worker sees
  the signal the moment it arrives, mid-micro-batch), the all-reduce starts for everyone at A with no skew,
  and the deadline clocks are perfectly synchronised.
  Reports per round: `microbatches_mean` and `microbatches_min` (n_i over workers), `abandoned_share`
  (compute seconds lost to abandoned micro-batches / compute seconds spent, all workers).
  Reference: He & Dube, non-blocking mini-batches.

  Schedule: `NonBlockingSchedule`.
  """
  microbatches: int = 1
  trigger: str = 'fastest'
  deadline_s: Optional[float] = None
  topology: str = 'allreduce'

  schedule_type = NonBlockingSchedule
  reports = {'microbatches_mean': 'mean', 'microbatches_min': 'mean', 'abandoned_share': 'mean'}

  def __post_init__(self):
    rules.check_positive_int(self.microbatches, 'microbatches')
    if self.trigger not in TRIGGERS:
      raise ValueError(f'trigger={self.trigger!r} must be one of {TRIGGERS}')
    if self.trigger == 'deadline' and not (self.deadline_s is not None and self.deadline_s > 0):
      raise ValueError(f'trigger=deadline needs deadline_s > 0, got {self.deadline_s!r}')
    if self.topology not in TOPOLOGIES:
      raise ValueError(f'topology={self.topology!r} must be one of {TOPOLOGIES}')

  def tolerated_failures(self, workers: int) -> int:
    return workers - 1

  def iterate(self, clock: 'Clock', iteration: int) -> rules.Iteration:
    del iteration
    p, m = clock.workers, self.microbatches
    workers = np.arange(p)
    start = clock.times.max()
    finish = clock.work_each(workers, start, m)  # (P, m)
    hops = math.ceil(math.log2(p)) if p > 1 else 0
    signal = hops * clock.network.latency()
    if self.trigger == 'fastest':
      activation = finish[:, -1].min() + signal
    else:
      budget = start + self.deadline_s
      if finish[:, -1].max() <= budget:
        activation = min(finish[:, -1].max() + signal, budget)
      elif finish[:, 0].min() > budget:
        activation = finish[:, 0].min() + signal
      else:
        activation = budget
    done = (finish <= activation).sum(axis=1)
    # When the worker began the micro-batch it was running at A (S if it finished none).
    began = np.where(done > 0, finish[workers, np.maximum(done - 1, 0)], start)
    running = (done < m) & (began < activation)
    # The abandoned micro-batch was started (its compute-trace position is used up) if it began before A.
    clock.consume(workers, done + running)
    if self.topology == 'allreduce':
      comm = clock.network.allreduce(clock.model_bytes, p)
      communicated = network_lib.ring_bytes(clock.model_bytes, p)
    else:
      exchanges = synchronous.ring_neighbours(p)
      comm = exchanges * clock.network.p2p(clock.model_bytes)
      communicated = float(p * exchanges) * clock.model_bytes
    clock.times[:] = activation + comm
    spent = np.minimum(finish[:, -1], activation) - start
    lost = np.where(running, activation - began, 0.0)
    total = spent.sum()
    return rules.Iteration(
        schedule=NonBlockingSchedule(microbatches_done=done.astype(np.int32), abandoned=done < m),
        idle=np.where(done == m, activation - finish[:, -1], 0.0), bytes_communicated=communicated,
        staleness=np.zeros(p),
        measurements={'microbatches_mean': float(done.mean()), 'microbatches_min': float(done.min()),
                      'abandoned_share': float(lost.sum() / total) if total > 0 else 0.0})


def time_rule(config):
  a = config.algorithm
  return NonBlocking(microbatches=config.microbatches, trigger=a.trigger,
                     deadline_s=a.deadline_s if a.trigger == 'deadline' else None, topology=a.topology)


def validate(config):
  a = config.algorithm
  errors.require(a.trigger in TRIGGERS, 'algorithm.trigger', a.trigger, f'must be one of {", ".join(TRIGGERS)}')
  errors.require(a.weighting in WEIGHTINGS, 'algorithm.weighting', a.weighting,
                 f'must be one of {", ".join(WEIGHTINGS)}')
  errors.require(a.topology in TOPOLOGIES, 'algorithm.topology', a.topology,
                 f'must be one of {", ".join(TOPOLOGIES)}')
  if a.trigger == 'deadline':
    errors.require_number(a.deadline_s, 'algorithm.deadline_s', 'must be > 0 seconds with trigger=deadline',
                          lambda v: v > 0)
  else:
    errors.require_number(a.deadline_s, 'algorithm.deadline_s',
                          'must be >= 0 seconds (used only with trigger=deadline)', lambda v: v >= 0)


SPEC = spec.AlgorithmSpec(
    name='nonblocking',
    defaults={
        'trigger': 'fastest',        # 'fastest' (the first worker to finish m micro-batches) | 'deadline'
        'deadline_s': 0.0,           # trigger=deadline: simulated seconds per round (> 0); unused otherwise
        'weighting': 'microbatch',   # 'microbatch' (sum G_i / sum n_i) | 'worker' (mean of G_i / n_i, n_i > 0)
        'topology': 'allreduce',     # 'allreduce' | 'ring' (D-PSGD gossip of the models)
    },
    build=lambda config, inner, axis_name: nonblocking_sgd(
        inner, weighting=config.algorithm.weighting, topology=config.algorithm.topology, axis_name=axis_name),
    time_rule=time_rule, validate=validate)
