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
               parameter servers: the NCCL all-reduce inside a node and the host staging after the compute, and
               `ps_exchange`'s pushes and pulls under it as far as `step.ps_exposed` hides them (pushes under the
               backward pass; pulls under the forward pass with variable_update=parameter_server, after the step
               with distributed_replicated); where the code the table ran is at hand (e-bug's copy of
               tf_cnn_benchmarks), the busiest server holds what TensorFlow's round-robin placement of the
               model's variables gives it (`busiest_shard`)
  slowest      the expected slowest of P workers' computes, `step.slowest` with `STEP_CV`

The simulator's sync rule still charges compute and then the whole all-reduce (no overlap), so for the same
stack it charges more than these predictions; it samples each worker's compute, so it needs no closed form for the
slowest. The step's own estimates (the backward share, the variation, the coordinator's cost per request)
are put at their ranges' ends with the profiles' (`SLOW`, `FAST`).
`print_misses` lists the cells beyond the target with the seconds per step (and per micro-batch) they take beyond
the prediction, and `least_error`: whether any cost paid once per step could reproduce their table at all.
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
import scipy.optimize

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


# The variables of tf_cnn_benchmarks' InceptionV3 as e-bug/distributed-tensorflow-benchmarks ran it (its copy,
# google-benchmarks/tf_cnn_benchmarks: inception_model.py's layers; ConvNetBuilder.conv without batch norm creates
# a kernel, then its biases; the final affine layer's weights (2048 x 1001) and biases), in the order they are
# created; the global step comes first (`get_or_create_global_step` under the same device setter). Its
# `tf.train.replica_device_setter(worker_device=..., cluster=...)` has no `ps_strategy`: round-robin (stacks.py).
def _inception3_variables() -> list[float]:
  out, size = [], [3]

  def conv(channels, kh, kw, *_):
    out.extend([4.0 * kh * kw * size[0] * channels, 4.0 * channels])
    size[0] = channels

  def module(cols):
    inputs, sizes = size[0], []
    for c, col in enumerate(cols):
      sizes.append([])
      for i, (kind, *args) in enumerate(col):
        if i == 0:
          size[0] = inputs
        if kind == 'conv':
          conv(*args)
        elif kind == 'share':  # the previous column's layer
          size[0] = sizes[c - 1][i]
        sizes[c].append(size[0])
    size[0] = sum(col[-1] for col in sizes)

  pool = ('pool',)
  a = lambda n: [[('conv', 64, 1, 1)], [('conv', 48, 1, 1), ('conv', 64, 5, 5)],
                 [('conv', 64, 1, 1), ('conv', 96, 3, 3), ('conv', 96, 3, 3)], [pool, ('conv', n, 1, 1)]]
  b = [[('conv', 384, 3, 3)], [('conv', 64, 1, 1), ('conv', 96, 3, 3), ('conv', 96, 3, 3)], [pool]]
  c = lambda n: [[('conv', 192, 1, 1)], [('conv', n, 1, 1), ('conv', n, 1, 7), ('conv', 192, 7, 1)],
                 [('conv', n, 1, 1), ('conv', n, 7, 1), ('conv', n, 1, 7), ('conv', n, 7, 1), ('conv', 192, 1, 7)],
                 [pool, ('conv', 192, 1, 1)]]
  d = [[('conv', 192, 1, 1), ('conv', 320, 3, 3)],
       [('conv', 192, 1, 1), ('conv', 192, 1, 7), ('conv', 192, 7, 1), ('conv', 192, 3, 3)], [pool]]
  e = [[('conv', 320, 1, 1)], [('conv', 384, 1, 1), ('conv', 384, 1, 3)], [('share',), ('conv', 384, 3, 1)],
       [('conv', 448, 1, 1), ('conv', 384, 3, 3), ('conv', 384, 1, 3)], [('share',), ('share',), ('conv', 384, 3, 1)],
       [pool, ('conv', 192, 1, 1)]]
  for channels, k in ((32, 3), (32, 3), (64, 3), (80, 1), (192, 3)):
    conv(channels, k, k)
  for m in (a(32), a(64), a(64), b, c(128), c(160), c(160), c(192), d, e, e):
    module(m)
  return [8.0] + out + [4.0 * size[0] * 1001, 4.0 * 1001]


INCEPTION3_VARIABLES = tuple(_inception3_variables())


