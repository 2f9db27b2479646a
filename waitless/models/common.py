"""Helpers the model builders share: dtype names and preset overrides from `config.model`."""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp

from waitless import config_errors as errors

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16, 'float64': jnp.float64}


def dtype(config, field: str):
  """The jnp dtype named by `config.<field>` (default float32); a ConfigError for an unknown name."""
  name = config.get(field, 'float32')
  errors.require(name in DTYPES, f'model.{field}', name, f'one of {", ".join(DTYPES)}')
  return DTYPES[name]


def preset(presets: Mapping[str, Mapping[str, Any]], config) -> dict[str, Any]:
  """The keyword arguments of preset `config.name`, with `dtype` and `param_dtype` from the config."""
  if config.name not in presets:
    raise errors.ConfigError('model.name', config.name, f'known: {", ".join(sorted(presets))}')
  kwargs = dict(presets[config.name])
  kwargs['dtype'] = dtype(config, 'dtype')
  kwargs['param_dtype'] = dtype(config, 'param_dtype')
  return kwargs


def override(kwargs: dict[str, Any], config, fields) -> dict[str, Any]:
  """Replaces `kwargs[f]` by `config.f` for each of `fields` the config sets (not None)."""
  for field in fields:
    value = config.get(field, None)
    if value is not None:
      kwargs[field] = tuple(value) if isinstance(value, list) else value
  return kwargs
