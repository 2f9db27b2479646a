"""One worker's micro-batch call of a config's model, to be timed: what `calibrate` and `benchmarks.call_overhead`
fit as t(s) = overhead + s x per_sample (`cluster.calibration.fit_overhead`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from waitless.data import registry as data_registry
from waitless.models import registry as model_registry


def make_call(config, size: int, seed: int = 0):
  """(jitted step, its arguments) of one worker on a micro-batch of `size` random inputs of the dataset's shape.

  The step is what one micro-batch costs a worker: the gradient of the cross-entropy at the parameters and the
  inner SGD update (no collective: one device, one worker). It returns its new state first (call it with
  `calibration.time_callable(..., carry=True)`).
  """
  dataset = data_registry.make_dataset(config)
  model = model_registry.make_model(config.model, dataset.num_classes)
  example = np.asarray(dataset.example['image'])
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.standard_normal((size,) + example.shape), jnp.float32)
  labels = jnp.asarray(rng.integers(0, dataset.num_classes, size), jnp.int32)
  params = model.init(jax.random.key(seed), images, train=False)['params']
  tx = optax.sgd(config.optimizer.learning_rate, momentum=config.optimizer.momentum or None)

  def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply({'params': params}, x, train=False),
                                                           y).mean()

  @jax.jit
  def step(state, x, y):
    params, opt_state = state
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), value

  return step, ((params, tx.init(params)), images, labels)
