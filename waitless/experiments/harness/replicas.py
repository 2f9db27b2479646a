"""Replicas: several runs trained by one compiled program.

Seeds, and sweep values that change no shape and no time rule, need not each compile and run a program of their
own (the way PureJaxRL and evosax vmap whole training runs). Runs whose configs differ only in `replica_fields`
form a group of R replicas: every leaf of the training state gets a leading replica axis, outside the worker
axis; the program is vmapped over it, so it compiles once and is dispatched once per block for all R. The
collectives inside name the worker axes only, so replicas never mix.

What differs between the replicas of a group reaches the program as inputs, never as constants:
- `seed`: the initial parameters and the per-iteration random keys (the data order and the straggler trace,
  also functions of the seed, are the host's: each replica has its own clock and data positions);
- `num_steps`: each replica's own budget (a `--sim_time` budget gives each seed its own iteration count); a
  replica that has spent it is frozen (its last state saved and evaluated) while the others go on. It reaches
  the program only through the learning-rate schedule (`optimizers.depends_on_num_steps`);
- the inner optimizer's scalars (`optimizers.HYPERPARAMETERS`: learning rate, momentum, weight decay, Adam's
  b1, b2, eps) and the algorithm fields its spec declares (`AlgorithmSpec.hyperparameters`: DiLoCo's outer
  learning rate, DaSGD's `mix`, ...).
A value that every replica of the group shares stays a constant of the program, so a group of one compiles
exactly the program of a single run. Everything else (workers, k, group size, the model, the time rule, the
evaluation and checkpoint cadence) must be equal: runs that differ there go to different groups.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping, Optional, Sequence

import ml_collections
import numpy as np

from waitless.algorithms import optimizers
from waitless.cluster import registry
from waitless.experiments.harness import measured_time


def replica_fields(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The dotted config paths that the replicas of one program may differ in (see the module docstring)."""
  spec = registry.get(config.algorithm.name)
  fields = ['seed', *(f'optimizer.{f}' for f in optimizers.HYPERPARAMETERS),
            *(f'algorithm.{f}' for f in spec.hyperparameters)]
  if not optimizers.depends_on_num_steps(config.optimizer):
    fields.append('num_steps')
  return tuple(fields)


def get_path(config: ml_collections.ConfigDict, path: str) -> Any:
  """The field at dotted `path` ('optimizer.learning_rate')."""
  node = config
  for part in path.split('.'):
    node = node[part]
  return node


def set_path(config: ml_collections.ConfigDict, path: str, value: Any) -> None:
  """Sets the field at dotted `path` to `value`."""
  *parents, last = path.split('.')
  node = config
  for part in parents:
    node = node[part]
  node[last] = value


def program_key(config: ml_collections.ConfigDict) -> Optional[str]:
  """A key equal for configs whose runs can share one program; None for a config that runs alone.

  A run that calibrates its straggler model to this machine's step (`stragglers.calibrate`) times its own
  program, so it never shares one; nor does a measured run (`stragglers.kind='measured'`). `progress_every_s`
  only paces the log.
  """
  if config.stragglers.get('calibrate') or measured_time.is_measured(config):
    return None  # a measured run (experiments/harness/measured_time.py) times its own program too
  tree = json.loads(config.to_json_best_effort())
  for path in (*replica_fields(config), 'progress_every_s'):
    node = tree
    *parents, last = path.split('.')
    for part in parents:
      node = node.get(part, {})
    node.pop(last, None)
  return json.dumps(tree, sort_keys=True)


def varying_values(configs: Sequence[ml_collections.ConfigDict]) -> dict[str, np.ndarray]:
  """The replica fields whose values differ between `configs`: path -> (R,) array, in the order of `configs`.

  The fields all configs share are left out: they stay constants of the program.
  """
  out = {}
  for path in replica_fields(configs[0]):
    values = [get_path(c, path) for c in configs]
    if any(v != values[0] for v in values[1:]):
      out[path] = np.asarray(values)
  return out


def traced_config(config: ml_collections.ConfigDict, values: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `config` with each dotted path of `values` set to its (traced) value.

  Not type-safe: a ConfigDict refuses a tracer in a float field. Only a transformation's build reads it.
  """
  copy = ml_collections.ConfigDict(config.to_dict(), type_safe=False)
  for path, value in values.items():
    set_path(copy, path, value)
  return copy


def saved_steps(workdir: str) -> list[int]:
  """The steps of the finished checkpoints in `workdir/checkpoints` (orbax names each after its step; a save in
  progress has a temporary name), without opening any."""
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(directory):
    return []
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def available_memory_bytes(device) -> Optional[int]:
  """Memory free for new buffers on `device`: the accelerator's own (`memory_stats`), or the host's available
  memory for a CPU device (`machine.available_memory_bytes`: MemAvailable, a cgroup's limit, `ulimit -v`); None
  when unknown."""
  stats = device.memory_stats() if device.platform != 'cpu' else None
  if stats and 'bytes_limit' in stats:
    return int(stats['bytes_limit'] - stats.get('bytes_in_use', 0))
  from waitless import machine
  return machine.available_memory_bytes()


# A replica's state is held about this many times over at once: the state, the block's new state (the step
# donates the old one, but an evaluation's consensus and a checkpoint's copy sit beside it), and its inputs
# double-buffered. Activations are not counted: they are the program's temporaries, as for a single run.
STATE_COPIES = 3
INPUT_COPIES = 2
MEMORY_SHARE = 0.5  # of the available memory, leaving the rest to activations, the data and other processes


def replicas_that_fit(state_bytes: float, input_bytes: float, available: Optional[int]) -> Optional[int]:
  """How many replicas of `state_bytes` of training state (per device) and `input_bytes` of block inputs fit in
  MEMORY_SHARE of `available` bytes; None when the memory is unknown (no limit)."""
  if available is None:
    return None
  return max(1, int(MEMORY_SHARE * available // max(bytes_per_replica(state_bytes, input_bytes), 1.0)))


def bytes_per_replica(state_bytes: float, input_bytes: float) -> float:
  """Device memory one replica holds: STATE_COPIES of its training state and INPUT_COPIES of its block inputs."""
  return STATE_COPIES * state_bytes + INPUT_COPIES * input_bytes


def partition(configs: Sequence[ml_collections.ConfigDict], workdirs: Sequence[str],
              limit: Optional[Callable[[ml_collections.ConfigDict], Optional[int]]] = None) -> list[list[int]]:
  """Splits runs into groups that share one program: indices into `configs`, each group in the input order.

  Runs share a group when their configs have the same `program_key` and their workdirs the same latest
  checkpoint (a group resumes from one step: runs added to a comparison later start their own group), at most
  `limit(config)` runs to a group (None: no limit).
  """
  groups: dict[tuple, list[list[int]]] = {}
  order = []
  for i, (config, workdir) in enumerate(zip(configs, workdirs)):
    program = program_key(config)
    steps = saved_steps(workdir)
    key = (program if program is not None else f'alone:{i}', steps[-1] if steps else None)
    if key not in groups:
      groups[key] = [[]]
      order.append(key)
    most = None if limit is None else limit(config)
    if most is not None and len(groups[key][-1]) >= most:
      groups[key].append([])
    groups[key][-1].append(i)
  return [group for key in order for group in groups[key]]
