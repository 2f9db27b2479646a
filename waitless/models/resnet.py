"""Residual networks: CIFAR ResNet-20/56 and ResNet-18, ImageNet ResNet-50 (after flax `examples/imagenet`).

Deep Residual Learning for Image Recognition, He, Zhang, Ren and Sun, CVPR 2016 (arXiv:1512.03385).
- CIFAR ResNet-6n+2 (paper section 4.2): a 3x3 conv with 16 filters, then 3 stages of n basic blocks with
  16/32/64 filters (stride 2 at the start of stages 2 and 3), global average pooling and a dense read-out.
  Shortcut option A (identity; stride-2 subsampling and zero channel padding where the shape changes, no
  parameters) as in the paper's CIFAR runs, or option B (1x1 projection + batch norm). ResNet-20 (n = 3):
  0.27M parameters; ResNet-56 (n = 9): 0.85M.
- ResNet-18 (CIFAR variant, as in the local SGD / decentralized SGD literature): a 3x3 stride-1 stem without
  max pooling, 4 stages of 2 basic blocks with 64/128/256/512 filters, projection shortcuts: 11.2M parameters.
- ResNet-50 (ImageNet): 7x7 stride-2 stem, 3x3 max pooling, bottleneck stages [3, 4, 6, 3]: 25.6M parameters.
  As in flax `examples/imagenet` (Goyal et al. 2017), the last batch norm of each block starts at zero scale.

Every model is called as `model.apply(variables, images, train=...)` with NHWC images; in training pass
`mutable=['batch_stats']`. `dtype` is the computation dtype (bfloat16 on accelerators), `param_dtype` the
parameters'.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

from waitless.models import common

ModuleDef = Any


def _residual_scale_init(zero_init_residual: bool):
  """Scale of a block's last norm: zeros make the block start as the identity (Goyal et al. 2017)."""
  return nn.initializers.zeros_init() if zero_init_residual else nn.initializers.ones_init()


def _projection(block: nn.Module, residual, filters: int):
  """Projection shortcut (option B): strided 1x1 conv + norm, created inside `block`'s compact call."""
  residual = block.conv(filters, (1, 1), block.strides, name='conv_proj')(residual)
  return block.norm(name='norm_proj')(residual)


class _ResidualBlock(nn.Module):
  """The fields every residual block has; `zero_init_residual` starts the block's last norm scale at 0."""
  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable = nn.relu
  strides: tuple[int, int] = (1, 1)
  shortcut: str = 'B'
  zero_init_residual: bool = False


class BasicBlock(_ResidualBlock):
  """Two 3x3 convolutions with batch norm and a shortcut (`A`: parameter-free, `B`: projection)."""

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), self.strides)(x)
    y = self.act(self.norm()(y))
    y = self.conv(self.filters, (3, 3))(y)
    y = self.norm(scale_init=_residual_scale_init(self.zero_init_residual))(y)
    if residual.shape != y.shape:
      if self.shortcut == 'A':
        # Option A: subsample, then pad the new channels with zeros (no parameters).
        residual = residual[:, ::self.strides[0], ::self.strides[1], :]
        extra = self.filters - residual.shape[-1]
        residual = jnp.pad(residual, ((0, 0), (0, 0), (0, 0), (extra // 2, extra - extra // 2)))
      else:
        residual = _projection(self, residual, self.filters)
    return self.act(residual + y)


class BottleneckBlock(_ResidualBlock):
  """1x1 -> 3x3 -> 1x1 (x4 filters) bottleneck with a projection shortcut where the shape changes."""
  zero_init_residual: bool = True

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.act(self.norm()(self.conv(self.filters, (1, 1))(x)))
    y = self.act(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
    y = self.conv(self.filters * 4, (1, 1))(y)
    y = self.norm(scale_init=_residual_scale_init(self.zero_init_residual))(y)
    if residual.shape != y.shape:
      residual = _projection(self, residual, self.filters * 4)
    return self.act(residual + y)


class ResNet(nn.Module):
  """A residual network: stem, stages of blocks, global average pooling, dense logits.

  Attributes:
    stage_sizes: blocks per stage.
    num_filters: filters of the first stage; doubled at each later stage.
    num_classes: logits.
    block: `BasicBlock` or `BottleneckBlock`.
    stem: `cifar` (3x3 stride-1 conv) or `imagenet` (7x7 stride-2 conv + 3x3 max pooling).
    stem_filters: filters of the stem conv (None: `num_filters`).
    shortcut: `A` (parameter-free, CIFAR ResNet-20/56) or `B` (projection).
    zero_init_residual: start the last batch norm scale of each block at zero.
    dtype: computation dtype. param_dtype: parameter dtype.
  """
  stage_sizes: Sequence[int]
  num_filters: int = 64
  num_classes: int = 10
  block: str = 'basic'
  stem: str = 'cifar'
  stem_filters: int | None = None
  shortcut: str = 'B'
  zero_init_residual: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                             padding='SAME')
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                             dtype=self.dtype, param_dtype=self.param_dtype)
    x = jnp.asarray(x, self.dtype)
    stem_filters = self.stem_filters or self.num_filters
    if self.stem == 'imagenet':
      x = conv(stem_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name='conv_init')(x)
      x = nn.relu(norm(name='bn_init')(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding='SAME')
    else:
      x = conv(stem_filters, (3, 3), name='conv_init')(x)
      x = nn.relu(norm(name='bn_init')(x))
    block_cls = BottleneckBlock if self.block == 'bottleneck' else BasicBlock
    for i, size in enumerate(self.stage_sizes):
      for j in range(size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = block_cls(self.num_filters * 2 ** i, conv=conv, norm=norm, strides=strides,
                      shortcut=self.shortcut, zero_init_residual=self.zero_init_residual)(x)
    x = jnp.mean(x, axis=(1, 2))
    x = nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype)(x)
    return jnp.asarray(x, self.dtype)


PRESETS = {
    'resnet20': dict(stage_sizes=(3, 3, 3), num_filters=16, shortcut='A'),
    'resnet56': dict(stage_sizes=(9, 9, 9), num_filters=16, shortcut='A'),
    'resnet18': dict(stage_sizes=(2, 2, 2, 2), num_filters=64),
    'resnet50': dict(stage_sizes=(3, 4, 6, 3), num_filters=64, block='bottleneck', stem='imagenet',
                     zero_init_residual=True),
    # Testing only: tiny networks for end-to-end tests on CPU.
    'resnet_test': dict(stage_sizes=(1, 1), num_filters=4, shortcut='A'),
    'resnet50_test': dict(stage_sizes=(1, 1), num_filters=4, block='bottleneck', stem='imagenet',
                          zero_init_residual=True),
}

ResNet20 = functools.partial(ResNet, **PRESETS['resnet20'])
ResNet56 = functools.partial(ResNet, **PRESETS['resnet56'])
ResNet18 = functools.partial(ResNet, **PRESETS['resnet18'])
ResNet50 = functools.partial(ResNet, **PRESETS['resnet50'])
# Testing only.
ResNet_Test = functools.partial(ResNet, **PRESETS['resnet_test'])
ResNet50_Test = functools.partial(ResNet, **PRESETS['resnet50_test'])


def build(config, num_outputs: int) -> ResNet:
  """`config.name` in PRESETS; `config.shortcut` (A/B) overrides the preset's when set."""
  kwargs = common.override(common.preset(PRESETS, config), config, ('shortcut',))
  return ResNet(num_classes=num_outputs, **kwargs)
