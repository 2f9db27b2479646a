"""Network models: seconds one collective takes.

`ideal` is free. `alpha_beta` charges latency alpha per message and 1/beta per byte: a ring all-reduce of M
bytes over n workers costs 2(n-1) alpha + 2 (n-1)/n M / beta; a point-to-point message alpha + M / beta.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class Network(Protocol):

  def allreduce(self, nbytes: float, n: int) -> float:
    """Seconds for a ring all-reduce of `nbytes` among `n` workers (also used for group all-reduce)."""

  def p2p(self, nbytes: float) -> float:
    """Seconds for one point-to-point message of `nbytes`."""


@dataclasses.dataclass(frozen=True)
class Ideal:
  """Communication is free."""

  def allreduce(self, nbytes, n):
    return 0.0

  def p2p(self, nbytes):
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
