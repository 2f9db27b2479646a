"""Cluster profiles: what one named cluster charges for compute, calls, collectives and the host, with sources.

A profile is a versioned JSON file (`profiles/NAME.json` ships with the package; `experiments.calibrate` writes
one for the machine at hand). A run names one with `cluster.profile` (a shipped name or a path); '' keeps the
configured `stragglers.*` / `network.*` (the ideal network by default: tests and closed forms). Every figure is
an object {"value": number, "source": "where it comes from", "estimate": true if it is one (optional),
"spread": the fitted figure's spread (optional), "range": [low, high] an estimate's range (optional),
...}. Version 1:

  version        1
  name, description
  compute        {"DATASET/MODEL": {"per_sample_s": F, "overhead_s": F}, ...}: one micro-batch call on s samples
                 costs overhead_s + s x per_sample_s (`calibration.Fit`); keyed by `dataset.name/model.name`;
                 optional "per_cpu": {"CORES": F, ...}, per_sample_s measured on a host of that many cores (a
                 cgroup quota of the test bed: `calibrate` on the bed), from which `quota_factors` takes a slow
                 host's factor
  network        {"allreduce": {"form": "ring" | "tree", "latency_s": F, "bandwidth_gbps": F},
                  "p2p": {"latency_s": F, "bandwidth_gbps": F}}: `network.Collectives` (bandwidth_gbps of an
                 all-reduce is the bus bandwidth of nccl-tests, in gigabits per second); optional "ray_p2p":
                 LINK, one direction of a push and its reply through Ray (`calibrate --ray_p2p_only`), the
                 point-to-point link of a `runtime=ray` config (`factory.effective`); in version 2 too; its
                 optional "learner_s": F, of a cycle's push and reply (2 transfers) the seconds of CPU work on the
                 learner's own host at the quota the link was measured at (`calibrate --ray_learner_only`),
                 charged as the learner's compute, at its host's factor
  host_s         F: the host's serial work per iteration, charged by the clock after every iteration
  stragglers     optional, informational (not applied: a config chooses its straggler model), e.g.
                 {"call_cv": F}, the coefficient of variation of a call's time that calibrate measured

Version 2 keeps every field of version 1 except `network`, which names a software stack (`cluster/stacks.py`: the
library's choice of algorithm, the hierarchy, host staging and reduction, a framework's cycles, congestion):

  network        {"library": "nccl" | "mpich" | "gloo",
                  "gpus_per_node": F (integer), "inter": LINK (across nodes: stacks.Stack), "p2p": LINK,
                  "intra": LINK + {"kind": "nvlink" | "pci"} (required with gpus_per_node > 1),
                  "reduce_gbps": F (the reduction's rate; 0 or absent: free), "short_msg_bytes": F (MPICH's
                  switch to Rabenseifner; default 2048), "ll128": bool (NCCL's LL128 protocol enabled),
                  "host": {"pcie_gbps": F, "passes": F} (staging through the host, and more passes of the host
                  over the vector), "framework": {"fusion_bytes": F, "cycle_s": F, "tensors": F} (Horovod's
                  cycles, or a custom op's one message per tensor; optional "request_s": the coordinator's
                  seconds per rank and tensor, with "tensors" the model's gradient tensors; optional
                  "backward_share": the backward pass's share of a micro-batch, under which the framework
                  all-reduces the gradients as they become ready: the sync rule charges what is left after it),
                  "congestion": {"free_nodes": F, "shared_fraction": F}}
                 LINK = {"latency_s": F, "bandwidth_gbps": F}
                 (`experiments.calibrate --process_counts` writes one of gloo, with the informational "fit",
                 "holdout" and "measurements" beside: the rows it fitted, the hold-out of its largest count)
A version 1 profile loads as it always did (`network.Collectives`) and gives the same times.

Every figure is checked against physical bounds (`BOUNDS`): a latency of at most a second, a bandwidth between
1 Mbit/s and 10 Pbit/s, a host time per iteration of at most an hour, ...

How a profile meets a config (`factory.effective`): the profile's per-sample and per-call figures replace the
scale of `stragglers.*` (`calibration.calibrated`: the distribution keeps its shape) and `stragglers.overhead_s`,
its collectives replace `network.*` and its host time `cluster.host_s`, except for the fields the user set
explicitly (`--config.FIELD=...` flags and `FIELD=value` pairs of the config argument, recorded in
`cluster.explicit` by the programs): those win. A workload file's own values are the defaults a profile replaces.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Sequence

from waitless import config_errors as errors
from waitless.cluster import network as network_lib
from waitless.cluster import stacks

VERSION = 1     # the flat form (`network.Collectives`), which `experiments.calibrate` writes
STRUCTURED = 2  # `network` names a software stack (`stacks.Stack`)
VERSIONS = (VERSION, STRUCTURED)
# (low, high) of each kind of figure: beyond them a figure is not a physical one (1e308 seconds of host time, a
# bandwidth of 1e-320 Gbit/s) and a run would say its workers never finish instead of naming the figure.
BOUNDS = {
    'latency_s': (0.0, 1.0), 'host_s': (0.0, 3600.0), 'per_sample_s': (0.0, 1e3), 'overhead_s': (0.0, 1e3),
    'bandwidth_gbps': (1e-3, 1e7), 'pcie_gbps': (1e-3, 1e7), 'reduce_gbps': (0.0, 1e7),
    'short_msg_bytes': (0.0, 1e12), 'fusion_bytes': (0.0, 1e12), 'cycle_s': (0.0, 10.0), 'request_s': (0.0, 1.0),
    'backward_share': (0.0, 1.0),
    'passes': (0.0, 100.0), 'gpus_per_node': (1, 1024), 'tensors': (1, 1e6), 'free_nodes': (1, 1e6),
    'shared_fraction': (0.0, 1.0),
}
_INTEGERS = ('gpus_per_node', 'tensors', 'free_nodes')
DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'profiles')
FIELD = 'cluster.profile'
# The config fields a profile gives values to (`factory.effective`); one the user set explicitly (recorded in
# `cluster.explicit`) wins over the profile. An explicit distribution field (COMPUTE_FIELDS) keeps the configured
# distribution's scale.
COMPUTE_FIELDS = ('stragglers.base_s', 'stragglers.rate', 'stragglers.shift_s', 'stragglers.scale')
PROFILE_FIELDS = COMPUTE_FIELDS + ('stragglers.overhead_s', 'network.kind', 'network.latency_s',
                                   'network.bandwidth_gbps', 'cluster.host_s')


@dataclasses.dataclass(frozen=True)
class Compute:
  """One micro-batch call on s samples costs overhead_s + s x per_sample_s."""
  per_sample_s: float  # > 0
  overhead_s: float    # >= 0
  per_cpu: tuple[tuple[float, float], ...] = ()  # (cores, per_sample_s measured on a host of that quota), ...


@dataclasses.dataclass(frozen=True)
class Profile:
  """A loaded, validated profile (the figures' values; the sources stay in the file)."""
  name: str
  compute: Mapping[str, Compute]  # 'dataset/model' -> figures
  network: network_lib.Collectives | stacks.Stack
  host_s: float
  ray_p2p: network_lib.AlphaBeta | None = None  # a push or a reply through Ray (None: not measured)
  ray_learner_s: float = 0.0  # of a cycle's push and reply, the learner host's CPU work (0: not measured)

  def compute_for(self, model: str) -> Compute:
    """The compute figures of `model` ('dataset/model'); a ConfigError naming the field if the profile has none."""
    errors.require(model in self.compute, f'{FIELD}[{self.name}].compute', model,
                   f'this profile is written for {", ".join(sorted(self.compute)) or "no model"}; measure this one '
                   f'with experiments.calibrate, or add a "{model}" entry')
    return self.compute[model]


def names() -> list[str]:
  """The shipped profiles' names (the JSON files in `profiles/`)."""
  return sorted(f[:-len('.json')] for f in os.listdir(DIRECTORY) if f.endswith('.json'))


def path_of(name_or_path: str) -> str:
  """The file of a shipped name, or `name_or_path` itself when it names a file (a path or a .json name)."""
  if name_or_path.endswith('.json') or os.sep in name_or_path:
    errors.require(os.path.isfile(name_or_path), FIELD, name_or_path, 'file not found')
    return name_or_path
  errors.require(name_or_path in names(), FIELD, name_or_path,
                 f'unknown profile; shipped: {", ".join(names())}; or the path of a profile JSON file')
  return os.path.join(DIRECTORY, name_or_path + '.json')


def read(name_or_path: str) -> dict[str, Any]:
  """The profile's JSON document (not validated: `load` does that)."""
  path = path_of(name_or_path)
  try:
    with open(path) as f:
      doc = json.load(f)
  except (OSError, ValueError) as e:
    raise errors.ConfigError(FIELD, name_or_path, f'must be a readable JSON file ({e})') from e
  except RecursionError as e:
    raise errors.ConfigError(FIELD, name_or_path,
                             'must be a profile JSON file (this one nests too deeply to read)') from e
  errors.require(isinstance(doc, dict), FIELD, name_or_path, 'must hold a JSON object')
  return doc


def _node(doc: Mapping[str, Any], path: tuple[str, ...], where: str):
  node = doc
  for i, key in enumerate(path):
    if i:
      errors.require(isinstance(node, dict), f'{where}.{".".join(path[:i])}', node,
                     'must be a JSON object (see cluster/profiles.py for the fields)')
    errors.require(key in node, f'{where}.{".".join(path[:i + 1])}', 'missing',
                   'required (see cluster/profiles.py for the fields)')
    node = node[key]
  return node


def _object(doc: Mapping[str, Any], path: tuple[str, ...], where: str) -> dict:
  node = _node(doc, path, where)
  errors.require(isinstance(node, dict), f'{where}.{".".join(path)}', node,
                 'must be a JSON object (see cluster/profiles.py for the fields)')
  return node


def figure(doc: Mapping[str, Any], path: tuple[str, ...], where: str, positive: bool = False) -> float:
  """The value of the figure at `path`: {"value": finite number >= 0 (> 0 if `positive`), within the physical
  bounds of its kind (`BOUNDS`, by the last key of `path`), "source": text}."""
  node = _node(doc, path, where)
  field = f'{where}.{".".join(path)}'
  errors.require(isinstance(node, dict), field, node, 'must be an object {"value": number, "source": "..."}')
  value = node.get('value', 'missing')
  low, high = BOUNDS.get(path[-1], (0.0, math.inf))
  integer = path[-1] in _INTEGERS
  if positive and low == 0:
    bound, ok = f'> 0 and <= {high:g}', (lambda v: 0 < v <= high)
  else:
    bound, ok = f'>= {low:g} and <= {high:g}', (lambda v: low <= v <= high)
  if integer:
    errors.require(errors.is_int(value) and ok(value), f'{field}.value', value, f'must be an integer {bound}')
  else:
    errors.require_number(value, f'{field}.value', f'must be a number {bound}', ok)
  source = node.get('source')
  errors.require(isinstance(source, str) and bool(source.strip()), f'{field}.source', source,
                 'every figure cites where it comes from (a measurement, a publication, or "estimate: ...")')
  if 'range' in node:  # an estimate's range: [low, high] around its value
    span = node['range']
    ok = (isinstance(span, list) and len(span) == 2 and all(errors.is_number(v) for v in span)
          and span[0] <= value <= span[1])
    errors.require(ok, f'{field}.range', span, f'must be [low, high] numbers with low <= value ({value}) <= high')
  return float(value)


def _link(doc, kind: str, where: str) -> network_lib.AlphaBeta:
  return network_lib.AlphaBeta(latency_s=figure(doc, ('network', kind, 'latency_s'), where),
                               bandwidth_gbps=figure(doc, ('network', kind, 'bandwidth_gbps'), where, positive=True))


def _stack(doc: Mapping[str, Any], where: str) -> stacks.Stack:
  net = _object(doc, ('network',), where)
  library = net.get('library', 'missing')
  errors.require(library in stacks.LIBRARIES, f'{where}.network.library', library,
                 f'one of {", ".join(stacks.LIBRARIES)}')
  gpus = int(figure(doc, ('network', 'gpus_per_node'), where))
  intra, kind = None, 'pci'
  if 'intra' in net or gpus > 1:
    intra = _link(doc, 'intra', where)
    kind = _object(doc, ('network', 'intra'), where).get('kind', 'missing')
    errors.require(kind in stacks.INTRA_KINDS, f'{where}.network.intra.kind', kind,
                   f'one of {", ".join(stacks.INTRA_KINDS)}')
  ll128 = net.get('ll128', False)
  errors.require(isinstance(ll128, bool), f'{where}.network.ll128', ll128, 'must be true or false')

  def optional(key: str, default: float) -> float:
    return figure(doc, ('network', key), where) if key in net else default

  host = framework = congestion = None
  if 'host' in net:
    node = _object(doc, ('network', 'host'), where)
    host = stacks.Host(pcie_gbps=figure(doc, ('network', 'host', 'pcie_gbps'), where, positive=True),
                       passes=figure(doc, ('network', 'host', 'passes'), where) if 'passes' in node else 0.0)
  if 'framework' in net:
    node = _object(doc, ('network', 'framework'), where)
    framework = stacks.Framework(
        fusion_bytes=figure(doc, ('network', 'framework', 'fusion_bytes'), where),
        cycle_s=figure(doc, ('network', 'framework', 'cycle_s'), where),
        tensors=int(figure(doc, ('network', 'framework', 'tensors'), where)) if 'tensors' in node else 1,
        request_s=figure(doc, ('network', 'framework', 'request_s'), where) if 'request_s' in node else 0.0,
        backward_share=(figure(doc, ('network', 'framework', 'backward_share'), where)
                        if 'backward_share' in node else 0.0))
  if 'congestion' in net:
    _object(doc, ('network', 'congestion'), where)
    congestion = stacks.Congestion(
        free_nodes=int(figure(doc, ('network', 'congestion', 'free_nodes'), where)),
        shared_fraction=figure(doc, ('network', 'congestion', 'shared_fraction'), where, positive=True))
  return stacks.Stack(library=library, gpus_per_node=gpus, inter=_link(doc, 'inter', where),
                      p2p_link=_link(doc, 'p2p', where), intra=intra, intra_kind=kind,
                      reduce_gbps=optional('reduce_gbps', 0.0), short_msg_bytes=optional('short_msg_bytes', 2048.0),
                      ll128=ll128, host=host, framework=framework, congestion=congestion)


def _per_cpu(doc: Mapping[str, Any], model: str, where: str) -> tuple[tuple[float, float], ...]:
  """compute[model].per_cpu as ((cores, per_sample_s), ...), fastest quota first; () when absent."""
  node = doc['compute'][model]
  if not isinstance(node, dict) or 'per_cpu' not in node:
    return ()
  per_cpu = _object(doc, ('compute', model, 'per_cpu'), where)
  out = []
  for key in per_cpu:
    cores = _cores(key)
    errors.require(cores is not None and cores > 0, f'{where}.compute.{model}.per_cpu', key,
                   'its keys are cores (a host\'s quota, e.g. "0.8"), numbers > 0')
    out.append((cores, figure(per_cpu, (key,), f'{where}.compute.{model}.per_cpu', positive=True)))
  return tuple(sorted(out, reverse=True))


def _cores(key: str) -> float | None:
  try:
    value = float(key)
  except ValueError:
    return None
  return value if math.isfinite(value) else None


def quota_factors(compute: Compute, cpus: Sequence[float]) -> tuple[float, ...] | None:
  """Each host's compute factor against the fastest of `cpus` (hosts of those cores), from the per-sample times
  measured at those quotas (`compute.per_cpu`): a quota does not slow compute in proportion to its cores. None
  when a quota of `cpus` was not measured (the caller falls back to the quotas' ratio)."""
  measured = dict(compute.per_cpu)
  if not cpus or any(c not in measured for c in cpus):
    return None
  fastest = min(measured[c] for c in cpus)
  return tuple(measured[c] / fastest for c in cpus)


def parse(doc: Mapping[str, Any], label: str) -> Profile:
  """Validates a profile document; `label` names it in errors (`cluster.profile[LABEL].FIELD`)."""
  where = f'{FIELD}[{label}]'
  version = doc.get('version', 'missing')
  errors.require(errors.is_int(version) and version in VERSIONS, f'{where}.version', version,
                 f'this version of waitless reads versions {" and ".join(map(str, VERSIONS))}')
  compute = _node(doc, ('compute',), where)
  errors.require(isinstance(compute, dict) and bool(compute), f'{where}.compute', compute,
                 'must map "dataset/model" to {"per_sample_s": ..., "overhead_s": ...}')
  models = {model: Compute(per_sample_s=figure(doc, ('compute', model, 'per_sample_s'), where, positive=True),
                           overhead_s=figure(doc, ('compute', model, 'overhead_s'), where),
                           per_cpu=_per_cpu(doc, model, where))
            for model in compute}
  if version == STRUCTURED:
    net = _stack(doc, where)
  else:
    form = _object(doc, ('network', 'allreduce'), where).get('form', 'ring')
    errors.require(form in network_lib.ALLREDUCE_FORMS, f'{where}.network.allreduce.form', form,
                   f'one of {", ".join(network_lib.ALLREDUCE_FORMS)}')
    _object(doc, ('network', 'p2p'), where)
    net = network_lib.Collectives(allreduce_link=_link(doc, 'allreduce', where), p2p_link=_link(doc, 'p2p', where),
                                  form=form)
  ray = _link(doc, 'ray_p2p', where) if 'ray_p2p' in _object(doc, ('network',), where) else None
  learner = 0.0
  if ray is not None and 'learner_s' in _object(doc, ('network', 'ray_p2p'), where):
    learner = figure(doc, ('network', 'ray_p2p', 'learner_s'), where)
    errors.require(0.0 <= learner, f'{where}.network.ray_p2p.learner_s', learner, 'must be >= 0')
  return Profile(name=str(doc.get('name', label)), compute=models, network=net,
                 host_s=figure(doc, ('host_s',), where), ray_p2p=ray, ray_learner_s=learner)


def load(name_or_path: str) -> Profile:
  """The validated profile of a shipped name or a file (ConfigError naming the field: one line)."""
  errors.require(isinstance(name_or_path, str) and bool(name_or_path), FIELD, name_or_path,
                 f'must be a shipped name ({", ".join(names())}) or the path of a profile JSON file')
  return parse(read(name_or_path), name_or_path)


def model_key(config) -> str:
  """'dataset/model' of a config: the key of its compute figures."""
  dataset, model = config.get('dataset'), config.get('model')
  errors.require(dataset is not None and model is not None, FIELD, config.cluster.profile,
                 'a profile gives compute per model: the config needs dataset.name and model.name')
  return f'{dataset.name}/{model.name}'