@dataclasses.dataclass(frozen=True)
class Plan:
  """How a table is predicted: the stack, and 'allreduce' or 'ps'; the profile whose estimates bound it; for the
  parameter servers, the model's variables in the order a round-robin placement meets them (empty: split evenly)."""
  stack: stacks.Stack
  kind: str
  note: str
  profile: str = ''
  variables: tuple = ()


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
                'parameter servers over gRPC/TCP on Aries: piz_daint_nccl\'s TCP link, variables on the host, '
                'placed round-robin', variables=INCEPTION3_VARIABLES), ''
  if tid.startswith('ebug_tf11_ps_inception3_p28xl'):
    return Plan(dataclasses.replace(_profile_stack('aws_p2_8xlarge'), host=PS_HOST), 'ps',
                'aws_p2_8xlarge: NCCL over PCIe inside, parameter servers over gRPC/TCP between instances, placed '
                'round-robin', variables=INCEPTION3_VARIABLES), ''
  if tid.startswith('tfbench_p2_8xl_dist'):
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
  return inside + p.stack.ps_exchange(nbytes, nodes, _servers(table, cell), _shard(p, table, cell))


def _shard(p: Plan, table: dict, cell: dict) -> float:
  """The busiest server's bytes where the plan knows the model's variables (0: an even split)."""
  return stacks.busiest_shard(list(p.variables), _servers(table, cell)) if p.variables else 0.0


def _pulls_under_forward(table: dict, cell: dict) -> bool:
  """variable_update=parameter_server (the cell's, else the table's stack): the variables are read every step."""
  mode = cell.get('variable_update') or (
      'distributed_replicated' if 'distributed_replicated' in (table['setting'].get('stack') or '') else
      'parameter_server')
  return mode == 'parameter_server'


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
  step does not accumulate; the parameter servers' exchange runs under the compute as `step.ps_exposed` says)."""
  gpus, nodes = int(cell['gpus']), int(cell['nodes'])
  compute = accum * step_lib.slowest(micro, gpus, terms.cv)
  if p.kind == 'allreduce':
    backward = terms.backward_share * micro if accum == 1 else 0.0
    return compute + step_lib.exposed(p.stack, nbytes, gpus, backward)
  # Parameter servers: NCCL inside the node and the host staging after the compute, the exchange's two phases
  # under it as far as `step.ps_exposed` hides them.
  servers, shard = _servers(table, cell), _shard(p, table, cell)
  staged = p.stack.ps_exchange(nbytes, nodes, servers, shard)
  inside = comm(p, table, cell, nbytes) - staged
  link = dataclasses.replace(p.stack, host=None).ps_exchange(nbytes, nodes, servers, shard)
  staging = staged - link
  exposed = step_lib.ps_exposed(link, step_lib.slowest(micro, gpus, terms.cv), terms.backward_share,
                                _pulls_under_forward(table, cell))
  return compute + inside + staging + exposed


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
  accum: int = 1
  micro_per_gpu: float = 0.0  # samples (or tokens) of one GPU's micro-batch
  base_point: Optional[tuple[int, int, float]] = None  # the base cell: GPUs, accumulation, s per micro-batch

  @property
  def extra_s(self) -> Optional[float]:
    """Seconds per step the published cell takes beyond the prediction (negative: less)."""
    if self.predicted is None:
      return None
    per_step = self.gpus * self.accum * self.micro_per_gpu
    return per_step / self.published - per_step / self.predicted

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
      row.accum, row.micro_per_gpu = accum or 1, batch
      row.base_point = (int(base['gpus']), accum0, step0 / accum0)
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


# ---- what a table says of itself: whether any cost paid once per step could explain it ----
#
# Every term of the model is paid once per step (the all-reduce, its staging, the coordinator, the parameter
# servers' exchange) and grows, or stays, with P; the compute is paid per micro-batch and grows with P only through
# the slowest of P. So a cell's time per micro-batch on one GPU, m = b gpus / throughput, is
#   m(P) = t f(P) + C(P) / a(P)      f(P) = slowest(1, P, cv), C >= 0 nondecreasing in P, t the same for every cell
# whatever C is and wherever it comes from. `least_error` finds the smallest e for which some t >= 0, some cv in
# STEP_CV's range and some such C predict every cell within e (its rate: m' in [m / (1 + e), m / (1 - e)]); the
# conditions are linear in t and the m' (C_j >= C_i for P_i < P_j: a_i (m'_i - t f_i) <= a_j (m'_j - t f_j);
# C_i >= 0: t f_i <= m'_i), so each e is a linear feasibility problem, and e is found by bisection. Where e exceeds
# the target, no per-step term, however it is sourced, brings the table within the target: its cells grow per
# micro-batch (or shrink with P), an effect of a shape the model does not have. The check reads the table only to
# say this; it sets nothing (and leaves t free, where the validation sets it from the base cell).

