"""The ring of P workers (worker i next to i - 1 and i + 1 mod P): D-PSGD's `RingGossip` (cluster/rules/dpsgd.py)
and non-blocking SGD's ring topology (cluster/rules/nonblocking.py)."""

from __future__ import annotations

import numpy as np


def ring_neighbours(p: int) -> int:
  """Distinct ring neighbours of a worker: 2, or fewer on a ring of 1 or 2 workers."""
  return min(p - 1, 2)


def neighbourhood_max(values: np.ndarray) -> np.ndarray:
  """max(values[i-1], values[i], values[i+1]) on a ring (works for P = 1 and 2)."""
  ring = np.concatenate((values[-1:], values, values[:1]))
  return np.maximum(np.maximum(ring[:-2], ring[1:-1]), ring[2:])
