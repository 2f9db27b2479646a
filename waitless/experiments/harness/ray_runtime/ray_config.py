"""The Ray runtime's part of the config: which algorithms it runs, and the checks of `runtime` and `ray.*`.

The fields (`runtime`, `ray.worker_cpus`, ...) are data in `experiments/configs/common.py:base_config`.

`runtime=ray` runs the parameter-server family (`FAMILY`) on Ray actors (`experiments/harness/ray_runtime/`);
`sync` runs there as K-sync with K = P, the same update (tests/algorithms/test_parameter_server.py checks that
they are equal). Everything else runs lock-step in one `shard_map` program (`runtime=spmd`, the default).
"""

from __future__ import annotations

import ml_collections

from waitless import config_errors as errors

RUNTIMES = ('spmd', 'ray')
FAMILY = ('async', 'kasync', 'kbatch_async', 'ksync', 'kbatch_sync', 'ringmaster', 'adasync')
AS_KSYNC = 'sync'  # on Ray: ksync with K = workers
CANCELS = ('ksync', 'kbatch_sync')  # their `cancel` is the server's: on arrival


class RayUnavailable(ValueError):
  """The Ray cluster named by --ray_address does not answer (a user error: one line, exit 2)."""


def is_ray(config: ml_collections.ConfigDict) -> bool:
  return config.runtime == 'ray'


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises errors.ConfigError for a runtime the algorithm cannot use, or bad `ray.*` fields (checked whatever
  the runtime: a config file's mistake is news before someone adds runtime=ray)."""
  runtime = config.runtime
  errors.require(runtime in RUNTIMES, 'runtime', runtime, f'one of {", ".join(RUNTIMES)}')
  r = config.ray
  if r.worker_cpus is not None:
    errors.require_number(r.worker_cpus, 'ray.worker_cpus', 'must be a number > 0, or unset (the cluster\'s CPUs '
                          'shared among the learners)', lambda v: v > 0)
  for field in ('worker_gpus', 'server_cpus'):
    errors.require_number(r[field], f'ray.{field}', 'must be a number >= 0', lambda v: v >= 0)
  errors.require_int(r.max_restarts, 'ray.max_restarts', 0)
  if r.get('learners_per_process') is not None:
    errors.require_int(r.learners_per_process, 'ray.learners_per_process', 1)
  if runtime != 'ray':
    return
  name = config.algorithm.name
  errors.require(name in FAMILY + (AS_KSYNC,), 'runtime', runtime,
                 f'runs the parameter-server family ({", ".join(FAMILY)}; sync as ksync with K = workers), not '
                 f'{name}: use runtime=spmd for it')
  errors.require(config.stragglers.kind != 'measured', 'stragglers.kind', config.stragglers.kind,
                 'is not used with runtime=ray (its time is always measured): leave the default')


def server_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config the server and the learners build their pieces from: one device each, `sync` as K-sync K = P,
  K-sync's and K-batch-sync's late jobs discarded on arrival (`cluster/rules/ksync.py`'s and `kbatch_sync.py`'s
  `cancel`: what the server does). `simulate` of a `runtime=ray` config predicts this config's time rule."""
  c = config.copy_and_resolve_references()
  c.devices = 1
  if c.algorithm.name == AS_KSYNC:
    c.algorithm = ml_collections.ConfigDict({'name': 'ksync', 'k': c.workers, 'cancel': 'on_arrival'})
  if c.algorithm.name in CANCELS:  # what the server does; the time rule then predicts the runtime
    c.algorithm.cancel = 'on_arrival'
  return c
