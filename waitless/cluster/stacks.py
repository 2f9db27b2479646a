"""Collective costs with the structure of the libraries that carry them: NCCL's or MPICH's choice of algorithm,
the hierarchy of GPUs in nodes, host staging and host reduction, a framework's cycles, congestion.

`Stack` is a `network.Network` (the time rules call `allreduce(nbytes, n)`, `p2p(nbytes)`, `latency()`); a
profile of version 2 (`cluster/profiles.py`) builds one. Notation: M bytes among n workers, G GPUs per node,
N = ceil(n / G) nodes, n' = min(n, G) GPUs in a node, alpha / beta a link's latency and bandwidth (bytes/s).

NCCL (`library = "nccl"`) mirrors NCCL's own cost model, `src/graph/tuning.cc` (NVIDIA/nccl, commit 01afd20,
NCCL 2.7-2.8): for each algorithm a in {ring, tree} and protocol p in {LL, LL128, Simple}
  latency(a, p)  = base[a][p] + ring: (2(n-1) - 2(N-1)) hw[intra][a][p] + 2(N-1) hw[net][a][p]
                                tree: 2 ((n/N - 1) hw[intra][a][p] + floor(log2 N) hw[net][a][p])
                   (LL's intra-node latency x 1.8 across nodes; the ring's Simple latency x 1.9 across nodes when
                   M >= n/16 x 64 KiB: NCCL's "plateau effect of ring")
  bus(a, p)      = B: the bus bandwidth of the GPUs' links (NVLink / PCIe inside one node; across nodes the
                   rings' bus bandwidth over the network, at most the intra-node one); ring LL B/4, ring LL128
                   0.92 B (0.7 B with one GPU per node); tree min(0.9 B, 80 GB/s beyond 2 nodes, else 110 GB/s),
                   LL / 3.8, LL128 x 0.915 (7/9 in one node)
  time(a, p)     = latency + M / algbw,  algbw = bus x n / (2(n-1)) for the ring, bus / 2 for the tree, the tree's
                   bandwidth x NCCL's correction factor for medium sizes (64 B .. 128 MB)
and NCCL runs the fastest enabled pair (LL128 only where the profile enables it: NVLink on Volta / Ampere).

MPICH (`library = "mpich"`) mirrors `MPIR_Allreduce_intra` (pmodels/mpich src/mpi/coll/allreduce.c, 3.x):
  M <= short_msg_bytes (MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE, 2048 B)    recursive doubling
      ceil(log2 n) (alpha + M / beta + M gamma)
  larger                                                               Rabenseifner (reduce-scatter by recursive
      halving, all-gather by recursive doubling), on the largest power of two p' <= n, the n - p' others folded in
      2 log2 p' alpha + 2 (p'-1)/p' M / beta + (p'-1)/p' M gamma  [+ 2 (alpha + M / beta) + M gamma if n > p']
gamma: seconds per byte of the reduction (the host's, where the stack reduces on the host). With G > 1 GPUs per
node, MPICH's SMP-aware all-reduce reduces inside the node first (a reduce and a broadcast over the intra link,
2 (alpha_i + M / beta_i) + M gamma) and runs the above among the N nodes.

gloo (`library = "gloo"`) runs its ring (gloo/allreduce_ring_chunked.h, the all-reduce Horovod's and
PyTorch's gloo back ends call) over all n workers, on the host:
  2(n-1) alpha + 2 (n-1)/n M / beta + (n-1)/n M gamma      (inside one node the intra link, else the network)
which is version 1's ring when gamma = 0.

Host staging (`host`, a stack that reduces on the host: MPI without CUDA awareness, a custom CPU op):
  + 2 M / pcie + passes M gamma  (device to host before, host to device after; `passes` further passes of the
  host over the vector, such as a custom op's copies into and out of its buffers), per collective.

Framework (`framework`, Horovod's cycles; or a custom op's one message per tensor):
  fusion_bytes F > 0: the M bytes go in ceil(M / F) fused buffers (HOROVOD_FUSION_THRESHOLD), each an
  all-reduce of M / ceil(M / F) bytes; F = 0: one all-reduce per tensor, `tensors` of them, M / tensors each.
  Per call, where the framework has cycles (cycle_s > 0): cycle_s / 2 (the mean wait for the next cycle,
  HOROVOD_CYCLE_TIME) + a negotiation of 2 ceil(log2 n) alpha (the coordinator's gather and broadcast).
  Per all-reduce, where the framework's coordinator handles every rank's request for every tensor (request_s > 0:
  Horovod before its response cache, horovod/horovod PR #902; `tensors` then counts the model's gradient tensors):
  + n x tensors x request_s, serial on the coordinator (rank 0's background thread).

Congestion (`congestion`): beyond `free_nodes` nodes the job's traffic crosses links it shares (a dragonfly's
rank-2 / global links, an oversubscribed Ethernet's uplinks): the inter-node bandwidth x `shared_fraction`.

Point-to-point (D-PSGD's and MATCHA's neighbours, the parameter server's pushes): alpha_p2p + M / beta_p2p, plus
the host staging of M in both directions where the stack stages through the host.

A synchronous step of TensorFlow's parameter servers (`ps_exchange`: k servers sharded over the model and
co-located on k of the N worker nodes, variables on the host, gRPC over the p2p link): every worker pushes its
M bytes to the shards and pulls M back; a node holding a shard receives the other N-1 workers' pushes of its M/k
and its own worker's pulls of the other shards, so the busiest node moves
  B = max(M (N-1)/k + M (k-1)/k,  M if k < N)   bytes each way, and
  t = 2 alpha_p2p + B / beta_p2p + 2 M / pcie   (the gradients leave the GPU and the variables return).
The shards are whole variables: the busiest server holds S >= M/k bytes (`busiest_shard`: TensorFlow's
`tf.train.replica_device_setter` without a `ps_strategy` places the variables round-robin over the k servers in
the order the model creates them, tensorflow/python/training/device_setter.py `_RoundRobinStrategy`), and then
  B = max((N-1) S + (M - S),  M if k < N)        (S = M/k gives the line above).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from waitless.cluster import network as network_lib

LIBRARIES = ('nccl', 'mpich', 'gloo')
INTRA_KINDS = ('nvlink', 'pci')

# NVIDIA/nccl src/graph/tuning.cc (commit 01afd20): latencies in microseconds, [algorithm][protocol],
# protocols (LL, LL128, Simple).
_NCCL_PROTOCOLS = ('LL', 'LL128', 'Simple')
_NCCL_BASE_US = {'tree': (4.4, 4.4, 0.0), 'ring': (3.6, 10.0, 8.4)}
_NCCL_HW_US = {
    'nvlink': {'tree': (0.52, 1.2, 28.0), 'ring': (0.47, 1.9, 3.4)},
    'pci': {'tree': (1.0, 1.9, 28.0), 'ring': (1.0, 2.5, 5.7)},
    'net': {'tree': (5.0, 8.5, 50.0), 'ring': (2.7, 4.0, 9.6)},
}
# The tree's bandwidth correction for medium sizes, powers of two from 64 B (index log2(M / 64)) to 128 MB.
_NCCL_TREE_CORRECTION = {
    'LL': (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0),
    'LL128': (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, 1.0),
    'Simple': (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9),
}
_NCCL_MAX_TREE_GBS = (110.0, 80.0)  # GB/s: up to 2 nodes, beyond


def _log2_floor(x: int) -> int:
  return max(int(x).bit_length() - 1, 0)


def _bytes_per_s(gbps: float) -> float:
  return gbps * 1e9 / 8.0


@dataclasses.dataclass(frozen=True)
class Host:
  """Staging through the host: the device-host copy bandwidth (PCIe), both ways, per collective; `passes` more
  passes of the host over the vector at the reduction's rate."""
  pcie_gbps: float
  passes: float = 0.0


