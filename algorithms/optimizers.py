"""The inner optimizer U of every algorithm, from `config.optimizer`.

Fields: `name` (`sgd` or `adamw`), `learning_rate`, `momentum`, `nesterov`, `weight_decay`,
`schedule` (`constant`, `cosine`, `step`), `warmup_steps`, and for `step` the `decay_factor` and
`decay_boundaries` (fractions of `num_steps`).
"""

from __future__ import annotations

import ml_collections
import optax

OPTIMIZERS = ('sgd', 'adamw')
SCHEDULES = ('constant', 'cosine', 'step')


def learning_rate_schedule(opt: ml_collections.ConfigDict, num_steps: int) -> optax.Schedule:
  """Linear warmup over `warmup_steps`, then the named schedule until `num_steps`."""
  peak = opt.learning_rate
  rest = max(num_steps - opt.warmup_steps, 1)
  if opt.schedule == 'constant':
    main = optax.constant_schedule(peak)
  elif opt.schedule == 'cosine':
    main = optax.cosine_decay_schedule(peak, decay_steps=rest)
  elif opt.schedule == 'step':
    boundaries = {int(f * num_steps) - opt.warmup_steps: opt.decay_factor for f in opt.decay_boundaries}
    main = optax.piecewise_constant_schedule(peak, {b: s for b, s in boundaries.items() if b > 0})
  else:
    raise ValueError(f'optimizer.schedule={opt.schedule!r}; allowed: {", ".join(SCHEDULES)}')
  if opt.warmup_steps <= 0:
    return main
  warmup = optax.linear_schedule(0.0, peak, opt.warmup_steps)
  return optax.join_schedules([warmup, main], [opt.warmup_steps])


def make_optimizer(opt: ml_collections.ConfigDict, num_steps: int) -> optax.GradientTransformation:
  """The per-worker optimizer U (its updates are applied to that worker's own parameters)."""
  lr = learning_rate_schedule(opt, num_steps)
  if opt.name == 'sgd':
    sgd = optax.sgd(lr, momentum=opt.momentum or None, nesterov=opt.nesterov)
    if opt.weight_decay:
      return optax.chain(optax.add_decayed_weights(opt.weight_decay), sgd)
    return sgd
  if opt.name == 'adamw':
    return optax.adamw(lr, weight_decay=opt.weight_decay)
  raise ValueError(f'optimizer.name={opt.name!r}; allowed: {", ".join(OPTIMIZERS)}')
