"""Name -> algorithm: how the harness builds an optax transformation and its time rule from a config.

Adding an algorithm: one module in `algorithms/` defining `SPEC = spec.AlgorithmSpec(...)`, one entry in
`_SPECS` below, one config variant, its tests. The common registry test picks it up automatically.
"""

from __future__ import annotations

import config_errors as errors
from algorithms import adasync
from algorithms import dasgd
from algorithms import diloco
from algorithms import dpsgd
from algorithms import kasync
from algorithms import kbatch_async
from algorithms import kbatch_sync
from algorithms import ksync
from algorithms import lap_sgd
from algorithms import local_sgd
from algorithms import matcha
from algorithms import nonblocking
from algorithms import spec
from algorithms import streaming_diloco
from algorithms import sync
from algorithms import wagma

_SPECS = (
    sync.SPEC,
    local_sgd.SPEC,
    diloco.SPEC,
    streaming_diloco.SPEC,
    ksync.SPEC,
    kbatch_sync.SPEC,
    kasync.SPEC,
    kbatch_async.SPEC,
    kbatch_async.ASYNC,
    kbatch_async.RINGMASTER,
    adasync.SPEC,
    nonblocking.SPEC,
    dpsgd.SPEC,
    matcha.SPEC,
    wagma.SPEC,
    lap_sgd.SPEC,
    lap_sgd.LPP,
    dasgd.SPEC,
)
REGISTRY: dict[str, spec.AlgorithmSpec] = {s.name: s for s in _SPECS}


def names() -> tuple[str, ...]:
  return tuple(sorted(REGISTRY))


def get(name: str) -> spec.AlgorithmSpec:
  """The spec of `name`; a ConfigError listing the known names otherwise."""
  if name not in REGISTRY:
    raise errors.ConfigError('algorithm.name', name, f'known algorithms: {", ".join(names())}')
  return REGISTRY[name]
