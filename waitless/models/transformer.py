"""Encoder-decoder Transformer for translation (after flax `examples/wmt/models.py`).

Attention Is All You Need, Vaswani et al., NeurIPS 2017 (arXiv:1706.03762). Pre-layer-norm blocks, sinusoidal
position embeddings, one embedding table shared by the encoder, the decoder and the output logits
(`logits = y E^T / sqrt(d)`). Transformer base: d = 512, 8 heads, 6 + 6 layers, feed-forward 2048, dropout
0.1: 60.5M parameters with a 32k vocabulary (63.6M with 38k).

Token id 0 is padding (masked out of attention); the decoder input is the target shifted right by one with 0
as the start token. Called as `model.apply(variables, {'inputs': x, 'targets': y}, train=...)` -> logits
(batch, target length, vocab); in training pass `rngs={'dropout': key}`.

Packed batches (several pairs per row, `data/wmt.py`) add `inputs_segmentation` / `targets_segmentation` (1, 2,
... per pair in the row, 0 on padding) and `inputs_position` / `targets_position` (each token's index within its
pair). Attention is then restricted to tokens of the same pair, positions restart at every pair and each pair's
decoder input starts with 0, so a packed row gives every pair the logits it would get alone. `encode` and `decode` are
exposed for
autoregressive decoding: a model built with `decode=True` feeds one target token per call and keeps keys and
values in the `cache` collection (see `experiments/harness/translation.py:greedy_decode`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
from jax import lax
import jax.numpy as jnp
import numpy as np

from waitless.models import common


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Hyper-parameters of the Transformer (names as in flax `examples/wmt`)."""
  vocab_size: int = 32000
  share_embeddings: bool = True
  logits_via_embedding: bool = True
  emb_dim: int = 512
  num_heads: int = 8
  num_layers: int = 6
  qkv_dim: int = 512
  mlp_dim: int = 2048
  max_len: int = 256
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  decode: bool = False
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.xavier_uniform()
  bias_init: Callable = nn.initializers.normal(stddev=1e-6)


def shift_right(x, axis: int = 1):
  """Shifts `x` right by one along `axis`, filling with 0 (the start token)."""
  pad_widths = [(0, 0)] * x.ndim
  pad_widths[axis] = (1, 0)
  padded = jnp.pad(x, pad_widths, constant_values=0)
  return lax.slice_in_dim(padded, 0, x.shape[axis], axis=axis)


def shift_targets(targets, segmentation=None):
  """The decoder input: `targets` shifted right, with 0 (start) at the first token of every packed pair."""
  shifted = shift_right(targets)
  if segmentation is None:
    return shifted
  return shifted * (segmentation == shift_right(segmentation)).astype(shifted.dtype)


def _same_segment(query_segmentation, key_segmentation, dtype):
  """(batch, 1, q, k) mask: query and key tokens belong to the same packed pair (None when not packed)."""
  if query_segmentation is None:
    return None
  return nn.make_attention_mask(query_segmentation, key_segmentation, jnp.equal, dtype=dtype)


