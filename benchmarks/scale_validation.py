"""Held-out validation of the structured collective model (`waitless/cluster/stacks.py`) on published scaling tables.

`benchmarks/published_tables.json` (with `published_tables.md`, its README: sources, how each figure was read,
caveats) holds the tables, collected by someone other than the modeller, with citations and each table's settings.
No figure of any profile was set from them: every profile's network terms were committed before the tables were
read (docs/results/scale.md names the commits). The one figure a table sets is its compute: the step time of its
first cell (one GPU or one node, or the smallest count it publishes), less the model's communication there. That
cell is then out of the validation; every other cell is predicted:

  step(cell)   = a x slowest(t_micro, P) + comm(cell)      a = the cell's gradient-accumulation steps (1 if none)
  t_micro      solves the same equation at the base cell with the published step there,
               step(base) = a_base b / (the base's per-GPU rate)
  predicted    = gpus x a b / step(cell)                (b the batch per GPU)
  comm         all-reduce families: what the profile's stack leaves after the backward pass (`cluster/step.py`:
               `exposed(gradient bytes, GPUs, BACKWARD_SHARE x t_micro)`), with the framework (Horovod's fusion
               buffer and cycle, DDP's buckets) of the version the table states, which all-reduces gradients as
               they become ready; no overlap with gradient accumulation (the accumulated gradients are all-reduced
               after the last micro-batch) or without a framework (one flat all-reduce); Horovod 0.15's
               coordinator handles every rank's request for every tensor (`REQUEST_S`);
               parameter servers: the NCCL all-reduce inside a node and `ps_exchange` among the nodes, no overlap
  slowest      the expected slowest of P workers' computes, `step.slowest` with `STEP_CV`

The simulator's sync rule still charges compute and then the whole all-reduce (no overlap), so for the same
stack it charges more than these predictions; it samples each worker's compute, so it needs no closed form for the
slowest. The step's own estimates (the backward share, the variation, the coordinator's cost per request)
are put at their ranges' ends with the profiles' (`SLOW`, `FAST`).
A table whose cluster has no profile committed before the tables were read, or
whose settings leave the batch or the gradient bytes unknown, is listed with the reason and not predicted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

import numpy as np

from waitless.cluster import network as network_lib
from waitless.cluster import profiles
from waitless.cluster import stacks
from waitless.cluster import step as step_lib

TABLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'published_tables.json')
TARGET_CELL, TARGET_MEAN = 0.15, 0.05

# Horovod's defaults by version (horovod/horovod CHANGELOG v0.21.0, #2468): before 0.21, 64 MB and 5 ms.
HOROVOD_OLD = stacks.Framework(fusion_bytes=64 * 2**20, cycle_s=0.005)
# Horovod 0.15's coordinator (horovod/horovod v0.15 horovod/common/operations.cc): every cycle each rank sends rank 0
# its list of ready tensors (MPI_Gather of the lengths, MPI_Gatherv of the serialised MPIRequestLists); rank 0
# parses them and, per request, `IncrementTensorCount` copies the MPIRequest (tensor name, shape) into the message
# table (an unordered_map keyed by the name), then builds one response per ready tensor from its P requests;
# the response cache that replaced this for tensors seen before came later, with horovod/horovod PR #902 (which
# release first shipped it was not checked: the 0.16 tables, at most 12 nodes, are not charged it).
# So rank 0 handles P x tensors requests per step, on the thread that also runs the all-reduces.
REQUEST_S = step_lib.Estimate(
    1e-6, 2e-7, 5e-6,
    'estimate: one request parsed, copied and counted in a hash map keyed by a string (a few hundred nanoseconds '
    'to a few microseconds on a Haswell core), and its share of the response: range 0.2-5 us')
# Gradient tensors of the models the Horovod 0.15 table trains: tf_cnn_benchmarks' ResNet-50 v1, 53 convolution
# kernels, 53 batch normalisations' scale and offset, the classifier's weights and bias: 161 (as
# piz_daint_wagma's one message per tensor).
RESNET50_TENSORS = 161
HOROVOD_015 = dataclasses.replace(HOROVOD_OLD, tensors=RESNET50_TENSORS, request_s=REQUEST_S.value)
HOROVOD_021 = stacks.Framework(fusion_bytes=128 * 2**20, cycle_s=0.001)
# PyTorch DistributedDataParallel's default bucket_cap_mb = 25 (torch/nn/parallel/distributed.py); no cycle.
DDP_BUCKETS = stacks.Framework(fusion_bytes=25 * 2**20, cycle_s=0.0)
# A parameter server's variables live on the host: the gradients leave the GPU and the variables come back over
# PCIe gen3 x16, 12.22 GB/s (CSCS's cudaMemcpy references on Piz Daint, as the profiles cite).
PS_HOST = stacks.Host(pcie_gbps=97.8)


@dataclasses.dataclass(frozen=True)
class Plan:
  """How a table is predicted: the stack, and 'allreduce' or 'ps'; the profile whose estimates bound it."""
  stack: stacks.Stack
  kind: str
  note: str
  profile: str = ''


def _profile_stack(name: str) -> stacks.Stack:
  net = profiles.load(name).network
  assert isinstance(net, stacks.Stack), name
  return net


def _plan(table: dict) -> tuple[Optional[Plan], str]:
  """(the plan, '') for a table the model predicts, or (None, why not)."""
  tid, s = table['id'], table['setting']
  stack_text = s.get('stack') or ''
  if tid.startswith('sarus_hvd015_nonccl'):
    stack = dataclasses.replace(_profile_stack('piz_daint'), framework=HOROVOD_015)
    return Plan(stack, 'allreduce', 'piz_daint: Horovod 0.15 over Cray MPICH, host staging'), ''
  if tid.startswith(('sarus_hvd016_nccl', 'reframe_')):
    stack = dataclasses.replace(_profile_stack('piz_daint_nccl'), framework=HOROVOD_OLD)
    return Plan(stack, 'allreduce', 'piz_daint_nccl with Horovod < 0.21 (64 MB, 5 ms)'), ''
  if tid.startswith('ebug_tf11_ps_inception3_daint'):
    nccl = _profile_stack('piz_daint_nccl')
    return Plan(dataclasses.replace(nccl, host=PS_HOST), 'ps',
                'parameter servers over gRPC/TCP on Aries: piz_daint_nccl\'s TCP link, variables on the host'), ''
  if tid.startswith(('ebug_tf11_ps_inception3_p28xl', 'tfbench_p2_8xl_dist')):
    return Plan(dataclasses.replace(_profile_stack('aws_p2_8xlarge'), host=PS_HOST), 'ps',
                'aws_p2_8xlarge: NCCL over PCIe inside, parameter servers over gRPC/TCP between instances'), ''
  if tid.startswith(('hvd_issue', 'awssamples_')):
    return Plan(dataclasses.replace(_profile_stack('aws_p3_16xlarge'), framework=HOROVOD_OLD), 'allreduce',
                'aws_p3_16xlarge with Horovod < 0.21 (64 MB, 5 ms)'), ''
  if tid.startswith(('dle_pt_bert_dgxa100', 'dle_tf1_bert_dgxa100', 'dle_tf2_bert_dgxa100')):
    return _dle(_profile_stack('multinode_a100_hdr'), tid, 'multinode_a100_hdr'), ''
  if tid.startswith(('dle_tf1_bert_dgx2h', 'dle_tf2_bert_dgx2h', 'dle_pt_bert_dgx2h', 'dle_pt_txl_large_dgx2h')):
    return _dle(_profile_stack('dgx2h'), tid, 'dgx2h'), ''
  if tid.startswith('ebug_tf11_ps_inception3_p2xl'):
    return None, 'AWS p2.xlarge: no profile (its network, "High", has no figure in any source read)'
  if tid.startswith('tfbench_dgx1') or tid.startswith('dle_pt_bert_dgx1'):
    return None, 'DGX-1: no profile committed before the tables were read'
  if tid.startswith('hvd_readme2017'):
    return None, 'Uber\'s 2017 cluster: GPU and versions not stated, no profile'
  if tid.startswith('dlperf_'):
    return None, 'DLPerf\'s cluster (4 x 8 V100, 1 EDR NIC per node): no profile committed before the tables were read'
  return None, f'no plan for this table ({stack_text[:60]})'


_PROFILE_OF = (('sarus_hvd015', 'piz_daint'), ('sarus_hvd016', 'piz_daint_nccl'), ('reframe_', 'piz_daint_nccl'),
               ('ebug_tf11_ps_inception3_daint', 'piz_daint_nccl'), ('ebug_tf11_ps_inception3_p28xl', 'aws_p2_8xlarge'),
               ('tfbench_p2_8xl', 'aws_p2_8xlarge'), ('hvd_issue', 'aws_p3_16xlarge'),
               ('awssamples_', 'aws_p3_16xlarge'), ('dle_pt_bert_dgxa100', 'multinode_a100_hdr'),
               ('dle_tf1_bert_dgxa100', 'multinode_a100_hdr'), ('dle_tf2_bert_dgxa100', 'multinode_a100_hdr'),
               ('dle_', 'dgx2h'))


def plan(table: dict) -> tuple[Optional[Plan], str]:
  """(the plan, '') for a table the model predicts, or (None, why not)."""
  p, why = _plan(table)
  if p is not None:
    name = next(profile for prefix, profile in _PROFILE_OF if table['id'].startswith(prefix))
    p = dataclasses.replace(p, profile=name)
  return p, why


# ---- the estimates' ranges: every term marked an estimate with a range, at its slow end and at its fast end ----

def _ranges(profile: str) -> list[tuple[tuple[str, ...], float, float]]:
  with open(profiles.path_of(profile)) as f:
    doc = json.load(f)
  out = []

  def walk(node, path):
    if isinstance(node, dict) and 'value' in node and 'source' in node:
      if node.get('estimate') and node.get('range'):
        out.append((path, float(node['range'][0]), float(node['range'][1])))
    elif isinstance(node, dict):
      for key, value in node.items():
        walk(value, path + (key,))
  walk(doc['network'], ())
  return out


def _with(stack: stacks.Stack, path: tuple[str, ...], value: float) -> stacks.Stack:
  link = lambda old: network_lib.AlphaBeta(value, old.bandwidth_gbps) if path[-1] == 'latency_s' \
      else network_lib.AlphaBeta(old.latency_s, value)
  if path[0] == 'intra' and stack.intra is not None:
    return dataclasses.replace(stack, intra=link(stack.intra))
  if path[0] == 'inter':
    return dataclasses.replace(stack, inter=link(stack.inter))
  if path[0] == 'p2p':
    return dataclasses.replace(stack, p2p_link=link(stack.p2p_link))
  if path == ('reduce_gbps',):
    return dataclasses.replace(stack, reduce_gbps=value)
  if path == ('host', 'pcie_gbps') and stack.host is not None:
    return dataclasses.replace(stack, host=dataclasses.replace(stack.host, pcie_gbps=value))
  if path == ('congestion', 'shared_fraction') and stack.congestion is not None:
    return dataclasses.replace(stack, congestion=dataclasses.replace(stack.congestion, shared_fraction=value))
  return stack


def bounds(p: Plan) -> tuple[stacks.Stack, stacks.Stack]:
  """The plan's stack with every estimate at the slow end of its range (latencies high, bandwidths and rates
  low), and at the fast end."""
  slow, fast = p.stack, p.stack
  for path, low, high in _ranges(p.profile):
    latency = path[-1] == 'latency_s'
    slow = _with(slow, path, high if latency else low)
    fast = _with(fast, path, low if latency else high)
  return slow, fast


def _dle(stack: stacks.Stack, tid: str, name: str) -> Plan:
  if tid.startswith('dle_tf2'):
    return Plan(dataclasses.replace(stack, framework=HOROVOD_021), 'allreduce', f'{name} with Horovod 0.21 (NGC 21.02)')
  if tid.startswith('dle_tf1'):
    return Plan(dataclasses.replace(stack, framework=HOROVOD_OLD), 'allreduce',
                f'{name} with Horovod < 0.21 (NGC 19.08 / 20.06)')
  if tid.startswith('dle_pt_txl'):
    return Plan(dataclasses.replace(stack, framework=DDP_BUCKETS), 'allreduce', f'{name} with DDP\'s 25 MB buckets')
  return Plan(stack, 'allreduce', f'{name}, one flat all-reduce per optimizer step')


def _int(value) -> Optional[int]:
  if value is None:
    return None
  if isinstance(value, (int, float)):
    return int(value)
  match = re.match(r'\s*(\d+)', str(value))
  return int(match.group(1)) if match and 'sic' not in str(value) else None


def base_unit_tokens(table: dict) -> bool:
  return table['cells'][0].get('unit', '').startswith('tokens')


def _tokens_per_sample(setting: dict) -> int:
  """A table in tokens/s with its batch in sequences: the tokens of one sequence (Transformer-XL's tgt_len)."""
  match = re.search(r'tgt_len (\d+)', setting.get('model', ''))
  return int(match.group(1)) if match else 0


def _servers(table: dict, cell: dict) -> int:
  if 'num_ps' in cell:
    return int(cell['num_ps'])
  text = table['setting'].get('parameter_servers') or ''
  if 'InceptionV3: 8 instances / 6' in text and 'nception' in table['setting'].get('model', '') \
     and cell['nodes'] == 8:
    return 6
  return int(cell['nodes'])  # "equal numbers of PS and worker servers"


def comm(p: Plan, table: dict, cell: dict, nbytes: float) -> float:
  gpus, nodes = int(cell['gpus']), int(cell['nodes'])
  if p.kind == 'allreduce':
    return p.stack.allreduce(nbytes, gpus)
  inside = p.stack.allreduce(nbytes, min(gpus, p.stack.gpus_per_node)) if gpus > 1 else 0.0
  # Inside a node the GPUs reduce by NCCL (tf_cnn_benchmarks' use_nccl / replicated), without the host's terms.
  if gpus > 1:
    bare = dataclasses.replace(p.stack, host=None, framework=None)
    inside = bare.allreduce(nbytes, min(gpus, p.stack.gpus_per_node))
  return inside + p.stack.ps_exchange(nbytes, nodes, _servers(table, cell))


@dataclasses.dataclass(frozen=True)
class StepTerms:
  """The step's own estimates (`cluster/step.py`, and Horovod 0.15's coordinator): the backward pass's share of a
  micro-batch's compute, the variation of a worker's compute, the coordinator's seconds per request."""
  backward_share: float
  cv: float
  request_s: float


NOMINAL = StepTerms(step_lib.BACKWARD_SHARE.value, step_lib.STEP_CV.value, REQUEST_S.value)
# The slow end: the least overlap, the most variation, the slowest coordinator; the fast end the reverse.
SLOW = StepTerms(step_lib.BACKWARD_SHARE.low, step_lib.STEP_CV.high, REQUEST_S.high)
FAST = StepTerms(step_lib.BACKWARD_SHARE.high, step_lib.STEP_CV.low, REQUEST_S.low)


def _terms_stack(stack: stacks.Stack, terms: StepTerms) -> stacks.Stack:
  f = stack.framework
  if f is None or f.request_s <= 0:
    return stack
  return dataclasses.replace(stack, framework=dataclasses.replace(f, request_s=terms.request_s))


def step_seconds(p: Plan, table: dict, cell: dict, nbytes: float, micro: float, accum: int,
                 terms: StepTerms) -> float:
  """A cell's step: `accum` micro-batches of the slowest of its GPUs, then what the step waits for of its
  communication (the all-reduce families overlap it with the last backward pass where the framework does and the
  step does not accumulate; the parameter servers do not overlap here)."""
  gpus = int(cell['gpus'])
  compute = accum * step_lib.slowest(micro, gpus, terms.cv)
  if p.kind == 'allreduce':
    backward = terms.backward_share * micro if accum == 1 else 0.0
    return compute + step_lib.exposed(p.stack, nbytes, gpus, backward)
  return compute + comm(p, table, cell, nbytes)


def solve_micro(p: Plan, table: dict, base: dict, nbytes: float, accum: int, step: float,
                terms: StepTerms) -> Optional[float]:
  """The micro-batch compute whose step at the base cell is the published `step` (bisection); None if the
  communication alone takes longer."""
  lo, hi = 0.0, step / accum
  if step_seconds(p, table, base, nbytes, 1e-12, accum, terms) >= step:
    return None
  for _ in range(100):
    mid = 0.5 * (lo + hi)
    if step_seconds(p, table, base, nbytes, mid, accum, terms) < step:
      lo = mid
    else:
      hi = mid
  return 0.5 * (lo + hi)


@dataclasses.dataclass
class Row:
  table: str
  cluster: str
  stack: str
  model: str
  gpus: int
  nodes: int
  published: float
  predicted: Optional[float]
  unit: str
  note: str = ''
  band: Optional[tuple[float, float]] = None  # predicted with the estimates at their ranges' two ends

  @property
  def error(self) -> Optional[float]:
    return None if self.predicted is None else self.predicted / self.published - 1


def validate(tables: Optional[list] = None) -> tuple[list[Row], list[tuple[str, str, int]]]:
  """(every predicted cell's row, [(table, why not predicted, cells)] for the others; base cells are excluded)."""
  if tables is None:
    with open(TABLES) as f:
      tables = json.load(f)
  rows, skipped = [], []
  for table in tables:
    s = table['setting']
    p, why = plan(table)
    cells = table['cells']
    nbytes = s.get('gradient_bytes')
    batch = _int(s.get('batch_per_gpu'))
    if len(cells) < 2:
      skipped.append((table['id'], 'one cell: the base, which sets the compute', 0))
      continue
    if p is None or not nbytes or not batch:
      why = why or ('gradient bytes not given' if not nbytes else 'batch per GPU not given')
      skipped.append((table['id'], why, len(cells) - 1))
      continue
    if base_unit_tokens(table) and not _tokens_per_sample(s):
      skipped.append((table['id'], 'throughput in tokens and no sequence length', len(cells) - 1))
      continue
    batch *= _tokens_per_sample(s) if base_unit_tokens(table) else 1
    base = cells[0]
    accum0 = _int(base.get('grad_accum_steps', 1))
    step0 = accum0 * batch / (base['throughput'] / base['gpus'])
    ends = [(dataclasses.replace(p, stack=_terms_stack(stack, terms)), terms)
            for stack, terms in zip(bounds(p), (SLOW, FAST))]
    nominal = dataclasses.replace(p, stack=_terms_stack(p.stack, NOMINAL))
    micro = solve_micro(nominal, table, base, nbytes, accum0, step0, NOMINAL)
    micros = [solve_micro(q, table, base, nbytes, accum0, step0, terms) for q, terms in ends]
    for cell in cells[1:]:
      row = Row(table['id'], s.get('cluster', '')[:40], p.note, s.get('model', '')[:30], int(cell['gpus']),
                int(cell['nodes']), float(cell['throughput']), None, cell.get('unit', ''))
      accum = _int(cell.get('grad_accum_steps', 1))
      if accum is None:
        row.note = f'gradient accumulation unreadable ({cell.get("grad_accum_steps")!r})'
      elif micro is None:
        row.note = 'the model charges more communication at the base cell than its whole step'
      elif (cell['gpus'], cell['nodes']) == (base['gpus'], base['nodes']):
        row.note = 'the base cell\'s own count (another run of it)'
      else:
        rate = lambda q, m, terms: cell['gpus'] * accum * batch / step_seconds(q, table, cell, nbytes, m, accum, terms)
        row.predicted = rate(nominal, micro, NOMINAL)
        band = [rate(q, m, terms) for (q, terms), m in zip(ends, micros) if m is not None]
        row.band = (min(band + [row.predicted]), max(band + [row.predicted]))
      rows.append(row)
  return rows, skipped


def summary(rows: list[Row]) -> dict:
  errors = np.array([r.error for r in rows if r.error is not None])
  within = np.abs(errors) <= TARGET_CELL
  inside = sum(1 for r in rows if r.band is not None and r.band[0] <= r.published <= r.band[1])
  return {'cells': int(len(errors)), 'within_15': int(within.sum()), 'mean_error': float(np.mean(errors)),
          'inside_band': inside,
          'mean_abs_error': float(np.mean(np.abs(errors))), 'max_abs_error': float(np.max(np.abs(errors)))}


def print_validation(rows: list[Row], skipped: list) -> None:
  print('| table | cluster | stack (profile) | model | nodes | GPUs | published | predicted | error '
        '| predicted with the estimates at their ranges\' ends |')
  print('| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |')
  for r in rows:
    pred = '-' if r.predicted is None else f'{r.predicted:,.0f}'
    miss = r.error is not None and abs(r.error) > TARGET_CELL
    err = r.note if r.error is None else f'{100 * r.error:+.1f}%' + (' **miss**' if miss else '')
    band = '-' if r.band is None else (f'{r.band[0]:,.0f} - {r.band[1]:,.0f}'
                                       + ('' if r.band[0] <= r.published <= r.band[1] else ' (outside)'))
    print(f'| {r.table} | {r.cluster} | {r.stack} | {r.model} | {r.nodes} | {r.gpus} | {r.published:,.0f} {r.unit} '
          f'| {pred} | {err} | {band} |')
  print()
  s = summary(rows)
  print(f'{s["cells"]} cells predicted: {s["within_15"]} within {100 * TARGET_CELL:.0f}% '
        f'(target: all); mean error {100 * s["mean_error"]:+.1f}% (target: within {100 * TARGET_MEAN:.0f}%), '
        f'mean |error| {100 * s["mean_abs_error"]:.1f}%, largest |error| {100 * s["max_abs_error"]:.1f}%; '
        f'{s["inside_band"]} published cells lie between the predictions with every estimate at the slow and at the '
        f'fast end of its range')
  by_group: dict = {}
  for r in rows:
    if r.error is not None:
      by_group.setdefault(r.table.rsplit('_', 1)[0] if r.table.startswith('sarus') else r.table.split('_')[0] + '_'
                          + r.table.split('_')[1], []).append(r.error)
  print('\n| family | cells | within 15% | mean error | mean abs error |')
  print('| --- | ---: | ---: | ---: | ---: |')
  for group, errs in by_group.items():
    e = np.array(errs)
    print(f'| {group} | {len(e)} | {int((np.abs(e) <= TARGET_CELL).sum())} | {100 * e.mean():+.1f}% '
          f'| {100 * np.abs(e).mean():.1f}% |')
  by_p: dict = {}
  for r in rows:
    if r.error is not None:
      by_p.setdefault(r.nodes, []).append(r.error)
  print('\n| nodes | cells | within 15% | mean error |')
  print('| ---: | ---: | ---: | ---: |')
  for nodes in sorted(by_p):
    e = np.array(by_p[nodes])
    print(f'| {nodes} | {len(e)} | {int((np.abs(e) <= TARGET_CELL).sum())} | {100 * e.mean():+.1f}% |')
  print('\nNot predicted (cells besides the base cell):')
  for tid, why, n in skipped:
    print(f'- {tid} ({n} cells): {why}')

