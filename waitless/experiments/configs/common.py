"""Fields every workload shares, and the `ALGORITHM[,key=value...]` config argument.

`get_config(arg)` in each workload file calls `base_config()`, overrides its workload's fields, then
`apply_arg(config, arg)`. In the argument, a bare key is looked up in `algorithm` first, then at the top level;
a dotted key (`optimizer.learning_rate=0.05`) is a path. Values are parsed as Python literals where possible.

Duration: a config sets exactly one of `num_steps` (iterations) and `num_epochs` (passes over the training
split); the other is None. `num_epochs` is resolved once, by `experiments/harness/setup.py:build` when the training
split's size is known, to `steps_for_epochs(num_epochs, train_size, workers, batch_size)`. In the config
argument, giving one of the two unsets the other (`cifar10.py:sync,num_steps=20` runs 20 iterations).
"""

from __future__ import annotations

import ast
import math

import ml_collections
from ml_collections import config_dict

from waitless import config_errors as errors
from waitless.cluster import registry
from waitless.cluster import factory as cluster_factory
from waitless.experiments.harness.ray_runtime import ray_config


def base_config() -> ml_collections.ConfigDict:
  """Defaults shared by all workloads; workload files override what differs."""
  c = ml_collections.ConfigDict()
  c.workers = 8                # P: simulated or real workers (a multiple of `devices`)
  c.devices = 8                # D: devices the workers are spread over (CPU: forced host devices)
  c.batch_size = 16            # per worker, per iteration
  c.microbatches = 1           # m: micro-batches per worker batch (batch_size % m == 0)
  c.num_steps = 300            # iterations of the algorithm; or None with num_epochs set (exactly one)
  c.num_epochs = config_dict.placeholder(float)  # passes over the training split (see steps_for_epochs)
  c.seed = 0                   # model init, data order and cluster clock
  c.eval_every = 50            # steps between evaluations (and at the end)
  c.log_every = 10             # steps between metrics rows (train_loss = mean over the window)
  c.checkpoint_every = 100     # steps between orbax checkpoints (and at the end)
  c.checkpoint_every_s = 120.0  # also one after a block that ends this many wall seconds after the last (0: off)
  c.steps_per_call = 10        # iterations per jitted call (lax.scan over pre-sampled schedules)
  c.eval_batch_size = 512
  c.target_accuracy = 0.9      # summary.json's time_to_target: first sim_time with eval accuracy >= this
  c.progress_every_s = 5.0     # seconds between progress lines

  c.algorithm = ml_collections.ConfigDict({'name': 'sync'})

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = 'sgd'              # sgd | adamw
  c.optimizer.learning_rate = 0.1
  c.optimizer.momentum = 0.9            # sgd only; 0 disables
  c.optimizer.nesterov = False
  c.optimizer.b1 = 0.9                  # adamw only: first-moment decay
  c.optimizer.b2 = 0.999                # adamw only: second-moment decay (Transformer: 0.98)
  c.optimizer.eps = 1e-8                # adamw only (Transformer: 1e-9)
  c.optimizer.weight_decay = 0.0
  c.optimizer.lr_schedule = 'constant'  # learning-rate schedule: constant | cosine | step | rsqrt (inverse square root)
  c.optimizer.warmup_steps = 0          # linear warmup from 0
  c.optimizer.decay_factor = 0.1        # step learning-rate schedule: multiply at each boundary
  c.optimizer.decay_boundaries = (0.5, 0.75)  # step learning-rate schedule: fractions of num_steps

  c.runtime = 'spmd'           # spmd: one lock-step shard_map program; ray: the parameter-server family on Ray actors
  c.ray = ray_config.default_config()  # runtime=ray: what each actor reserves (experiments/harness/ray_runtime/)

  c.stragglers = cluster_factory.default_stragglers_config()  # compute-time model (cluster/)
  c.network = cluster_factory.default_network_config()        # network model (cluster/)
  c.cluster = cluster_factory.default_cluster_config()        # a named cluster profile, host time (cluster/)
  return c


def mark_explicit(config: ml_collections.ConfigDict, paths) -> None:
  """Records in `cluster.explicit` which of `paths` (fields the user set: `--config.FIELD` flags, the config
  argument's pairs) a cluster profile would otherwise set (`cluster.factory.PROFILE_FIELDS`): they win over it."""
  cluster = config.get('cluster')
  if cluster is None:
    return
  named = tuple(p for p in paths if p in cluster_factory.PROFILE_FIELDS and p not in cluster.explicit)
  if named:
    cluster.explicit = tuple(cluster.explicit) + named


