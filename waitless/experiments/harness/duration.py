"""A run's duration: exactly one of `num_steps` (iterations) and `num_epochs` (passes over the training split).

`num_epochs` is resolved once, when the training split's size is known (`setup.build`), to
steps_for_epochs(num_epochs, train_size, workers, batch_size) iterations; the config then holds that `num_steps`
and `num_epochs` None.
"""

from __future__ import annotations

import math

import ml_collections

from waitless import config_errors as errors


def steps_for_epochs(epochs: float, train_size: int, workers: int, batch_size: int) -> int:
  """Iterations that visit at least `epochs` x `train_size` examples: ceil(E N / (P B)), at least 1.

  One iteration takes the global batch P x B: `workers` x `batch_size` (per worker, all its micro-batches).
  An algorithm whose iteration takes another number of examples (K-of-P variants: K x B; LAP-SGD: a node's
  threads) counts nominal epochs of P x B examples per iteration.
  """
  return max(1, math.ceil(epochs * train_size / (workers * batch_size) - 1e-9))


def validate_duration(config: ml_collections.ConfigDict) -> None:
  """Exactly one of `num_steps` (an integer >= 1) and `num_epochs` (a number > 0) is set."""
  steps, epochs = config.get('num_steps'), config.get('num_epochs')
  errors.require((steps is None) != (epochs is None), 'num_steps, num_epochs', (steps, epochs),
                 'set exactly one of them, the other None (in the config argument, giving one unsets the other)')
  if steps is not None:
    errors.require_int(steps, 'num_steps', 1)
  else:
    errors.require_number(epochs, 'num_epochs', 'must be a number of epochs > 0', lambda v: v > 0)


def resolve_num_steps(config: ml_collections.ConfigDict, train_size: int) -> ml_collections.ConfigDict:
  """`config` itself when it sets `num_steps`; else a copy with num_steps = steps_for_epochs(...), num_epochs None."""
  if config.get('num_epochs') is None:
    return config
  resolved = config.copy_and_resolve_references()
  resolved.num_steps = steps_for_epochs(config.num_epochs, train_size, config.workers, config.batch_size)
  resolved.num_epochs = None
  return resolved
