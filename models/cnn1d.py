"""The small 1-D CNN of MNIST-1D (Greydanus, "Scaling down deep learning", 2020; its `ConvBase`).

    h1 = relu(conv(x; 25 channels, kernel 5, stride 2, padding 1))    # length 40 -> 19
    h2 = relu(conv(h1; 25 channels, kernel 3, stride 2, padding 1))   # 19 -> 10
    h3 = relu(conv(h2; 25 channels, kernel 3, stride 2, padding 1))   # 10 -> 5
    logits = dense(flatten(h3))                                       # 125 -> num_outputs

5,210 parameters for 10 classes (the paper: about 5k). Differences from the PyTorch original: Flax's default
initialisation (LeCun normal weights, zero biases) instead of PyTorch's uniform, and the flattened features
are ordered (position, channel) instead of (channel, position): a fixed permutation of the read-out weights.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from models import common


class CNN1D(nn.Module):
  """Strided 1-D convolutions with ReLU over a (batch, length) or (batch, length, channels) input, then a
  linear read-out.

  Attributes:
    channels: feature maps of every convolution.
    kernel_sizes: one kernel size per convolution (stride 2, padding 1 each).
    num_outputs: classes (logits).
    dtype: computation dtype.
    param_dtype: parameter dtype (float64 in exactness tests).
  """
  channels: int = 25
  kernel_sizes: Sequence[int] = (5, 3, 3)
  num_outputs: int = 10
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    del train
    x = x.astype(self.dtype)
    if x.ndim == 2:
      x = x[..., None]  # one input channel
    for k in self.kernel_sizes:
      x = nn.relu(nn.Conv(self.channels, (k,), strides=(2,), padding=[(1, 1)], dtype=self.dtype,
                          param_dtype=self.param_dtype)(x))
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(self.num_outputs, dtype=self.dtype, param_dtype=self.param_dtype)(x)


def build(config, num_outputs: int) -> CNN1D:
  """`model.name = cnn1d`: the paper's CNN (its sizes are fixed; `model.dtype` / `param_dtype` apply)."""
  return CNN1D(num_outputs=num_outputs, dtype=common.dtype(config, 'dtype'),
               param_dtype=common.dtype(config, 'param_dtype'))
