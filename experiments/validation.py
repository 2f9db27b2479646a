"""Checks every config field before anything is compiled or loaded; one clear ConfigError per mistake."""

from __future__ import annotations

import ml_collections

import config_errors as errors
from algorithms import optimizers
from algorithms import registry
from cluster import factory as cluster_factory


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises errors.ConfigError naming the first bad field, its value and what is allowed."""
  spec = registry.get(config.algorithm.name)
  for field in ('workers', 'devices', 'batch_size', 'microbatches', 'num_steps', 'eval_every', 'log_every',
                'checkpoint_every', 'steps_per_call', 'eval_batch_size'):
    errors.require_int(config[field], field, 1)
  errors.require_int(config.seed, 'seed', 0)
  errors.require(config.workers % config.devices == 0, 'workers', config.workers,
                 f'must be a multiple of devices={config.devices}')
  errors.require(config.batch_size % config.microbatches == 0, 'microbatches', config.microbatches,
                 f'must divide batch_size={config.batch_size}')
  opt = config.optimizer
  errors.require(opt.name in optimizers.OPTIMIZERS, 'optimizer.name', opt.name,
                 f'one of {", ".join(optimizers.OPTIMIZERS)}')
  errors.require(opt.schedule in optimizers.SCHEDULES, 'optimizer.schedule', opt.schedule,
                 f'one of {", ".join(optimizers.SCHEDULES)}')
  errors.require(opt.learning_rate > 0, 'optimizer.learning_rate', opt.learning_rate, 'must be > 0')
  errors.require(0 <= opt.momentum < 1, 'optimizer.momentum', opt.momentum, 'must be in [0, 1)')
  errors.require(opt.weight_decay >= 0, 'optimizer.weight_decay', opt.weight_decay, 'must be >= 0')
  errors.require_int(opt.warmup_steps, 'optimizer.warmup_steps', 1 if opt.schedule == 'rsqrt' else 0)
  for field in ('b1', 'b2'):
    errors.require(0 <= opt[field] < 1, f'optimizer.{field}', opt[field], 'must be in [0, 1)')
  errors.require(opt.eps > 0, 'optimizer.eps', opt.eps, 'must be > 0')
  if config.get('bleu') is not None:
    b = config.bleu
    errors.require_int(b.examples, 'bleu.examples', -1)
    errors.require_int(b.beam_size, 'bleu.beam_size', 1)
    errors.require_int(b.batch_size, 'bleu.batch_size', 1)
    errors.require_int(b.max_decode_len, 'bleu.max_decode_len', 0)
    errors.require(b.alpha >= 0, 'bleu.alpha', b.alpha, 'must be >= 0')
  unknown = sorted(set(config.algorithm.keys()) - set(spec.defaults) - {'name'})
  errors.require(not unknown, 'algorithm', ', '.join(unknown),
                 f'unknown fields for {spec.name}; known: {", ".join(sorted(spec.defaults)) or "none"}')
  spec.validate(config)
  cluster_factory.validate(config)
