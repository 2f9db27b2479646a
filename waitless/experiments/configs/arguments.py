"""The override language of the programs: the config argument, `--config.FIELD` flags, compare's entries and sweeps.

The config argument (`--config=FILE:ARG`, a workload file's `get_config(ARG)`) is `ALGORITHM[,key=value...]`:

  - ALGORITHM selects the algorithm with its registry defaults (`cluster.registry`); omitted, the workload's.
  - `stragglers=PRESET` applies a compute-time preset (`STRAGGLER_PRESETS`) before the other pairs, so a
    `stragglers.FIELD=...` pair wins wherever it is written.
  - A key names a field (`resolve_key`): a dotted key is a path (`optimizer.learning_rate=0.05`); a bare key is
    `algorithm.KEY` when the algorithm has that field, else the top-level field KEY.
  - A value is a Python literal where it parses as one (`(0,3)`, `1e-3`, `True`), else the text itself; an int
    given for a float field becomes a float, a list for a tuple field a tuple.
  - Duration: giving one of `num_steps` and `num_epochs` unsets the other (`cifar10.py:sync,num_steps=20` runs
    20 iterations); so does a `--config.num_steps` (or `num_epochs`) flag given alone (`apply_flag_rules`).
  - Every field the user sets, by a pair or a flag, that a cluster profile would set
    (`cluster.profiles.PROFILE_FIELDS`) is recorded in `cluster.explicit`: it wins over the profile.

`experiments.compare` adds two lists in the same language: `--algorithms` entries (`parse_entries`: a name starts
an entry, a `key=value` belongs to the entry before it, `;` also separates entries, `all` is every registered
algorithm) and `--sweep KEY=V1,V2,...` axes (`parse_sweeps`). `entry_config` gives one entry's config at one
sweep point: the workload's config for `ALGORITHM,<the config argument's pairs>,<the entry's pairs>,<the point>`,
then every `--config.PATH` flag that neither the entry nor the point names.
"""

from __future__ import annotations

import ast
import itertools
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import ml_collections
from ml_collections import config_dict

from waitless import config_errors as errors
from waitless.cluster import profiles
from waitless.cluster import registry

DURATION_FIELDS = ('num_steps', 'num_epochs')  # exactly one is set: giving one unsets the other
# Sections of the simulated cluster: a setting of a comparison, never a value a sweep chooses.
CLUSTER_SECTIONS = ('stragglers', 'network', 'cluster')

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


def pairs(arg: str | None) -> list[str]:
  """The `key=value` pairs of a config argument, its algorithm name left out."""
  return [p for p in split_arg(arg) if '=' in p]


def resolve_key(config: ml_collections.ConfigDict, key: str) -> str:
  """The dotted path a key of the config argument names: a dotted key is itself; a bare one `algorithm.KEY` when
  the config's algorithm has that field, else KEY."""
  return f'algorithm.{key}' if '.' not in key and key in config.algorithm else key


