"""Network models: seconds one collective takes.

`ideal` is free. `alpha_beta` charges latency alpha per message and 1/beta per byte:
  ring all-reduce of M bytes over n workers   2(n-1) alpha + 2 (n-1)/n M / beta
  group all-reduce over a group of S          the same with n = S
  point-to-point message of M bytes           alpha + M / beta
  one latency (an activation message)         alpha
`Collectives` (a cluster profile's network, `cluster/profiles.py`) has its own alpha and beta per collective kind:
  all-reduce among n (a group all-reduce: n = S), ring   2(n-1) alpha_ar + 2 (n-1)/n M / beta_ar
                                                  tree   2 ceil(log2 n) alpha_ar + 2 (n-1)/n M / beta_ar
  point-to-point message of M bytes                       alpha_p2p + M / beta_p2p
  one latency                                             alpha_p2p
beta_ar is the bus bandwidth of NCCL's nccl-tests (busbw = algbw x 2(n-1)/n), so the ring figure is the
measured time: t = 2(n-1)/n M / busbw + latency terms. The tree form keeps the bandwidth term (NCCL's double
binary tree reaches about the ring's bus bandwidth on large messages) and pays log2 n latencies per direction.
`Collectives` is a version 1 profile's network (what `experiments.calibrate` writes); a version 2 profile's is a
`stacks.Stack`, the collectives as NCCL, MPICH or gloo run them (algorithm by size and P, hierarchy, host staging,
framework cycles, congestion). Both are `Network`s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol


class Network(Protocol):

  def allreduce(self, nbytes: float, n: int) -> float:
    """Seconds for an all-reduce of `nbytes` among `n` workers (also used for group all-reduce)."""

  def p2p(self, nbytes: float) -> float:
    """Seconds for one point-to-point message of `nbytes`."""

  def latency(self) -> float:
    """Seconds for one empty message (alpha)."""


def ring_bytes(nbytes: float, n: int) -> float:
  """Bytes all n workers put on the network together in a ring all-reduce of `nbytes` each."""
  return 2.0 * (n - 1) * nbytes if n > 1 else 0.0


@dataclasses.dataclass(frozen=True)
class Ideal:
  """Communication is free."""

  def allreduce(self, nbytes, n):
    return 0.0

  def p2p(self, nbytes):
    return 0.0

  def latency(self):
    return 0.0


@dataclasses.dataclass(frozen=True)
class AlphaBeta:
  """Latency `latency_s` per message, bandwidth `bandwidth_gbps` gigabits per second."""
  latency_s: float
  bandwidth_gbps: float

  @property
  def seconds_per_byte(self) -> float:
    return 8.0 / (self.bandwidth_gbps * 1e9)

  def allreduce(self, nbytes, n):
    if n <= 1:
      return 0.0
    return 2 * (n - 1) * self.latency_s + 2 * (n - 1) / n * nbytes * self.seconds_per_byte

  def p2p(self, nbytes):
    return self.latency_s + nbytes * self.seconds_per_byte

  def latency(self):
    return self.latency_s


ALLREDUCE_FORMS = ('ring', 'tree')


@dataclasses.dataclass(frozen=True)
class Collectives:
  """Latency and bandwidth per collective kind: `allreduce_link` for all-reduces (ring or tree form),
  `p2p_link` for point-to-point messages and single latencies (see the module docstring)."""
  allreduce_link: AlphaBeta
  p2p_link: AlphaBeta
  form: str = 'ring'

  def allreduce(self, nbytes, n):
    if n <= 1:
      return 0.0
    link = self.allreduce_link
    hops = 2 * (n - 1) if self.form == 'ring' else 2 * math.ceil(math.log2(n))
    return hops * link.latency_s + 2 * (n - 1) / n * nbytes * link.seconds_per_byte

  def p2p(self, nbytes):
    return self.p2p_link.p2p(nbytes)

  def latency(self):
    return self.p2p_link.latency_s
