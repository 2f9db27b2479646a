"""Multi-layer perceptron; with no hidden layers it is softmax (or linear) regression."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp


class MLP(nn.Module):
  """Dense layers with ReLU, then a linear read-out of `num_outputs`.

  Attributes:
    hidden_sizes: widths of the hidden layers; () gives a linear model.
    num_outputs: classes (logits) or 1 for regression.
    dtype: computation dtype (parameters stay float32 unless `param_dtype` says otherwise).
    param_dtype: parameter dtype (float64 in the exactness tests).
  """
  hidden_sizes: Sequence[int] = (128,)
  num_outputs: int = 10
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    x = x.reshape((x.shape[0], -1)).astype(self.dtype)
    for width in self.hidden_sizes:
      x = nn.relu(nn.Dense(width, dtype=self.dtype, param_dtype=self.param_dtype)(x))
    return nn.Dense(self.num_outputs, dtype=self.dtype, param_dtype=self.param_dtype)(x)
