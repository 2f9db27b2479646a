"""Builds the clock for a config: compute model from `config.stragglers`, network from `config.network`."""

from __future__ import annotations

from typing import Any

import ml_collections

from algorithms import errors

from cluster import clock as clock_lib
from cluster import compute as compute_lib
from cluster import network as network_lib

STRAGGLER_KINDS = ('constant',)
NETWORK_KINDS = ('ideal', 'alpha_beta')


def default_stragglers_config() -> ml_collections.ConfigDict:
  """`config.stragglers`: the compute-time model of one micro-batch."""
  c = ml_collections.ConfigDict()
  c.kind = 'constant'   # one of STRAGGLER_KINDS
  c.base_s = 0.01       # seconds per micro-batch
  return c


def default_network_config() -> ml_collections.ConfigDict:
  """`config.network`: the cost of collectives."""
  c = ml_collections.ConfigDict()
  c.kind = 'ideal'            # ideal | alpha_beta
  c.latency_s = 5e-6          # alpha_beta: alpha, seconds per message
  c.bandwidth_gbps = 10.0     # alpha_beta: beta, gigabits per second
  return c


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises algorithms.errors.ConfigError for a bad `stragglers.*` or `network.*` field."""
  errors.require(config.stragglers.kind in STRAGGLER_KINDS, 'stragglers.kind', config.stragglers.kind,
                 f'known: {", ".join(STRAGGLER_KINDS)}')
  errors.require(config.stragglers.base_s > 0, 'stragglers.base_s', config.stragglers.base_s, 'must be > 0')
  errors.require(config.network.kind in NETWORK_KINDS, 'network.kind', config.network.kind,
                 f'known: {", ".join(NETWORK_KINDS)}')
  if config.network.kind == 'alpha_beta':
    errors.require(config.network.latency_s >= 0, 'network.latency_s', config.network.latency_s, 'must be >= 0')
    errors.require(config.network.bandwidth_gbps > 0, 'network.bandwidth_gbps', config.network.bandwidth_gbps,
                   'must be > 0')


def make_compute(stragglers: ml_collections.ConfigDict, workers: int) -> compute_lib.ComputeModel:
  del workers
  if stragglers.kind == 'constant':
    return compute_lib.Constant(base_s=stragglers.base_s)
  raise ValueError(f'stragglers.kind={stragglers.kind!r} is unknown; known: {", ".join(STRAGGLER_KINDS)}')


def make_network(network: ml_collections.ConfigDict) -> network_lib.Network:
  if network.kind == 'ideal':
    return network_lib.Ideal()
  if network.kind == 'alpha_beta':
    return network_lib.AlphaBeta(latency_s=network.latency_s, bandwidth_gbps=network.bandwidth_gbps)
  raise ValueError(f'network.kind={network.kind!r} is unknown; known: {", ".join(NETWORK_KINDS)}')


def make_clock(config: ml_collections.ConfigDict, rule: Any, model_bytes: float) -> clock_lib.Clock:
  """The seeded clock for `config`, driving `rule` (from the algorithm's registry spec)."""
  return clock_lib.Clock(
      workers=config.workers, rule=rule, compute=make_compute(config.stragglers, config.workers),
      network=make_network(config.network), model_bytes=model_bytes, seed=config.seed)
