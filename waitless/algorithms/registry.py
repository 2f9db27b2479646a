"""Name -> algorithm: how the harness builds an optax transformation and its time rule from a config.

Adding an algorithm: one module in `algorithms/` defining `SPEC = spec.AlgorithmSpec(...)`, one entry in
`_SPECS` below, one config variant, its tests. The common registry test picks it up automatically.
"""

from __future__ import annotations

from waitless import config_errors as errors
from waitless.algorithms import adasync
from waitless.algorithms import dasgd
from waitless.algorithms import diloco
from waitless.algorithms import dpsgd
from waitless.algorithms import kasync
from waitless.algorithms import kbatch_async
from waitless.algorithms import kbatch_sync
from waitless.algorithms import ksync
from waitless.algorithms import lap_sgd
from waitless.algorithms import local_sgd
from waitless.algorithms import matcha
from waitless.algorithms import nonblocking
from waitless.algorithms import spec
from waitless.algorithms import streaming_diloco
from waitless.algorithms import sync
from waitless.algorithms import wagma

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
