"""Wide residual networks WRN-d-k (pre-activation basic blocks).

Wide Residual Networks, Zagoruyko and Komodakis, BMVC 2016 (arXiv:1605.07146).
A 3x3 conv with 16 filters, 3 stages of n = (d - 4) / 6 blocks with 16k/32k/64k filters (stride 2 at the start
of stages 2 and 3), each block BN-ReLU-conv3x3-(dropout)-BN-ReLU-conv3x3 with a 1x1 projection where the shape
changes, then BN-ReLU, global average pooling and a dense read-out. WRN-16-8: 11.0M parameters.

Called as `model.apply(variables, images, train=...)` (NHWC), `mutable=['batch_stats']` in training, and a
`dropout` rng when `dropout_rate > 0`.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from waitless.models import common


class WideBlock(nn.Module):
  """Pre-activation basic block; the projection shortcut reads the pre-activated input."""
  filters: int
  conv: Any
  norm: Any
  strides: tuple[int, int] = (1, 1)
  dropout_rate: float = 0.0

  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.relu(self.norm()(x))
    shortcut = x
    if x.shape[-1] != self.filters or self.strides != (1, 1):
      shortcut = self.conv(self.filters, (1, 1), self.strides, name='conv_proj')(y)
    y = self.conv(self.filters, (3, 3), self.strides)(y)
    y = nn.relu(self.norm()(y))
    y = nn.Dropout(self.dropout_rate, deterministic=not train)(y)
    y = self.conv(self.filters, (3, 3))(y)
    return shortcut + y


class WideResNet(nn.Module):
  """WRN-`depth`-`width`.

  Attributes:
    depth: total depth d (d - 4 divisible by 6).
    width: widening factor k.
    num_classes: logits.
    dropout_rate: dropout between the two convolutions of a block (paper: 0.3 on some runs; default 0).
    dtype: computation dtype. param_dtype: parameter dtype.
  """
  depth: int = 16
  width: int = 8
  num_classes: int = 10
  dropout_rate: float = 0.0
  base_filters: int = 16
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    if (self.depth - 4) % 6:
      raise ValueError(f'WRN depth {self.depth}: depth - 4 must be divisible by 6')
    n = (self.depth - 4) // 6
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                             padding='SAME')
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                             dtype=self.dtype, param_dtype=self.param_dtype)
    x = conv(self.base_filters, (3, 3), name='conv_init')(jnp.asarray(x, self.dtype))
    for i in range(3):
      for j in range(n):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = WideBlock(self.base_filters * self.width * 2 ** i, conv=conv, norm=norm, strides=strides,
                      dropout_rate=self.dropout_rate)(x, train)
    x = nn.relu(norm(name='bn_final')(x))
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype)(x)
    return jnp.asarray(x, self.dtype)


PRESETS = {
    'wrn16_8': dict(depth=16, width=8),
    'wrn28_10': dict(depth=28, width=10),
    # Testing only: a tiny network for end-to-end tests on CPU.
    'wrn_test': dict(depth=10, width=1, base_filters=4),
}

WRN16_8 = functools.partial(WideResNet, **PRESETS['wrn16_8'])
WRN28_10 = functools.partial(WideResNet, **PRESETS['wrn28_10'])
WRN_Test = functools.partial(WideResNet, **PRESETS['wrn_test'])  # Testing only.


def build(config, num_outputs: int) -> WideResNet:
  """`config.name` in PRESETS; `config.dropout_rate` overrides the preset's when set."""
  kwargs = common.override(common.preset(PRESETS, config), config, ('dropout_rate',))
  return WideResNet(num_classes=num_outputs, **kwargs)