def _feasible(points: list[tuple[int, int, float]], error: float, cv: float) -> bool:
  n = len(points)
  f = [step_lib.slowest(1.0, gpus, cv) for gpus, _, _ in points]
  rows, rhs = [], []
  for i in range(n):  # C_i >= 0: t f_i - m'_i <= 0
    row = [0.0] * (n + 1)
    row[0], row[1 + i] = f[i], -1.0
    rows.append(row)
    rhs.append(0.0)
    for j in range(n):  # C_i <= C_j where P_i < P_j
      if points[j][0] > points[i][0]:
        a_i, a_j = points[i][1], points[j][1]
        row = [0.0] * (n + 1)
        row[0], row[1 + i], row[1 + j] = a_j * f[j] - a_i * f[i], a_i, -a_j
        rows.append(row)
        rhs.append(0.0)
  bounds = [(0.0, None)] + [(m / (1 + error), m / (1 - error) if error < 1 else None) for _, _, m in points]
  result = scipy.optimize.linprog(np.zeros(n + 1), A_ub=np.array(rows), b_ub=np.array(rhs), bounds=bounds,
                                  method='highs')
  return result.status == 0


def least_error(points: list[tuple[int, int, float]], cvs: Optional[list[float]] = None) -> float:
  """The smallest error within which some compute, variation and per-step cost nondecreasing in P predict every
  point (gpus, accumulation steps, seconds per micro-batch on one GPU); see above. 0 where they reproduce it."""
  if cvs is None:
    cvs = list(np.linspace(step_lib.STEP_CV.low, step_lib.STEP_CV.high, 6))
  if any(_feasible(points, 0.0, cv) for cv in cvs):
    return 0.0
  lo, hi = 0.0, 0.999
  for _ in range(30):
    mid = 0.5 * (lo + hi)
    if any(_feasible(points, mid, cv) for cv in cvs):
      hi = mid
    else:
      lo = mid
  return hi


def self_consistency(rows: list[Row]) -> dict[str, float]:
  """Per table: `least_error` of its base cell (which sets the compute) and its predicted cells."""
  by_table: dict = {}
  for r in rows:
    if r.predicted is not None:
      by_table.setdefault(r.table, [r.base_point]).append((r.gpus, r.accum, r.micro_per_gpu * r.gpus / r.published))
  return {t: least_error(pts) for t, pts in by_table.items()}


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
  print_misses(rows)
  print('\nNot predicted (cells besides the base cell):')
  for tid, why, n in skipped:
    print(f'- {tid} ({n} cells): {why}')



def print_misses(rows: list[Row]) -> None:
  """The cells beyond the target: the seconds per step and per micro-batch the published cell takes beyond the
  prediction, and the least error any per-step cost could reach on its table (`least_error`)."""
  least = self_consistency(rows)
  print('\nThe cells beyond the target: the seconds the published step takes beyond the predicted one (per step; '
        'per micro-batch where the step accumulates; that as a share of the base cell\'s micro-batch), and the least '
        'error within which any cost paid once per step, nondecreasing in P, with the same compute per micro-batch at '
        'every P but for the slowest of P (cv in STEP_CV\'s range), could predict every cell of the table, its base '
        'cell included (`least_error`; above the target: no per-step term, however sourced, closes the table):\n')
  print('| table | nodes | GPUs | accumulation | error | published - predicted, s per step | per micro-batch '
        '| share of the base\'s micro-batch | least error of any per-step cost |')
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |')
  for r in rows:
    if r.error is None or abs(r.error) <= TARGET_CELL:
      continue
    e = least.get(r.table)
    bound = f'{100 * e:.1f}%' + (' **beyond the target**' if e > TARGET_CELL else '')
    per_micro = r.extra_s / r.accum
    print(f'| {r.table} | {r.nodes} | {r.gpus} | {r.accum} | {100 * r.error:+.1f}% | {r.extra_s:+.3f} '
          f'| {per_micro:+.4f} | {100 * per_micro / r.base_point[2]:+.0f}% | {bound} |')
  beyond = sorted(t for t, e in least.items() if e > TARGET_CELL)
  print(f'\n{len(beyond)} of {len(least)} tables cannot be brought within '
        f'{100 * TARGET_CELL:.0f}% by any per-step cost: {", ".join(beyond) if beyond else "none"}')
