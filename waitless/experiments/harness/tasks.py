"""Losses and evaluation metrics per task, shared by every model and algorithm.

A task turns (model, variables, batch) into a scalar training loss and into evaluation sums. `model_state`
holds the non-parameter collections (e.g. `batch_stats`), per worker; it is updated only in training mode.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from waitless import config_errors as errors
from waitless.experiments.harness import translation


def _apply(model, params, model_state, inputs, train: bool, rng):
  variables = {'params': params, **model_state}
  rngs = {'dropout': rng} if rng is not None else None
  if train and model_state:
    out, new_state = model.apply(variables, inputs, train=True, mutable=list(model_state), rngs=rngs)
    return out, dict(new_state)
  return model.apply(variables, inputs, train=train, rngs=rngs), model_state


def _classification_loss(model, params, model_state, batch, rng):
  logits, new_state = _apply(model, params, model_state, batch['image'], True, rng)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch['label'])
  return loss.mean(), new_state


def _classification_eval(model, params, model_state, batch):
  logits, _ = _apply(model, params, model_state, batch['image'], False, None)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch['label'])
  correct = (jnp.argmax(logits, -1) == batch['label']).astype(jnp.float32)
  mask = batch['mask']
  return {'loss_sum': (loss * mask).sum(), 'correct': (correct * mask).sum(), 'count': mask.sum()}


def _regression_loss(model, params, model_state, batch, rng):
  pred, new_state = _apply(model, params, model_state, batch['image'], True, rng)
  return 0.5 * jnp.mean((pred[..., 0] - batch['label']) ** 2), new_state


def _regression_eval(model, params, model_state, batch):
  pred, _ = _apply(model, params, model_state, batch['image'], False, None)
  mask = batch['mask']
  loss = 0.5 * (pred[..., 0] - batch['label']) ** 2
  return {'loss_sum': (loss * mask).sum(), 'correct': jnp.zeros(()), 'count': mask.sum()}


def _image(batch):
  return batch['image']


@dataclasses.dataclass(frozen=True)
class Task:
  """How a model is trained and evaluated on a kind of data.

  Attributes:
    loss: (model, params, model_state, batch, rng) -> (scalar loss, new model_state).
    eval_sums: (model, params, model_state, batch) -> {'loss_sum', 'correct', 'count'} over the batch's mask.
    model_inputs: batch -> what `model.init` takes as inputs (a batch of one example at init).
    extra_eval: (model, params, dataset, config, place) -> more evaluation metrics by name (e.g. BLEU), from
      the consensus parameters on the host; `place` puts a host array where the parameters live.
  """
  loss: Callable[..., tuple[jax.Array, Any]]
  eval_sums: Callable[..., dict[str, jax.Array]]
  model_inputs: Callable[[Any], Any] = _image
  extra_eval: Callable[..., dict[str, float]] | None = None


TASKS = {
    'classification': Task(_classification_loss, _classification_eval),
    'regression': Task(_regression_loss, _regression_eval),
    'seq2seq': Task(translation.loss, translation.eval_sums, translation.model_inputs, translation.eval_bleu),
}


def get(name: str) -> Task:
  if name not in TASKS:
    raise errors.ConfigError('task', name, f'known: {", ".join(sorted(TASKS))}')
  return TASKS[name]


def model_bytes(config) -> float:
  """Bytes of one copy of the config's model parameters, from shapes only: the data set's signature (no data is
  read: `data.registry.signature`) through the task's `model_inputs`, and the model's initialisation traced with
  `jax.eval_shape` (nothing is allocated or compiled), as the training loop initialises it (`setup.init_state`)."""
  import numpy as np
  from waitless.data import registry as data_registry
  from waitless.models import registry as model_registry
  signature = data_registry.signature(config)
  model = model_registry.make_model(config.model, signature.num_classes)
  example = jax.tree.map(lambda x: np.asarray(x)[None], signature.example)
  inputs = get(signature.task).model_inputs(example)
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), inputs, train=False))
  params = variables['params'] if 'params' in variables else variables
  return float(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)))
