"""The inner optimizer U of every algorithm, from `config.optimizer`.

Fields: `name` (`sgd` or `adamw`), `learning_rate`, `momentum`, `nesterov` (sgd), `b1`, `b2`, `eps` (adamw),
`weight_decay`, `lr_schedule` (the learning-rate schedule: `constant`, `cosine`, `step`, `rsqrt`), `warmup_steps`,
and for `step` the `decay_factor` and `decay_boundaries` (fractions of `num_steps`).

Every learning-rate schedule starts with a linear warmup from 0 to `learning_rate` over `warmup_steps`
iterations. `rsqrt` is the inverse-square-root decay of the Transformer (Vaswani et al. 2017, arXiv:1706.03762,
eq. 3; flax `examples/wmt`): lr(t) = learning_rate * sqrt(warmup_steps / t) for t >= warmup_steps, i.e.
d^-0.5 * min(t^-0.5, t * warmup^-1.5) rescaled to peak at `learning_rate`.

Replicas of one program (`experiments/harness/replicas.py`) may differ in `HYPERPARAMETERS` and, except under the `step`
learning-rate schedule, in `num_steps`: those then arrive as traced scalars, used only in arithmetic. A static zero
momentum or weight decay leaves its term out; a traced one keeps it (`spec.is_static_zero`).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import spec

OPTIMIZERS = ('sgd', 'adamw')
LR_SCHEDULES = ('constant', 'cosine', 'step', 'rsqrt')
# Fields of `config.optimizer` that replicas of one program may differ in (fed as traced scalars).
HYPERPARAMETERS = ('learning_rate', 'momentum', 'weight_decay', 'b1', 'b2', 'eps')


def depends_on_num_steps(opt: ml_collections.ConfigDict) -> bool:
  """Whether `num_steps` must be a constant of the program: the `step` learning-rate schedule truncates fractions
  of it to integer boundaries, which a float32 device computation would not reproduce exactly; `cosine` takes it
  traced."""
  return opt.lr_schedule == 'step'


def cosine_decay(peak, decay_steps) -> optax.Schedule:
  """optax.cosine_decay_schedule(peak, decay_steps), the same operations, with `decay_steps` an int or a traced
  integer (replicas of one program decaying over their own number of steps)."""
  def decayed(count):
    if isinstance(decay_steps, (int, np.integer)):
      steps = float(decay_steps)  # as optax: no int -> int32 overflow in the program
    else:
      steps = decay_steps.astype(jnp.result_type(float))
    count = jnp.minimum(count, steps)
    cosine = 0.5 * (1 + jnp.cos(jnp.pi * count / steps))
    return peak * ((1 - 0.0) * cosine ** 1.0 + 0.0)
  return decayed


def learning_rate_schedule(opt: ml_collections.ConfigDict, num_steps: int) -> optax.Schedule:
  """The learning-rate schedule: linear warmup over `warmup_steps`, then `lr_schedule` until `num_steps`."""
  peak = opt.learning_rate
  if opt.lr_schedule == 'constant':
    main = optax.constant_schedule(peak)
  elif opt.lr_schedule == 'cosine':
    rest = (max(num_steps - opt.warmup_steps, 1) if isinstance(num_steps, (int, np.integer))
            else jnp.maximum(num_steps - opt.warmup_steps, 1))
    main = cosine_decay(peak, decay_steps=rest)
  elif opt.lr_schedule == 'step':
    boundaries = {int(f * num_steps) - opt.warmup_steps: opt.decay_factor for f in opt.decay_boundaries}
    main = optax.piecewise_constant_schedule(peak, {b: s for b, s in boundaries.items() if b > 0})
  elif opt.lr_schedule == 'rsqrt':
    errors.require_int(opt.warmup_steps, 'optimizer.warmup_steps', 1)
    # join_schedules counts from the boundary: t - warmup; lr * sqrt(warmup / t) from there on.
    main = lambda count: peak * jnp.sqrt(opt.warmup_steps / (count + opt.warmup_steps))
  else:
    raise ValueError(f'optimizer.lr_schedule={opt.lr_schedule!r}; allowed: {", ".join(LR_SCHEDULES)}')
  if opt.warmup_steps <= 0:
    return main
  warmup = optax.linear_schedule(0.0, peak, opt.warmup_steps)
  return optax.join_schedules([warmup, main], [opt.warmup_steps])


def make_optimizer(opt: ml_collections.ConfigDict, num_steps: int) -> optax.GradientTransformation:
  """The per-worker optimizer U (its updates are applied to that worker's own parameters)."""
  lr = learning_rate_schedule(opt, num_steps)
  if opt.name == 'sgd':
    sgd = optax.sgd(lr, momentum=None if spec.is_static_zero(opt.momentum) else opt.momentum, nesterov=opt.nesterov)
    if not spec.is_static_zero(opt.weight_decay):
      return optax.chain(optax.add_decayed_weights(opt.weight_decay), sgd)
    return sgd
  if opt.name == 'adamw':
    return optax.adamw(lr, b1=opt.get('b1', 0.9), b2=opt.get('b2', 0.999), eps=opt.get('eps', 1e-8),
                       weight_decay=opt.weight_decay)
  raise ValueError(f'optimizer.name={opt.name!r}; allowed: {", ".join(OPTIMIZERS)}')