def _literal(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _set(config: ml_collections.ConfigDict, key: str, raw: str) -> None:
  """Sets the field `key` names (`resolve_key`) to the literal `raw`; ConfigError for an unknown key or a type."""
  path = resolve_key(config, key).split('.')
  if len(path) == 1 and key not in config:
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


def _unset_other_duration(config: ml_collections.ConfigDict, given: str) -> None:
  """The duration `given` (one of DURATION_FIELDS) replaces the other, which stays settable (a typed None)."""
  other, = set(DURATION_FIELDS) - {given}
  config[other] = config_dict.placeholder(int if other == 'num_steps' else float)


def apply_arg(config: ml_collections.ConfigDict, arg: str | None) -> ml_collections.ConfigDict:
  """`config` with the config argument `arg` applied (the module docstring's rules); returns `config`.

  Raises:
    config_errors.ConfigError: an unknown algorithm, preset or key, a pair that is not `key=value`, a value of the
      wrong type.
  """
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
  given: dict[str, str] = {}  # field path -> the part that set it
  for part in parts[1:]:
    key = part.partition('=')[0].strip()
    if key == 'stragglers':  # presets compose (each sets its fields; conflicting ones are refused by name)
      continue
    path = resolve_key(config, key)
    if '=' in part and path in given:  # the last would win silently: which one was meant?
      raise errors.ConfigError('config argument', arg, f'sets {path} twice ({given[path]} and {part}): give it once')
    given[path] = part
  for part in _apply_straggler_presets(config, parts[1:]):
    if '=' not in part:
      raise errors.ConfigError('config argument', part, 'expected key=value')
    key, raw = (text.strip() for text in part.split('=', 1))
    _set(config, key, raw)
    mark_explicit(config, [key])
    if key in DURATION_FIELDS and config.get(key) is not None:
      _unset_other_duration(config, key)  # still overridable by a flag
  return config


def mark_explicit(config: ml_collections.ConfigDict, paths) -> None:
  """Records in `cluster.explicit` which of `paths` (fields the user set: `--config.FIELD` flags, the config
  argument's pairs) a cluster profile would otherwise set (`cluster.profiles.PROFILE_FIELDS`): they win over it."""
  explicit = config.cluster.explicit
  named = tuple(p for p in paths if p in profiles.PROFILE_FIELDS and p not in explicit)
  if named:
    config.cluster.explicit = tuple(explicit) + named


def override_duration(config: ml_collections.ConfigDict, overridden) -> None:
  """`--config.num_steps=N` (or `--config.num_epochs=E`) alone replaces the config's duration, as the config
  argument's `num_steps=N` does: the other field is unset. `overridden`: the paths the flags set."""
  named = [field for field in DURATION_FIELDS if field in overridden]
  if len(named) == 1:
    config[DURATION_FIELDS[1 - DURATION_FIELDS.index(named[0])]] = None


def apply_flag_rules(config: ml_collections.ConfigDict, overridden) -> None:
  """What `--config.PATH=VALUE` flags mean beyond the value config_flags has set: a duration given alone
  replaces the config's (`override_duration`), and a field a cluster profile sets is explicit (`mark_explicit`).
  `overridden`: the paths the flags set (`config_flags.get_override_values`)."""
  overridden = list(overridden)
  override_duration(config, overridden)
  mark_explicit(config, overridden)


def parse_entries(text: str) -> list[str]:
  """`--algorithms`: 'sync,ksync,k=6;local_sgd' -> ['sync', 'ksync,k=6', 'local_sgd']; 'all' -> every registered
  algorithm. ConfigError naming --algorithms for an unknown name, a pair without an entry, a repeated entry."""
  entries: list[list[str]] = []
  for group in (text or '').split(';'):
    start, after_all = True, False  # after ';' the next part starts an entry even if it has a '='
    for part in split_arg(group):
      if part == 'all':
        entries.extend([name] for name in registry.names())
        after_all = True
      elif '=' in part and not start:
        if not entries:
          raise errors.ConfigError('--algorithms', text, 'must start with an algorithm name')
        if after_all:  # it would bind to the last registered algorithm only
          raise errors.ConfigError('--algorithms', text, f"'all' takes no key=value pairs ({part}): set a field "
                                   'of every run with --config.FIELD=VALUE, or name the entries')
        entries[-1].append(part)
      elif '=' in part:
        raise errors.ConfigError('--algorithms', part, 'an entry must start with an algorithm name')
      else:
        registry.get(part)  # an unknown name lists the known ones
        entries.append([part])
        after_all = False
      start = False
  if not entries:
    raise errors.ConfigError('--algorithms', text, "name at least one algorithm, or 'all'")
  labels = [','.join(e) for e in entries]
  duplicates = sorted({label for label in labels if labels.count(label) > 1})
  if duplicates:
    raise errors.ConfigError('--algorithms', text, f'entries appear twice: {", ".join(duplicates)}')
  return labels


def parse_sweeps(specs: Sequence[str]) -> list[tuple[tuple[str, str], ...]]:
  """`--sweep` flags: ['a=1,2', 'b=x,y'] -> the grid [(('a','1'),('b','x')), (('a','1'),('b','y')), ...]; [] -> [()].

  Keys joined by ':' move together (one axis of tuples, not a grid): 'a:b=1:x,2:y' -> [(('a','1'),('b','x')),
  (('a','2'),('b','y'))], e.g. a learning rate with its momentum. A sweep chooses hyper-parameters: not the seed
  (paired trials: --seeds) nor a field of the simulated cluster (CLUSTER_SECTIONS: a setting of the comparison).

  Raises:
    config_errors.ConfigError: naming the --sweep flag.
  """
  axes = []
  for spec in specs:
    key, sep, values = spec.partition('=')
    keys, values = [k.strip() for k in key.split(':')], split_arg(values)
    if not sep or not all(keys) or not values:
      raise errors.ConfigError('--sweep', spec, 'expected KEY=V1,V2,... (e.g. optimizer.learning_rate=0.05,0.1) '
                               'or KEY1:KEY2=A1:B1,A2:B2,...')
    for k in keys:
      _require_hyperparameter(k, spec)
    axis = []
    for value in values:
      parts = value.split(':') if len(keys) > 1 else [value]
      if len(parts) != len(keys):
        raise errors.ConfigError('--sweep', spec, f'the value {value!r} must have {len(keys)} parts separated by '
                                 f"':', one per key of {':'.join(keys)}")
      axis.append(tuple(zip(keys, (v.strip() for v in parts))))
    repeated = sorted({value for value in values if values.count(value) > 1})
    if repeated:  # it would plan one workdir twice, and the table would count it as two seeds
      raise errors.ConfigError('--sweep', spec, f'the value {repeated[0]!r} appears twice')
    swept = {k for a in axes for k, _ in a[0]}
    if swept & set(keys):
      raise errors.ConfigError('--sweep', spec, f'{sorted(swept & set(keys))[0]} is swept twice: give all its '
                               'values in one --sweep')
    axes.append(axis)
  return [tuple(pair for group in point for pair in group) for point in itertools.product(*axes)]


def _require_hyperparameter(key: str, spec: str) -> None:
  """Raises ConfigError naming --sweep for a key a sweep must not choose: the seed or a simulated cluster's field."""
  if key == 'seed':
    raise errors.ConfigError('--sweep', spec, 'a sweep chooses hyper-parameters and seed is none: give the number '
                             'of seeds with --seeds')
  if key.split('.', 1)[0] in CLUSTER_SECTIONS:
    raise errors.ConfigError('--sweep', spec, f'{key} is a setting of the simulated cluster, not a hyper-parameter '
                             'to choose: run one comparison per value (--config.FIELD=V, each with its own --workdir)')


def _apply_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any], named: set[str]) -> None:
  """Sets each `--config.PATH=VALUE` that `config` has and the entry or sweep point does not name (`named`)."""
  given = [path for path in overrides if path not in named]
  override_duration(config, given)
  for path in given:
    node = config
    parts = path.split('.')
    for part in parts[:-1]:
      node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
    if isinstance(node, ml_collections.ConfigDict) and parts[-1] in node:
      node[parts[-1]] = overrides[path]
      mark_explicit(config, [path])


