"""What an algorithm module declares so the harness can build it: its `SPEC`, the math hooks.

The spec is the whole interface between an algorithm's math and the harness: nothing else is discovered from
the algorithm's state or schedule. Its time rule lives with the other rules (`cluster/rules/NAME.py`), and
`cluster/registry.py` pairs the two. The step calls the transformation as

    updates, state = tx.update(grads, state, params, schedule=schedule, step=step)

per worker, with `schedule` the time rule's NamedTuple (its `UNIFORM` fields unbatched) and `step` the
replicated int32 iteration number: conditionals over either stay real conditionals when workers are vmapped.

Replicas (`experiments/harness/replicas.py`): several runs that differ only in their seed and in scalar hyper-parameters
train in one compiled program, those values fed as inputs. `build` then receives a config whose varying fields
are traced scalars: the optimizer's (`optimizers.HYPERPARAMETERS`) and the algorithm fields its spec lists in
`hyperparameters`. A build uses such a field only in arithmetic, and decides structure with `is_static_zero`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from waitless.algorithms import collectives


# Config default of `algorithm.activation_latency_s`, a time-rule field of the wait-avoiding collectives (WAGMA's
# group average, non-blocking SGD's trigger): one hop of their activation broadcast = a network latency (~1-5 us)
# plus the progress thread noticing the message and forwarding it (a few us); not 0 on the ideal network.
DEFAULT_ACTIVATION_LATENCY_S = 1e-5

def _no_checks(config: ml_collections.ConfigDict) -> None:
  del config


def _configured_microbatches(config: ml_collections.ConfigDict) -> int:
  return config.microbatches


def mean_of_workers(params: Any, opt_state: Any) -> Any:
  """Consensus model = the average of the workers' parameters (leading axis = workers)."""
  del opt_state
  return jax.tree.map(lambda x: jnp.mean(x, axis=0), params)


def owns_its_buffers(init_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
  """`init_fn` whose state shares no array with `params`, nor one leaf with another, so a step may donate both.

  An init that keeps the parameters themselves (DiLoCo's outer model, WAGMA's send buffer, a server copy; an
  inner optimizer such as schedule-free's z; a slice or concatenation that JAX returns unchanged) hands the
  caller's own arrays back inside the state when it runs eagerly, and a jitted step that donates params and
  state then gives XLA one buffer twice: "Attempt to donate the same buffer twice", or a crash. Every
  registered factory decorates its `init_fn` with this: each state leaf that is one of `params`' arrays, or
  repeats an earlier leaf of the state, is replaced by a copy. Under `jit` or `vmap` the leaves are tracers
  and the copy is one more (elided) op; the values are unchanged either way.
  """
  @functools.wraps(init_fn)
  def init(params):
    state = init_fn(params)
    seen = {id(x) for x in jax.tree.leaves(params) if isinstance(x, jax.Array)}

    def own(leaf):
      if not isinstance(leaf, jax.Array):
        return leaf
      if id(leaf) in seen:
        return jnp.copy(leaf)
      seen.add(id(leaf))
      return leaf
    return jax.tree.map(own, state)
  return init


def local_step(name: str, inner: optax.GradientTransformation, grads: Any, inner_state: Any,
               params: Any) -> tuple[Any, Any]:
  """(W_i + U(g_i), the inner optimizer's new state): the local step every model-averaging algorithm takes."""
  if params is None:
    raise ValueError(f'{name} needs params: it averages models, not gradients.')
  updates, inner_state = inner.update(grads, inner_state, params)
  return optax.apply_updates(params, updates), inner_state


def is_static_number(value: Any) -> bool:
  """Whether `value` is a Python or numpy number known when the program is built, not a traced value."""
  return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)


def is_static_zero(value: Any) -> bool:
  """True for a zero known when the program is built: the term it scales is left out (no momentum buffer, no
  weight decay). A traced value, a hyper-parameter that differs between the replicas of one program, keeps the
  term for every replica; for those whose value is 0 it adds exactly nothing (g + 0 v = g)."""
  return is_static_number(value) and value == 0


def no_rounds(config: ml_collections.ConfigDict) -> None:
  del config
  return None


def at_own_params(params: Any, opt_state: Any, schedule: Any, microbatch: jax.Array) -> Any:
  """Every micro-batch's gradient is taken at the worker's own parameters."""
  del opt_state, schedule, microbatch
  return params


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
  """Everything the harness needs to know about one algorithm.

  Attributes:
    name: registry name, `config.algorithm.name`.
    defaults: the `config.algorithm.*` fields it reads, with their defaults.
    build: (config, inner optimizer, axis_name) -> the per-worker optax transformation.
    validate: config -> None; raises config_errors.ConfigError for a bad value. Runs before anything compiles.
    consensus: (stacked params, stacked opt state) -> the model to evaluate (leading axis = workers).
    microbatches_per_iteration: config -> how many micro-batches each worker's batch holds per iteration (the
      most one iteration can consume: `microbatches`, or K mini-batches for K-batch-sync); the step masks
      those beyond the schedule's `microbatches_done`.
    gradient_params: (params, opt_state, schedule, microbatch index) -> the parameters at which the step
      differentiates that micro-batch, per worker (default: the worker's own params; the parameter server:
      a K-batch learner's later mini-batches at the server model it fetched in between).
    gradient_sums: `tx.update` receives each worker's gradient SUM over its finished micro-batches instead of
      their mean (for algorithms that weight a worker by the micro-batches it finished, n_i g_i: the mean
      multiplied back by n_i is a per-worker multiply that keeps XLA from folding the sum over the workers of
      a device into the gradient's own reduction; the parameter server, non-blocking SGD). Their `build` must
      build the transformation for sums.
    round_length: config -> R, the fixed period of an algorithm whose events repeat every R iterations from
      step 0, or None. With R, the step runs aligned blocks as whole rounds on accelerators (on CPU only when
      asked: `experiments.harness.block_step.BlockStep`) and calls
      `update(..., round_position=r)` with a static r in 0..R-1 (step = k R + r); other blocks, and library
      users, call it without `round_position`, and both must give the same result.
    hyperparameters: the `config.algorithm.*` fields that `build` uses only in arithmetic, so that the
      replicas of one program may differ in them (each replica's value a traced scalar; structure decided with
      `is_static_zero`). Fields that change shapes or the time rule are not listed: runs that differ in them
      compile programs of their own.
  """
  name: str
  defaults: Mapping[str, Any]
  build: Callable[[ml_collections.ConfigDict, optax.GradientTransformation, collectives.AxisName],
                  optax.GradientTransformationExtraArgs]
  validate: Callable[[ml_collections.ConfigDict], None] = _no_checks
  consensus: Callable[[Any, Any], Any] = mean_of_workers
  microbatches_per_iteration: Callable[[ml_collections.ConfigDict], int] = _configured_microbatches
  gradient_params: Callable[[Any, Any, Any, jax.Array], Any] = at_own_params
  round_length: Callable[[ml_collections.ConfigDict], Optional[int]] = no_rounds
  gradient_sums: bool = False
  hyperparameters: tuple[str, ...] = ()
