"""Checks every config field before anything is compiled or loaded; one clear ConfigError per mistake.

`validate(config)` is the check of a run's config (`setup.build` runs it, once per run) and returns the cost
model its clock charges (`cluster.factory.Effective`), so that the cluster profile is read once.
"""

from __future__ import annotations

import ml_collections

from waitless import config_errors as errors
from waitless.algorithms import optimizers
from waitless.cluster import registry
from waitless.cluster import factory as cluster_factory
from waitless.cluster import limits
from waitless.data import registry as data_registry
from waitless.experiments.harness import duration
from waitless.experiments.harness import measured_time
from waitless.experiments.harness.ray_runtime import ray_config
from waitless.models import registry as model_registry

_POSITIVE_INT = ('an integer >= 1', lambda v: errors.is_int(v) and v >= 1)
_FRACTION = ('a number in [0, 1)', lambda v: errors.is_number(v) and 0 <= v < 1)
# `model.*` and `dataset.*` fields by name (the same name means the same thing in every workload). A field
# not listed here must be listed in tests/experiments/test_config_fuzz.py as checked when the data opens.
_MODEL_FIELDS = {
    'name': (f'one of {", ".join(sorted(model_registry.BUILDERS))}', lambda v: v in model_registry.BUILDERS),
    'dtype': (f'one of {", ".join(model_registry.DTYPES)}', lambda v: v in model_registry.DTYPES),
    'param_dtype': (f'one of {", ".join(model_registry.DTYPES)}', lambda v: v in model_registry.DTYPES),
    'hidden_sizes': ('a tuple of integers >= 1 (empty: a linear model)',
                     lambda v: isinstance(v, (tuple, list)) and all(errors.is_int(h) and h >= 1 for h in v)),
    'dropout_rate': _FRACTION,
    'attention_dropout_rate': _FRACTION,
    'max_len': _POSITIVE_INT,
}
_DATASET_FIELDS = {
    'name': (f'one of {", ".join(sorted(data_registry.BUILDERS))}', lambda v: v in data_registry.BUILDERS),
    'test_fraction': ('a number in (0, 1)', lambda v: errors.is_number(v) and 0 < v < 1),
    'augment': ('a bool', lambda v: isinstance(v, bool)),
    'packing': ('a bool', lambda v: isinstance(v, bool)),
    'shuffle_buffer': _POSITIVE_INT,
    'image_size': _POSITIVE_INT,
    'max_len': _POSITIVE_INT,
    'eval_max_len': _POSITIVE_INT,
    'vocab_size': _POSITIVE_INT,
    'max_corpus_chars': _POSITIVE_INT,
    'dim': _POSITIVE_INT,
    'num_examples': _POSITIVE_INT,
    'problem_seed': ('an integer >= 0', lambda v: errors.is_int(v) and v >= 0),
    'noise': ('a number >= 0', lambda v: errors.is_number(v) and v >= 0),
    'problem': ('one of least_squares, logistic', lambda v: v in ('least_squares', 'logistic')),
}


SEED_MAX = 2**31 - 1  # the seed reaches the replicas' program as an int32 (and the generators take any int >= 0)


def check_seeds(first_seed: int, seeds: int) -> None:
  """Raises ConfigError naming --seeds unless the seeds first_seed + 0 .. seeds-1 are all in 0..SEED_MAX."""
  errors.require_int(seeds, '--seeds', 1)
  if errors.is_int(first_seed) and 0 <= first_seed <= SEED_MAX:
    errors.require(first_seed + seeds - 1 <= SEED_MAX, '--seeds', seeds,
                   f'the last seed, config.seed + {seeds - 1} = {first_seed + seeds - 1}, must be <= {SEED_MAX}')


def _check_section(section: ml_collections.ConfigDict, prefix: str, rules) -> None:
  for key, value in section.items():
    if key in rules:
      allowed, ok = rules[key]
      errors.require(ok(value), f'{prefix}.{key}', value, f'must be {allowed}')


