"""Non-blocking SGD (He & Dube): micro-batches, a round cut at a trigger, every worker gives what it finished.

Each worker's batch of b samples is split into m micro-batches of b/m. In round t every worker starts from
the same W_t and runs micro-batches back to back, summing their gradients; at the trigger (the first worker
to finish all m, or a time budget) worker i has finished n_i in 0..m micro-batches with gradient sum G_i.
The micro-batch in progress is abandoned and its samples are NOT consumed: the worker's data stream resumes
there next round. Update rule (topology='allreduce'):
    weighting='microbatch' (default):  g = (sum_i G_i) / (sum_i n_i)
    weighting='worker':                g = mean over {i : n_i > 0} of G_i / n_i
    W_{t+1} = W_t + U(g)                                  (U: the inner optimizer, identical on every worker)
The harness's step hands `update` each worker's gradient SUM G_i (`GRADIENT_SUMS`, the spec's
`gradient_sums`); a library loop may hand it the mean G_i / max(n_i, 1) instead (`gradient_sums=False`). The
all-reduce sums w_i g_i and w_i in one collective and divides: 'microbatch' sums G_i itself (w_i = n_i, no
per-worker multiply with the sums), 'worker' sums the means G_i / n_i (w_i = [n_i > 0]). With no stragglers
(n_i = m for all) both are sync SGD with batch b per worker and optax.MultiSteps accumulation over m
micro-batches; with m = 1 it is sync restricted to the finishers.
topology='ring' (decentralized, choice): D-PSGD gossip of the models in place of the all-reduce, in the
`gossip_then_step` order of `algorithms/dpsgd.py`: worker i steps with its own g_i = G_i / n_i (no step, inner
state kept, when n_i = 0), then mixes with its ring neighbours,
    W_i <- mix(W + U(g))_i,
so the two weightings coincide (each worker's step uses only its own micro-batches).
Time per round (`NonBlocking`, `cluster/rules/nonblocking.py`): min_i (time for worker i to finish m
micro-batches) + activation (the first finisher's news reaches worker i after popcount(finisher XOR i) hops
of `activation_latency_s`, at most ceil(log2 P); the communication starts when the last worker has joined)
+ allreduce(P) (ring: 2 p2p(M)).
Each micro-batch is one accelerator call: with a per-call overhead o (`stragglers.overhead_s`) a worker's m
micro-batches cost m o + their per-sample parts, so splitting a batch finer pays (m - 1) o more per batch.

Reference: He & Dube, "Accelerating Parallel Stochastic Gradient Descent via Non-blocking Mini-batches".
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import collectives
from waitless.algorithms import dpsgd
from waitless.algorithms import spec

TRIGGERS = ('fastest', 'deadline')
TOPOLOGIES = ('allreduce', 'ring')
WEIGHTINGS = ('microbatch', 'worker')


class NonBlockingState(NamedTuple):
  """State of `nonblocking_sgd` on one worker.

  Attributes:
    inner: the inner optimizer's state (identical on every worker with the all-reduce; each worker's own with the
      ring).
  """
  inner: optax.OptState


def nonblocking_sgd(inner: optax.GradientTransformation, weighting: str = 'microbatch',
                    topology: str = 'allreduce', axis_name: collectives.AxisName = None,
                    gradient_sums: bool = False) -> optax.GradientTransformationExtraArgs:
  """Combine the workers' partial gradient sums by finished micro-batches (all-reduce) or gossip (ring).

  Args:
    inner: the optimizer U.
    weighting: 'microbatch' (g = sum G_i / sum n_i) or 'worker' (mean of G_i / n_i over workers with n_i > 0).
    topology: 'allreduce' or 'ring' (see the module docstring).
    axis_name: the worker axes; None for one worker (then this is `inner` on the worker's own mean gradient).
    gradient_sums: `grads` is G_i itself, the sum over the finished micro-batches (the harness's step, spec
      `gradient_sums`), not G_i / max(n_i, 1).

  Returns:
    A transformation whose `update(grads, state, params, *, schedule=None, **extra)` expects `grads` = G_i
    (with `gradient_sums`) or G_i / max(n_i, 1) (the worker's mean over its finished micro-batches) and
    `schedule.microbatches_done` = n_i, with the totals `microbatches_total` and `contributors`
    (`round_schedule`). `schedule=None` (a library user's loop) means every worker finished its whole batch;
    the count is then all-reduced.
  """
  if weighting not in WEIGHTINGS:
    raise ValueError(f'weighting={weighting!r} must be one of {WEIGHTINGS}')
  if topology not in TOPOLOGIES:
    raise ValueError(f'topology={topology!r} must be one of {TOPOLOGIES}')
  inner = optax.with_extra_args_support(inner)

  @spec.owns_its_buffers
  def init_fn(params):
    return NonBlockingState(inner=inner.init(params))

  def allreduce(grads, state, params, done, schedule):
    weight = done if weighting == 'microbatch' else (done > 0)
    if gradient_sums and weighting == 'microbatch':
      weighted = grads  # G_i = n_i (G_i / n_i): no per-worker multiply
    else:
      weighted = jax.tree.map(lambda g: g * weight.astype(g.dtype), grads)
    host_total = None  # a library loop without a schedule: the float32 count is exact up to 2^24 micro-batches
    if schedule is not None:
      host_total = schedule.microbatches_total if weighting == 'microbatch' else schedule.contributors
    total, count = collectives.worker_sum_and_count(weighted, weight.astype(jnp.float32), axis_name, host_total)
    # The rule never ends a round with no finished micro-batch; max(., 1) only keeps 0/0 out of a failed run.
    g = jax.tree.map(lambda s: s / jnp.maximum(count, 1.0).astype(s.dtype), total)
    updates, inner_state = inner.update(g, state.inner, params)
    return updates, NonBlockingState(inner=inner_state)

  def ring(grads, state, params, done, schedule):
    del schedule
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
    if gradient_sums and not (topology == 'allreduce' and weighting == 'microbatch'):  # these need the mean
      grads = jax.tree.map(lambda g: g / jnp.maximum(done, 1).astype(g.dtype), grads)
    return (allreduce if topology == 'allreduce' else ring)(grads, state, params, done, schedule)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class NonBlockingSchedule(NamedTuple):
  """Schedule of one non-blocking round (what `update` reads; `cluster/rules/nonblocking.py` writes it)."""
  microbatches_done: np.ndarray  # int32 (P,), n_i in 0..m: finished micro-batches worker i contributes (these,
  #                                and only these, are consumed from its data stream)
  abandoned: np.ndarray          # bool (P,), n_i < m: worker i dropped an unfinished micro-batch at the trigger
  microbatches_total: np.ndarray  # int32 (), sum_i n_i: the 'microbatch' weighting's divisor
  contributors: np.ndarray       # int32 (), #{i: n_i > 0}: the 'worker' weighting's divisor
  UNIFORM = ('microbatches_total', 'contributors')


def round_schedule(done: np.ndarray, m: int) -> NonBlockingSchedule:
  """The schedule of rounds whose workers finished `done` (..., P) micro-batches of m, with both weightings'
  divisors summed here, on the host (`collectives.worker_sum_and_count`)."""
  done = np.asarray(done, np.int32)
  return NonBlockingSchedule(microbatches_done=done, abandoned=done < m,
                             microbatches_total=done.sum(axis=-1, dtype=np.int32),
                             contributors=(done > 0).sum(axis=-1, dtype=np.int32))



def validate(config):
  a = config.algorithm
  errors.require(a.trigger in TRIGGERS, 'algorithm.trigger', a.trigger, f'must be one of {", ".join(TRIGGERS)}')
  errors.require(a.weighting in WEIGHTINGS, 'algorithm.weighting', a.weighting,
                 f'must be one of {", ".join(WEIGHTINGS)}')
  errors.require(a.topology in TOPOLOGIES, 'algorithm.topology', a.topology,
                 f'must be one of {", ".join(TOPOLOGIES)}')
  errors.require_number(a.activation_latency_s, 'algorithm.activation_latency_s', 'must be a number >= 0 (seconds)',
                        lambda v: v >= 0)
  if a.trigger == 'deadline':
    errors.require_number(a.deadline_s, 'algorithm.deadline_s', 'must be > 0 seconds with trigger=deadline',
                          lambda v: v > 0)
  else:
    errors.require_number(a.deadline_s, 'algorithm.deadline_s',
                          'must be >= 0 seconds (used only with trigger=deadline)', lambda v: v >= 0)


# The harness hands each worker's gradient sum G_i (the spec's `gradient_sums`), and the build takes it.
GRADIENT_SUMS = True

SPEC = spec.AlgorithmSpec(
    name='nonblocking',
    defaults={
        'trigger': 'fastest',        # 'fastest' (the first worker to finish m micro-batches) | 'deadline'
        'deadline_s': 0.0,           # trigger=deadline: simulated seconds per round (> 0); unused otherwise
        'weighting': 'microbatch',   # 'microbatch' (sum G_i / sum n_i) | 'worker' (mean of G_i / n_i, n_i > 0)
        'topology': 'allreduce',     # 'allreduce' | 'ring' (D-PSGD gossip of the models)
        # a: seconds per hop of the trigger's news over the hypercube (WAGMA's default, cluster/rules/activation.py)
        'activation_latency_s': spec.DEFAULT_ACTIVATION_LATENCY_S,
    },
    build=lambda config, inner, axis_name: nonblocking_sgd(
        inner, weighting=config.algorithm.weighting, topology=config.algorithm.topology, axis_name=axis_name,
        gradient_sums=GRADIENT_SUMS),
    validate=validate, gradient_sums=GRADIENT_SUMS)