DURATION_FIELDS = ('num_steps', 'num_epochs')


def steps_for_epochs(epochs: float, train_size: int, workers: int, batch_size: int) -> int:
  """Iterations that visit at least `epochs` x `train_size` examples: ceil(E N / (P B)), at least 1.

  One iteration takes the global batch P x B: `workers` x `batch_size` (per worker, all its micro-batches).
  An algorithm whose iteration takes another number of examples (K-of-P variants: K x B; LAP-SGD: a node's
  threads) counts nominal epochs of P x B examples per iteration.
  """
  return max(1, math.ceil(epochs * train_size / (workers * batch_size) - 1e-9))


def use_epochs(config: ml_collections.ConfigDict, epochs: float) -> ml_collections.ConfigDict:
  """Sets the duration in epochs (`num_steps` None, still overridable by `--config.num_steps`)."""
  config.num_epochs = float(epochs)
  config.num_steps = config_dict.placeholder(int)
  return config


def override_duration(config: ml_collections.ConfigDict, overridden) -> None:
  """`--config.num_steps=N` (or `--config.num_epochs=E`) alone replaces the config's duration, as the config
  argument's `num_steps=N` does: the other field is unset. `overridden`: the paths the flags set."""
  named = [field for field in DURATION_FIELDS if field in overridden]
  if len(named) == 1:
    other = DURATION_FIELDS[1 - DURATION_FIELDS.index(named[0])]
    config[other] = None


def validate_duration(config: ml_collections.ConfigDict) -> None:
  """Exactly one of `num_steps` (an integer >= 1) and `num_epochs` (a number > 0) is set."""
  steps, epochs = config.get('num_steps'), config.get('num_epochs')
  errors.require((steps is None) != (epochs is None), 'num_steps, num_epochs', (steps, epochs),
                 'set exactly one of them, the other None (in the config argument, giving one unsets the other)')
  if steps is not None:
    errors.require_int(steps, 'num_steps', 1)
  else:
    errors.require_number(epochs, 'num_epochs', 'must be a number of epochs > 0', lambda v: v > 0)


def resolve_num_steps(config: ml_collections.ConfigDict, train_size: int) -> ml_collections.ConfigDict:
  """`config` itself when it sets `num_steps`; else a copy with num_steps = steps_for_epochs(...), num_epochs None."""
  if config.get('num_epochs') is None:
    return config
  resolved = config.copy_and_resolve_references()
  resolved.num_steps = steps_for_epochs(config.num_epochs, train_size, config.workers, config.batch_size)
  resolved.num_epochs = None
  return resolved


def tfds_dataset(name: str, eval_split: str) -> ml_collections.ConfigDict:
  """`config.dataset` fields every tensorflow-datasets workload has; workload files add their own."""
  d = ml_collections.ConfigDict()
  d.name = name
  d.data_dir = None          # None: tfds default ($TFDS_DATA_DIR or ~/tensorflow_datasets)
  d.train_split = 'train'
  d.eval_split = eval_split
  return d