def validate(config: ml_collections.ConfigDict) -> cluster_factory.Effective:
  """Checks every field of `config`.

  Returns:
    The cost model the run's clock charges (`cluster.factory.validate`'s: `make_clock` takes it).

  Raises:
    errors.ConfigError: naming the first bad field, its value and what is allowed.
  """
  spec = registry.get(config.algorithm.name)
  limits.check_workers(config, ray=ray_config.is_ray(config))  # on Ray every learner has its own device
  for field in ('batch_size', 'microbatches', 'eval_batch_size'):
    errors.require_int(config[field], field, 1)
  _check_counts(config)
  # The clock's host memory: the loop draws a block of steps_per_call iterations ahead of the one running.
  limits.check_clock_memory(config, 2 * config.steps_per_call, 'steps_per_call', block_value=config.steps_per_call)
  errors.require_int(config.seed, 'seed', 0, SEED_MAX, 'the compiled programs take the seed as an int32')
  errors.require_number(config.target_accuracy, 'target_accuracy', 'must be a number in (0, 1]',
                        lambda v: 0 < v <= 1)
  errors.require_number(config.checkpoint_every_s, 'checkpoint_every_s',
                        'must be a number of seconds >= 0 (0: checkpoints at checkpoint_every steps only)',
                        lambda v: v >= 0)
  errors.require_number(config.progress_every_s, 'progress_every_s', 'must be a number of seconds > 0',
                        lambda v: v > 0)
  errors.require(config.batch_size % config.microbatches == 0, 'microbatches', config.microbatches,
                 f'must divide batch_size={config.batch_size}')
  opt = config.optimizer
  errors.require(opt.name in optimizers.OPTIMIZERS, 'optimizer.name', opt.name,
                 f'one of {", ".join(optimizers.OPTIMIZERS)}')
  errors.require(opt.lr_schedule in optimizers.LR_SCHEDULES, 'optimizer.lr_schedule', opt.lr_schedule,
                 f'one of {", ".join(optimizers.LR_SCHEDULES)}')
  errors.require_number(opt.learning_rate, 'optimizer.learning_rate', 'must be > 0', lambda v: v > 0)
  errors.require_number(opt.momentum, 'optimizer.momentum', 'must be in [0, 1)', lambda v: 0 <= v < 1)
  errors.require_number(opt.weight_decay, 'optimizer.weight_decay', 'must be >= 0', lambda v: v >= 0)
  errors.require_number(opt.decay_factor, 'optimizer.decay_factor', 'must be in (0, 1]', lambda v: 0 < v <= 1)
  boundaries = opt.decay_boundaries
  errors.require(isinstance(boundaries, (tuple, list)) and all(errors.is_number(b) and 0 < b < 1 for b in boundaries)
                 and list(boundaries) == sorted(boundaries), 'optimizer.decay_boundaries', boundaries,
                 'must be increasing fractions of num_steps in (0, 1)')
  errors.require_int(opt.warmup_steps, 'optimizer.warmup_steps', 1 if opt.lr_schedule == 'rsqrt' else 0)
  for field in ('b1', 'b2'):
    errors.require_number(opt[field], f'optimizer.{field}', 'must be in [0, 1)', lambda v: 0 <= v < 1)
  errors.require_number(opt.eps, 'optimizer.eps', 'must be > 0', lambda v: v > 0)
  if config.get('bleu') is not None:
    b = config.bleu
    errors.require_int(b.examples, 'bleu.examples', -1)
    errors.require_int(b.beam_size, 'bleu.beam_size', 1)
    errors.require_int(b.batch_size, 'bleu.batch_size', 1)
    errors.require_int(b.max_decode_len, 'bleu.max_decode_len', 0)
    errors.require_number(b.alpha, 'bleu.alpha', 'must be >= 0', lambda v: v >= 0)
  _check_section(config.model, 'model', _MODEL_FIELDS)
  _check_section(config.dataset, 'dataset', _DATASET_FIELDS)
  unknown = sorted(set(config.algorithm.keys()) - set(spec.defaults) - {'name'})
  errors.require(not unknown, 'algorithm', ', '.join(unknown),
                 f'unknown fields for {spec.name}; known: {", ".join(sorted(spec.defaults)) or "none"}')
  ray_config.validate(config)  # a runtime that cannot run the algorithm is the news, not its other fields
  measured_time.validate(config)  # first: a refused algorithm is the news, not its other fields
  spec.validate(config)
  return cluster_factory.validate(config)


_COUNTS = ('eval_every', 'log_every', 'checkpoint_every', 'steps_per_call')  # iterations, as num_steps


def _check_counts(config: ml_collections.ConfigDict) -> None:
  for field in _COUNTS:
    errors.require_int(config[field], field, 1)
  duration.validate_duration(config)  # exactly one of num_steps / num_epochs


def validate_counts(config: ml_collections.ConfigDict) -> None:
  """The checks that read the iteration counts (`num_steps`, `num_epochs` and `_COUNTS`), for a config whose
  counts were just set from one that passed `validate` (`num_epochs` resolved by `duration.resolve_num_steps`, a
  budget of simulated time): the counts themselves and the algorithm's own checks; no other field reads them."""
  _check_counts(config)
  registry.get(config.algorithm.name).validate(config)