def sinusoidal_table(max_len: int, features: int, min_scale: float = 1.0, max_scale: float = 10000.0):
  """(1, max_len, features) fixed sinusoidal position embeddings."""
  table = np.zeros((max_len, features), dtype=np.float32)
  position = np.arange(max_len)[:, None]
  scale_factor = -np.log(max_scale / min_scale) / max(features // 2 - 1, 1)
  div_term = min_scale * np.exp(np.arange(features // 2) * scale_factor)
  table[:, :features // 2] = np.sin(position * div_term)
  table[:, features // 2:2 * (features // 2)] = np.cos(position * div_term)
  return jnp.asarray(table[None])


class AddPositionEmbs(nn.Module):
  """Adds sinusoidal position embeddings; in decode mode, the embedding of the cached position."""
  config: TransformerConfig
  decode: bool = False

  @nn.compact
  def __call__(self, x, positions=None):
    table = sinusoidal_table(self.config.max_len, x.shape[-1])
    pe = table[:, :x.shape[1], :] if positions is None else jnp.take(table[0], positions, axis=0)
    if self.decode:
      is_initialized = self.has_variable('cache', 'cache_index')
      cache_index = self.variable('cache', 'cache_index', lambda: jnp.array(0, dtype=jnp.uint32))
      if is_initialized:
        i = cache_index.value
        cache_index.value = i + 1
        pe = lax.dynamic_slice(table, jnp.array((0, i, 0)), (1, 1, table.shape[-1]))
    return x + pe.astype(x.dtype)


class MlpBlock(nn.Module):
  """Dense -> ReLU -> dropout -> Dense -> dropout."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, deterministic: bool):
    cfg = self.config
    dense = functools.partial(nn.Dense, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                              kernel_init=cfg.kernel_init, bias_init=cfg.bias_init)
    y = nn.relu(dense(cfg.mlp_dim)(x))
    y = nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    y = dense(x.shape[-1])(y)
    return nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)


def _attention(cfg: TransformerConfig, decode: bool = False, name: str | None = None):
  return nn.MultiHeadDotProductAttention(
      num_heads=cfg.num_heads, qkv_features=cfg.qkv_dim, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
      kernel_init=cfg.kernel_init, bias_init=cfg.bias_init, use_bias=False, broadcast_dropout=False,
      dropout_rate=cfg.attention_dropout_rate, decode=decode, name=name)


def _layer_norm(cfg: TransformerConfig, name: str | None = None):
  return nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name)


class EncoderBlock(nn.Module):
  """LN -> self-attention -> residual; LN -> MLP -> residual."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, mask, deterministic: bool):
    cfg = self.config
    y = _layer_norm(cfg)(x)
    y = _attention(cfg)(y, mask=mask, deterministic=deterministic)
    x = x + nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    return x + MlpBlock(cfg)(_layer_norm(cfg)(x), deterministic)


class DecoderBlock(nn.Module):
  """LN -> causal self-attention -> residual; LN -> cross-attention -> residual; LN -> MLP -> residual."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, y, encoded, decoder_mask, encoder_decoder_mask, deterministic: bool):
    cfg = self.config
    z = _layer_norm(cfg)(y)
    z = _attention(cfg, decode=cfg.decode)(z, mask=decoder_mask, deterministic=deterministic)
    y = y + nn.Dropout(cfg.dropout_rate)(z, deterministic=deterministic)
    z = _layer_norm(cfg)(y)
    z = _attention(cfg)(z, encoded, mask=encoder_decoder_mask, deterministic=deterministic)
    y = y + nn.Dropout(cfg.dropout_rate)(z, deterministic=deterministic)
    return y + MlpBlock(cfg)(_layer_norm(cfg)(y), deterministic)


def _embedding(cfg: TransformerConfig, name: str):
  return nn.Embed(num_embeddings=cfg.vocab_size, features=cfg.emb_dim, dtype=cfg.dtype,
                  param_dtype=cfg.param_dtype, embedding_init=nn.initializers.normal(stddev=1.0), name=name)


class Encoder(nn.Module):
  config: TransformerConfig
  shared_embedding: Any = None

  @nn.compact
  def __call__(self, inputs, mask, deterministic: bool, positions=None):
    cfg = self.config
    embed = self.shared_embedding if self.shared_embedding is not None else _embedding(cfg, 'input_embed')
    x = embed(inputs.astype('int32'))
    x = AddPositionEmbs(cfg, name='posembed_input')(x, positions)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    for i in range(cfg.num_layers):
      x = EncoderBlock(cfg, name=f'encoderblock_{i}')(x, mask, deterministic)
    return _layer_norm(cfg, 'encoder_norm')(x)


class Decoder(nn.Module):
  config: TransformerConfig
  shared_embedding: Any = None

  @nn.compact
  def __call__(self, encoded, targets, decoder_mask, encoder_decoder_mask, deterministic: bool,
               segmentation=None, positions=None):
    cfg = self.config
    embed = self.shared_embedding if self.shared_embedding is not None else _embedding(cfg, 'output_embed')
    y = targets.astype('int32')
    if not cfg.decode:
      y = shift_targets(y, segmentation)
    y = embed(y)
    y = AddPositionEmbs(cfg, decode=cfg.decode, name='posembed_output')(y, positions)
    y = nn.Dropout(cfg.dropout_rate)(y, deterministic=deterministic)
    for i in range(cfg.num_layers):
      y = DecoderBlock(cfg, name=f'encoderdecoderblock_{i}')(
          y, encoded, decoder_mask, encoder_decoder_mask, deterministic)
    y = _layer_norm(cfg, 'encoderdecoder_norm')(y)
    if cfg.logits_via_embedding:
      logits = embed.attend(y.astype(cfg.param_dtype)) / jnp.sqrt(y.shape[-1])
    else:
      logits = nn.Dense(cfg.vocab_size, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                        kernel_init=cfg.kernel_init, bias_init=cfg.bias_init, name='logitdense')(y)
    return logits


class Transformer(nn.Module):
  """Encoder-decoder Transformer; `__call__(batch, train)` with batch = {'inputs', 'targets'} (int32, 0 = pad)."""
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    shared = _embedding(cfg, 'shared_embedding') if cfg.share_embeddings else None
    self.encoder = Encoder(cfg, shared_embedding=shared)
    self.decoder = Decoder(cfg, shared_embedding=shared)

  def encode(self, inputs, train: bool = False, inputs_segmentation=None, inputs_position=None):
    dtype = self.config.dtype
    mask = nn.combine_masks(nn.make_attention_mask(inputs > 0, inputs > 0, dtype=dtype),
                            _same_segment(inputs_segmentation, inputs_segmentation, dtype), dtype=dtype)
    return self.encoder(inputs, mask, deterministic=not train, positions=inputs_position)

  def decode(self, encoded, inputs, targets, train: bool = False, inputs_segmentation=None,
             targets_segmentation=None, targets_position=None):
    """Logits for `targets`; with `config.decode`, `targets` is the last token (batch, 1) and `cache` mutable."""
    cfg = self.config
    if cfg.decode:
      decoder_mask = None
      encoder_decoder_mask = nn.make_attention_mask(jnp.ones_like(targets) > 0, inputs > 0, dtype=cfg.dtype)
    else:
      decoder_mask = nn.combine_masks(
          nn.make_attention_mask(targets > 0, targets > 0, dtype=cfg.dtype),
          nn.make_causal_mask(targets, dtype=cfg.dtype),
          _same_segment(targets_segmentation, targets_segmentation, cfg.dtype), dtype=cfg.dtype)
      encoder_decoder_mask = nn.combine_masks(
          nn.make_attention_mask(targets > 0, inputs > 0, dtype=cfg.dtype),
          _same_segment(targets_segmentation, inputs_segmentation, cfg.dtype), dtype=cfg.dtype)
    return self.decoder(encoded, targets, decoder_mask, encoder_decoder_mask, deterministic=not train,
                        segmentation=targets_segmentation, positions=targets_position)

  def __call__(self, batch, train: bool = True):
    """`batch`: `inputs`, `targets` and, when packed, their `_segmentation` and `_position` arrays."""
    inputs, targets = batch['inputs'], batch['targets']
    encoded = self.encode(inputs, train, batch.get('inputs_segmentation'), batch.get('inputs_position'))
    return self.decode(encoded, inputs, targets, train, batch.get('inputs_segmentation'),
                       batch.get('targets_segmentation'), batch.get('targets_position'))


PRESETS = {
    'transformer_base': dict(emb_dim=512, num_heads=8, num_layers=6, qkv_dim=512, mlp_dim=2048),
    'transformer_big': dict(emb_dim=1024, num_heads=16, num_layers=6, qkv_dim=1024, mlp_dim=4096,
                            dropout_rate=0.3, attention_dropout_rate=0.1),
    # Testing only: a tiny model for end-to-end tests on CPU.
    'transformer_test': dict(emb_dim=16, num_heads=2, num_layers=1, qkv_dim=16, mlp_dim=32),
}


def build(config, num_outputs: int) -> Transformer:
  """`config.name` in PRESETS, vocabulary = `num_outputs`; `config.max_len`, `dropout_rate`,
  `attention_dropout_rate` override the preset's when set."""
  kwargs = common.override(common.preset(PRESETS, config), config,
                           ('max_len', 'dropout_rate', 'attention_dropout_rate'))
  return Transformer(TransformerConfig(vocab_size=num_outputs, **kwargs))
