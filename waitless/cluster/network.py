"""Network models: seconds one collective takes.

`ideal` is free. `alpha_beta` charges latency alpha per message and 1/beta per byte:
  ring all-reduce of M bytes over n workers   2(n-1) alpha + 2 (n-1)/n M / beta
  group all-reduce over a group of S          the same with n = S
  point-to-point message of M bytes           alpha + M / beta
  one latency (an activation message)         alpha
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class Network(Protocol):

  def allreduce(self, nbytes: float, n: int) -> float:
    """Seconds for a ring all-reduce of `nbytes` among `n` workers (also used for group all-reduce)."""

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