def entry_config(get_config: Callable[[str], ml_collections.ConfigDict], entry: str,
                 point: Sequence[tuple[str, str]] = (), common_pairs: Sequence[str] = (),
                 overrides: Optional[Mapping[str, Any]] = None) -> ml_collections.ConfigDict:
  """The config of `entry` at sweep `point` (not validated): the workload's `get_config` of
  'ALGORITHM,<common_pairs>,<entry pairs>,<point>', then each `--config.PATH` of `overrides` that the entry or
  the point does not name (a bare key names `resolve_key`'s path)."""
  name, *entry_pairs = split_arg(entry)
  # The entry's pairs replace the common ones they name, and the point's the entry's (a repeat inside one of
  # them is still refused by `apply_arg`).
  base = get_config(name)
  groups = [list(common_pairs), list(entry_pairs), [f'{k}={v}' for k, v in point]]
  for i, later in enumerate(groups[1:], 1):
    named = {resolve_key(base, p.partition('=')[0].strip()) for p in later}
    for j in range(i):
      groups[j] = [p for p in groups[j] if resolve_key(base, p.partition('=')[0].strip()) not in named]
  config = get_config(','.join([name, *(p for group in groups for p in group)]))
  keys = [k.strip() for k, _ in point] + [p.split('=', 1)[0].strip() for p in entry_pairs]
  _apply_overrides(config, overrides or {}, {resolve_key(config, k) for k in keys})
  return config
