"""The small 1-D CNN of MNIST-1D (Greydanus, "Scaling down deep learning", 2020; its `ConvBase`).

    h1 = relu(conv(x; 25 channels, kernel 5, stride 2, padding 1))    # length 40 -> 19
    h2 = relu(conv(h1; 25 channels, kernel 3, stride 2, padding 1))   # 19 -> 10
    h3 = relu(conv(h2; 25 channels, kernel 3, stride 2, padding 1))   # 10 -> 5
    logits = dense(flatten(h3))                                       # 125 -> num_outputs

5,210 parameters for 10 classes (the paper: about 5k). Differences from the PyTorch original: Flax's default
initialisation (LeCun normal weights, zero biases) instead of PyTorch's uniform, and the flattened features
are ordered (position, channel) instead of (channel, position): a fixed permutation of the read-out weights.

Each convolution is computed as its patches times the kernel (`StridedConv1D`): the same function as
`nn.Conv`, with its parameters (names, shapes, initialisation), but a matrix product, because XLA:CPU runs
small 1-D convolutions slowly and, with a replica axis (`experiments/harness/replicas.py`), turns a
convolution with per-replica kernels into a grouped convolution.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from waitless.models import common


class StridedConv1D(nn.Module):
  """`nn.Conv(features, (k,), strides=(s,), padding=[(lo, hi)])` on (batch, length, channels), as a matrix
  product of the input's patches (batch, out, k * channels) and the kernel reshaped to (k * channels, features).

  The parameters are `nn.Conv`'s: `kernel` (k, channels, features), LeCun normal, and `bias` (features,), zeros.
  """
  features: int
  kernel_size: int
  stride: int
  padding: tuple[int, int]
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    k, s, channels = self.kernel_size, self.stride, x.shape[-1]
    kernel = self.param('kernel', nn.initializers.lecun_normal(), (k, channels, self.features), self.param_dtype)
    bias = self.param('bias', nn.initializers.zeros_init(), (self.features,), self.param_dtype)
    x = jnp.pad(x, ((0, 0), self.padding, (0, 0)))
    out = (x.shape[1] - k) // s + 1
    patches = jnp.stack([x[:, j:j + s * (out - 1) + 1:s] for j in range(k)], axis=2)  # (batch, out, k, channels)
    y = patches.reshape(patches.shape[:2] + (k * channels,)) @ kernel.reshape(k * channels, -1).astype(self.dtype)
    return y + bias.astype(self.dtype)


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
    for i, k in enumerate(self.kernel_sizes):  # named as nn.Conv's would be: the same parameter tree
      x = nn.relu(StridedConv1D(self.channels, k, stride=2, padding=(1, 1), dtype=self.dtype,
                                param_dtype=self.param_dtype, name=f'Conv_{i}')(x))
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(self.num_outputs, dtype=self.dtype, param_dtype=self.param_dtype)(x)


def build(config, num_outputs: int) -> CNN1D:
  """`model.name = cnn1d`: the paper's CNN (its sizes are fixed; `model.dtype` / `param_dtype` apply)."""
  return CNN1D(num_outputs=num_outputs, dtype=common.dtype(config, 'dtype'),
               param_dtype=common.dtype(config, 'param_dtype'))