@dataclasses.dataclass(frozen=True)
class Framework:
  """A framework's cycles: fused buffers of `fusion_bytes` (0: one message per tensor, `tensors` of them), a
  cycle of `cycle_s` between batches of collectives, a negotiation per call; `request_s` seconds of the
  coordinator's work per request (one per rank and gradient tensor, `tensors` of them; 0: not charged);
  `backward_share` the backward pass's share of a micro-batch's compute, under which the framework all-reduces the
  gradients as they become ready (`cluster/step.py`; 0: no overlap, the all-reduce follows the compute)."""
  fusion_bytes: float
  cycle_s: float
  tensors: int = 1
  request_s: float = 0.0
  backward_share: float = 0.0


@dataclasses.dataclass(frozen=True)
class Congestion:
  """Beyond `free_nodes` nodes the inter-node bandwidth is x `shared_fraction`."""
  free_nodes: int
  shared_fraction: float


@dataclasses.dataclass(frozen=True)
class Stack:
  """A software stack on a cluster: library, hierarchy, staging, framework, congestion (module docstring).

  Attributes:
    library: 'nccl', 'mpich' or 'gloo'.
    gpus_per_node: G.
    intra: the link between GPUs of one node (bus bandwidth for NCCL; unused when G = 1).
    intra_kind: 'nvlink' or 'pci' (NCCL's hardware latencies inside a node).
    inter: the network. NCCL: the bus bandwidth its rings reach across nodes (channels x the network speed of
      a channel: a node's injection bandwidth where every channel has its own NIC); MPICH: the point-to-point
      bandwidth between two nodes. The latency: one step of a collective across nodes.
    p2p_link: point-to-point messages and single latencies.
    reduce_gbps: the rate of the reduction in gigabits of the reduced vector per second (gamma = 8 / (rate
      1e9)); 0 for free (a GPU reduction hidden behind the transfer).
    short_msg_bytes: MPICH's switch from recursive doubling to Rabenseifner.
    ll128: NCCL's LL128 protocol enabled.
    host, framework, congestion: optional terms (None: not charged).
  """
  library: str
  gpus_per_node: int
  inter: network_lib.AlphaBeta
  p2p_link: network_lib.AlphaBeta
  intra: Optional[network_lib.AlphaBeta] = None
  intra_kind: str = 'pci'
  reduce_gbps: float = 0.0
  short_msg_bytes: float = 2048.0
  ll128: bool = False
  host: Optional[Host] = None
  framework: Optional[Framework] = None
  congestion: Optional[Congestion] = None

  # ---- the interface the time rules call ----

  def allreduce(self, nbytes: float, n: int) -> float:
    """Seconds for an all-reduce (or a group all-reduce) of `nbytes` among `n` workers, as the stack runs it."""
    if n <= 1 or nbytes <= 0:
      return 0.0
    if self.framework is None:
      return self.collective(nbytes, n)
    f = self.framework
    calls = math.ceil(nbytes / f.fusion_bytes) if f.fusion_bytes > 0 else max(int(f.tensors), 1)
    per_call = self.collective(nbytes / calls, n) + self.negotiation(n)
    if f.cycle_s > 0:  # the mean wait for the next cycle
      per_call += f.cycle_s / 2
    return calls * per_call + self.coordination(n)

  def negotiation(self, n: int) -> float:
    """Seconds of a framework with cycles negotiating one call (a custom op posting its own does not)."""
    if self.framework is None or self.framework.cycle_s <= 0 or n <= 1:
      return 0.0
    return 2 * math.ceil(math.log2(n)) * self.inter.latency_s

  def coordination(self, n: int) -> float:
    """Seconds of the coordinator's work on every rank's request for every tensor, per all-reduce (0 unless the
    framework charges it)."""
    f = self.framework
    if f is None or f.request_s <= 0 or n <= 1:
      return 0.0
    return n * max(int(f.tensors), 1) * f.request_s

  def p2p(self, nbytes: float) -> float:
    """Seconds for one point-to-point message of `nbytes` (staged through the host where the stack stages)."""
    return self.p2p_link.p2p(nbytes) + self._staging(nbytes)

  def latency(self) -> float:
    return self.p2p_link.latency_s

  def ps_exchange(self, nbytes: float, nodes: int, servers: int, shard_bytes: float = 0.0) -> float:
    """Seconds of a synchronous parameter-server step's pushes and pulls (module docstring) among `nodes` worker
    nodes with `servers` co-located shards, the busiest holding `shard_bytes` (at least nbytes / servers; 0: the
    model split evenly); 0 on one node (its servers are local)."""
    if nodes <= 1 or nbytes <= 0:
      return 0.0
    k = max(1, min(int(servers), nodes))
    shard = min(max(nbytes / k, shard_bytes), nbytes)
    busiest = (nodes - 1) * shard + (nbytes - shard)
    if k < nodes:
      busiest = max(busiest, nbytes)
    return 2 * self.p2p_link.latency_s + busiest * self.p2p_link.seconds_per_byte + self._staging(nbytes)

  # ---- the parts ----

  def collective(self, nbytes: float, n: int) -> float:
    """One all-reduce call of `nbytes` among `n` (no framework): the library's choice, plus host staging."""
    if n <= 1:
      return 0.0
    host = 0.0 if self.host is None else self.host.passes * nbytes * self._gamma()
    return self.choose(nbytes, n)[1] + self._staging(nbytes) + host

  def choose(self, nbytes: float, n: int) -> tuple[str, float]:
    """(algorithm, seconds) the library runs for `nbytes` among `n` (without staging and framework)."""
    if self.library == 'nccl':
      return self._nccl(nbytes, n)
    if self.library == 'gloo':
      return self._gloo(nbytes, n)
    return self._mpich(nbytes, n)

  def nodes(self, n: int) -> int:
    return -(-n // self.gpus_per_node)

  def inter_bytes_per_s(self, nodes: int) -> float:
    rate = _bytes_per_s(self.inter.bandwidth_gbps)
    if self.congestion is not None and nodes > self.congestion.free_nodes:
      rate *= self.congestion.shared_fraction
    return rate

  def _staging(self, nbytes: float) -> float:
    return 0.0 if self.host is None else 2.0 * nbytes / _bytes_per_s(self.host.pcie_gbps)

  def _gamma(self) -> float:
    return 0.0 if self.reduce_gbps <= 0 else 1.0 / _bytes_per_s(self.reduce_gbps)

  def _nccl(self, nbytes: float, n: int) -> tuple[str, float]:
    nodes = self.nodes(n)
    # One node: the GPUs' own links; across nodes: each GPU's share of the network (NCCL takes its intra-node
    # speed up to 2 nodes, whose ring still crosses the network once per direction: the slower of the two here).
    if nodes == 1:
      bus = _bytes_per_s(self.intra.bandwidth_gbps) if self.intra is not None else self.inter_bytes_per_s(1)
    else:
      bus = self.inter_bytes_per_s(nodes)
      if self.intra is not None and self.gpus_per_node > 1:
        bus = min(bus, _bytes_per_s(self.intra.bandwidth_gbps))
    bus_gbs = bus / 1e9
    intra_hw = _NCCL_HW_US[self.intra_kind]
    net_hw = _NCCL_HW_US['net']
    per_node = n // nodes
    best = ('', math.inf)
    for a in ('ring', 'tree'):
      for i, proto in enumerate(_NCCL_PROTOCOLS):
        if proto == 'LL128' and not self.ll128:
          continue
        bw = bus_gbs
        if a == 'ring' and proto == 'LL':
          bw /= 4.0
        if a == 'ring' and proto == 'LL128':
          bw *= 0.7 if self.gpus_per_node < 2 else 0.92
        if a == 'tree':
          bw = min(bw * 0.9, _NCCL_MAX_TREE_GBS[1] if nodes > 2 else _NCCL_MAX_TREE_GBS[0])
          if proto == 'LL':
            bw /= 3.8
          if proto == 'LL128':
            bw *= 0.915 if nodes > 1 else 7.0 / 9.0
        algbw = bw * n / (2.0 * (n - 1)) if a == 'ring' else bw * 0.5
        intra_lat = intra_hw[a][i] * (1.8 if nodes > 1 and proto == 'LL' else 1.0)
        inter_lat = net_hw[a][i]
        lat = _NCCL_BASE_US[a][i]
        if a == 'ring':
          steps, inter_steps = 2 * (n - 1), 2 * (nodes - 1)
          lat += (steps - inter_steps) * intra_lat + inter_steps * inter_lat
          if proto == 'Simple' and nodes > 1 and nbytes >= n / 16.0 * 65536:
            lat *= 1.9
        else:
          lat += 2 * ((per_node - 1) * intra_lat + _log2_floor(nodes) * inter_lat)
          log_size = _log2_floor(int(nbytes) >> 6)
          if log_size < 22:
            algbw *= _NCCL_TREE_CORRECTION[proto][log_size]
        seconds = lat * 1e-6 + nbytes / (algbw * 1e9)
        if seconds < best[1]:
          best = (f'{a}/{proto}', seconds)
    return best

  def _gloo(self, nbytes: float, n: int) -> tuple[str, float]:
    nodes = self.nodes(n)
    link = self.intra if nodes == 1 and self.intra is not None else self.inter
    per_byte = link.seconds_per_byte if nodes == 1 else 1.0 / self.inter_bytes_per_s(nodes)
    share = (n - 1) / n
    return 'ring', 2 * (n - 1) * link.latency_s + 2 * share * nbytes * per_byte + share * nbytes * self._gamma()

  def _mpich(self, nbytes: float, n: int) -> tuple[str, float]:
    nodes = self.nodes(n)
    gamma = self._gamma()
    seconds = 0.0
    if nodes < n:  # SMP-aware: reduce inside the node, all-reduce among nodes, broadcast inside the node
      intra = self.intra if self.intra is not None else self.inter
      seconds += 2 * (intra.latency_s + nbytes * intra.seconds_per_byte) + nbytes * gamma
    if nodes <= 1:
      return 'smp', seconds
    alpha, per_byte = self.inter.latency_s, 1.0 / self.inter_bytes_per_s(nodes)
    if nbytes <= self.short_msg_bytes:
      return 'recursive_doubling', seconds + math.ceil(math.log2(nodes)) * (alpha + nbytes * (per_byte + gamma))
    pof2 = 1 << _log2_floor(nodes)
    share = (pof2 - 1) / pof2
    seconds += 2 * math.log2(pof2) * alpha + 2 * share * nbytes * per_byte + share * nbytes * gamma
    if nodes > pof2:
      seconds += 2 * (alpha + nbytes * per_byte) + nbytes * gamma
    return 'rabenseifner', seconds


def busiest_shard(variable_bytes: list[float], servers: int) -> float:
  """Bytes on the busiest of `servers` parameter servers when the variables (bytes each, in the order the model
  creates them) go round-robin (TensorFlow's default placement, module docstring; which server takes the first
  only renames the servers)."""
  if servers <= 0:
    raise ValueError(f'servers must be positive, got {servers}')
  load = [0.0] * servers
  for i, nbytes in enumerate(variable_bytes):
    load[i % servers] += nbytes
  return max(load)
