"""Name -> algorithm: its math (`algorithms/NAME.py`, an `AlgorithmSpec`) and its time rule (`cluster/rules/NAME.py`).

Adding an algorithm: its math module defining `SPEC = spec.AlgorithmSpec(...)`, its rule module defining
`time_rule(config)`, one line in `_ALGORITHMS` below, one config variant, and its tests. The common registry
test picks it up automatically.
"""

from __future__ import annotations

from typing import Callable

import ml_collections

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
from waitless.cluster.rules import adasync as adasync_rule
from waitless.cluster.rules import base
from waitless.cluster.rules import dasgd as dasgd_rule
from waitless.cluster.rules import dpsgd as dpsgd_rule
from waitless.cluster.rules import kasync as kasync_rule
from waitless.cluster.rules import kbatch_async as kbatch_async_rule
from waitless.cluster.rules import kbatch_sync as kbatch_sync_rule
from waitless.cluster.rules import ksync as ksync_rule
from waitless.cluster.rules import lap_sgd as lap_sgd_rule
from waitless.cluster.rules import local_sgd as local_sgd_rule
from waitless.cluster.rules import matcha as matcha_rule
from waitless.cluster.rules import nonblocking as nonblocking_rule
from waitless.cluster.rules import streaming_diloco as streaming_diloco_rule
from waitless.cluster.rules import sync as sync_rule
from waitless.cluster.rules import wagma as wagma_rule

TimeRuleFactory = Callable[[ml_collections.ConfigDict], base.TimeRule]

# One line per algorithm: (its spec, config -> its time rule).
_ALGORITHMS: tuple[tuple[spec.AlgorithmSpec, TimeRuleFactory], ...] = (
    (sync.SPEC, sync_rule.time_rule),
    (local_sgd.SPEC, local_sgd_rule.time_rule),
    (diloco.SPEC, local_sgd_rule.time_rule),  # one model all-reduce per round, as local SGD
    (streaming_diloco.SPEC, streaming_diloco_rule.time_rule),
    (ksync.SPEC, ksync_rule.time_rule),
    (kbatch_sync.SPEC, kbatch_sync_rule.time_rule),
    (kasync.SPEC, kasync_rule.time_rule),
    (kbatch_async.SPEC, kbatch_async_rule.time_rule),
    (kbatch_async.ASYNC, kbatch_async_rule.async_time_rule),
    (kbatch_async.RINGMASTER, kbatch_async_rule.async_time_rule),
    (adasync.SPEC, adasync_rule.time_rule),
    (nonblocking.SPEC, nonblocking_rule.time_rule),
    (dpsgd.SPEC, dpsgd_rule.time_rule),
    (matcha.SPEC, matcha_rule.time_rule),
    (wagma.SPEC, wagma_rule.time_rule),
    (lap_sgd.SPEC, lap_sgd_rule.time_rule),
    (lap_sgd.LPP, lap_sgd_rule.time_rule),
    (dasgd.SPEC, dasgd_rule.time_rule),
)
REGISTRY: dict[str, spec.AlgorithmSpec] = {s.name: s for s, _ in _ALGORITHMS}
TIME_RULES: dict[str, TimeRuleFactory] = {s.name: rule for s, rule in _ALGORITHMS}


def names() -> tuple[str, ...]:
  return tuple(sorted(REGISTRY))


def get(name: str) -> spec.AlgorithmSpec:
  """The spec of `name`; a ConfigError listing the known names otherwise."""
  if name not in REGISTRY:
    raise errors.ConfigError('algorithm.name', name, f'known algorithms: {", ".join(names())}')
  return REGISTRY[name]


def time_rule(config: ml_collections.ConfigDict) -> base.TimeRule:
  """The time rule of `config.algorithm.name`, built from the config; a ConfigError for an unknown name."""
  get(config.algorithm.name)
  return TIME_RULES[config.algorithm.name](config)
