"""Fields every workload shares, and the `ALGORITHM[,key=value...]` config argument.

`get_config(arg)` in each workload file calls `base_config()`, overrides its workload's fields, then
`apply_arg(config, arg)`. In the argument, a bare key is looked up in `algorithm` first, then at the top level;
a dotted key (`optimizer.learning_rate=0.05`) is a path. Values are parsed as Python literals where possible.
"""

from __future__ import annotations

import ast

import ml_collections

import config_errors as errors
from algorithms import registry
from cluster import factory as cluster_factory


def base_config() -> ml_collections.ConfigDict:
  """Defaults shared by all workloads; workload files override what differs."""
  c = ml_collections.ConfigDict()
  c.workers = 8                # P: simulated or real workers (a multiple of `devices`)
  c.devices = 8                # D: devices the workers are spread over (CPU: forced host devices)
  c.batch_size = 16            # per worker, per iteration
  c.microbatches = 1           # m: micro-batches per worker batch (batch_size % m == 0)
  c.num_steps = 300            # iterations of the algorithm
  c.seed = 0                   # model init, data order and cluster clock
  c.eval_every = 50            # steps between evaluations (and at the end)
  c.log_every = 10             # steps between metrics rows (train_loss = mean over the window)
  c.checkpoint_every = 100     # steps between orbax checkpoints (and at the end)
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
  c.optimizer.schedule = 'constant'     # constant | cosine | step | rsqrt (inverse square root)
  c.optimizer.warmup_steps = 0          # linear warmup from 0
  c.optimizer.decay_factor = 0.1        # step schedule: multiply at each boundary
  c.optimizer.decay_boundaries = (0.5, 0.75)  # step schedule: fractions of num_steps

  c.stragglers = cluster_factory.default_stragglers_config()  # compute-time model (cluster/)
  c.network = cluster_factory.default_network_config()        # network model (cluster/)
  return c


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


def apply_arg(config: ml_collections.ConfigDict, arg: str | None) -> ml_collections.ConfigDict:
  """Selects the algorithm named first in `arg` (with its registry defaults) and applies `key=value` pairs."""
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
  for part in parts[1:]:
    if '=' not in part:
      raise errors.ConfigError('config argument', part, 'expected key=value')
    key, raw = part.split('=', 1)
    _set(config, key.strip(), raw.strip())
  return config