def _literal(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _set(config: ml_collections.ConfigDict, key: str, raw: str) -> None:
  if '.' in key:
    path = key.split('.')
  elif key in config.algorithm:
    path = ['algorithm', key]
  elif key in config:
    path = [key]
  else:
    known = sorted(set(config.algorithm.keys()) | set(config.keys()))
    raise errors.ConfigError('config argument', key, f'unknown key; known: {", ".join(known)}')
  node = config
  for part in path[:-1]:
    if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
      raise errors.ConfigError('config argument', key, 'unknown key')
    node = node[part]
  if path[-1] not in node:
    raise errors.ConfigError('config argument', key, f'unknown key; known in {".".join(path[:-1]) or "config"}: '
                             f'{", ".join(sorted(node.keys()))}')
  value = _literal(raw)
  old = node[path[-1]]
  if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if isinstance(old, tuple) and isinstance(value, list):
    value = tuple(value)
  try:
    node[path[-1]] = value
  except TypeError as e:
    raise errors.ConfigError(key, raw, f'must be of type {type(old).__name__}') from e


def split_arg(arg: str | None) -> list[str]:
  """Splits `ALGORITHM,key=value,...` on the commas outside brackets, so `slow_workers=(0,3)` stays whole."""
  parts, depth, current = [], 0, []
  for char in arg or '':
    depth += char in '([{'
    depth -= char in ')]}'
    if char == ',' and depth == 0:
      parts.append(''.join(current))
      current = []
    else:
      current.append(char)
  parts.append(''.join(current))
  return [p.strip() for p in parts if p.strip()]


# `stragglers=NAME` in the config argument of every workload: compute-time presets applied before the other
# pairs (a `stragglers.FIELD=...` pair wins, wherever it is written). Each is a function of the workload's
# `stragglers.base_s` (seconds per micro-batch) and the workers the argument asks for (its `workers=` if any, else
# the workload's; a later `--config.workers` flag does not resize a per-worker preset: validation names the
# mismatch) returning `config.stragglers` fields.
STRAGGLER_PRESETS = {
    'homogeneous': lambda base_s, workers: {},
    # A quarter of the workers twice as slow, and at every iteration one random worker delayed by three
    # micro-batch calls (30 ms on the default 10 ms; on a cluster profile, three of its calls).
    'heterogeneous': lambda base_s, workers: {'slow_fraction': 0.25, 'slow_factor': 2.0, 'delayed_workers': 1,
                                              'delay_calls': 3.0, 'delay_s': 0.0},
    # Worker i's compute times scaled by sqrt(i + 1): a fixed, arbitrary heterogeneity (Ringmaster ASGD's setting).
    'sqrt': lambda base_s, workers: {'worker_factors': tuple(math.sqrt(i + 1) for i in range(workers))},
}


def _apply_straggler_presets(config: ml_collections.ConfigDict, parts: list[str]) -> list[str]:
  """Applies the `stragglers=NAME` parts of a config argument (STRAGGLER_PRESETS); returns the other parts."""
  presets = [p.split('=', 1)[1].strip() for p in parts if p.partition('=')[0].strip() == 'stragglers']
  rest = [p for p in parts if p.partition('=')[0].strip() != 'stragglers']
  workers = config.workers
  for part in rest:
    key, _, raw = part.partition('=')
    if key.strip() == 'workers':
      workers = _literal(raw.strip())
  # A delay the argument gives in seconds replaces a preset's delay in calls (the two may not both be set).
  sets_delay_s = any(p.partition('=')[0].strip() == 'stragglers.delay_s' for p in rest)
  for name in presets:
    errors.require(name in STRAGGLER_PRESETS, 'stragglers', name, f'a preset: {", ".join(STRAGGLER_PRESETS)}')
    for key, value in STRAGGLER_PRESETS[name](config.stragglers.base_s, workers).items():
      if not (key == 'delay_calls' and sets_delay_s):
        config.stragglers[key] = value
  return rest


def apply_arg(config: ml_collections.ConfigDict, arg: str | None) -> ml_collections.ConfigDict:
  """Selects the algorithm named first in `arg` (with its registry defaults), applies its `stragglers=NAME`
  presets (STRAGGLER_PRESETS), then its `key=value` pairs."""
  parts = split_arg(arg)
  name = parts[0] if parts else config.algorithm.name
  if '=' in name:
    raise errors.ConfigError('config argument', arg, 'must start with an algorithm name: ALGORITHM[,key=value...]')
  spec = registry.get(name)
  algorithm = ml_collections.ConfigDict({'name': name, **dict(spec.defaults)})
  for key, value in config.algorithm.items():
    if key != 'name' and key in algorithm:
      algorithm[key] = value
  config.algorithm = algorithm
  for part in _apply_straggler_presets(config, parts[1:]):
    if '=' not in part:
      raise errors.ConfigError('config argument', part, 'expected key=value')
    key, raw = part.split('=', 1)
    _set(config, key.strip(), raw.strip())
    mark_explicit(config, [key.strip()])
    if key.strip() in DURATION_FIELDS and config.get(key.strip()) is not None:
      other, = set(DURATION_FIELDS) - {key.strip()}
      if other in config:  # the duration given here replaces the workload's (still overridable by a flag)
        config[other] = config_dict.placeholder(int if other == 'num_steps' else float)
  return config
