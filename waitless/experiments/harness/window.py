"""The metrics window: what a run measured since its last metrics row, reduced into the next row."""

from __future__ import annotations

import numpy as np


class Window:
  """Per-iteration measurements since the last metrics row, each reduced as declared.

  The step's per-iteration measurements, idle fraction and staleness are means over the window's iterations,
  bytes a sum; `l2_params`, measured once per block, is the value after the window's last block ('last'); the
  time rule's own measurements are reduced as its `reports` declare ('mean', 'sum' or 'max').
  """

  def __init__(self, reports: dict[str, str], saved: dict[str, float] | None = None):
    self.reductions = {'train_loss': 'mean', 'l2_grads': 'mean', 'l2_params': 'last', 'idle_fraction': 'mean',
                       'staleness': 'mean', 'bytes_communicated': 'sum', **reports}
    self.sums = dict(saved or {})

  def add(self, block, **measured: np.ndarray) -> None:
    """Adds one block: the step's `measured` values ((n,), or a scalar for 'last') plus what the clock's
    `block` reports."""
    self.add_reduced(self.reduce_block(block), **measured)

  def reduce_block(self, block) -> dict[str, float]:
    """What the clock's `block` reports, each value reduced over the block's iterations (its 'iterations' too):
    the same for every replica that shares the block (`loop.share_clocks`), so the loop computes it once."""
    values = dict(idle_fraction=block.idle_fraction, staleness=block.mean_staleness,
                  bytes_communicated=block.bytes_communicated, **block.measurements)
    reduced = {key: self._reduce(key, v) for key, v in values.items()}
    reduced['iterations'] = float(len(block.duration))
    return reduced

  def add_reduced(self, reduced: dict[str, float], **measured: np.ndarray) -> None:
    """Adds one block from its `reduce_block` and the step's `measured` values."""
    values = {**{key: self._reduce(key, v) for key, v in measured.items()}, **reduced}
    for key, v in values.items():
      reduction = self.reductions.get(key, 'sum')  # 'iterations': a count
      if reduction == 'last':
        self.sums[key] = v
      elif reduction == 'max':
        self.sums[key] = max(self.sums.get(key, -np.inf), v)
      else:
        self.sums[key] = self.sums.get(key, 0.0) + v

  def _reduce(self, key: str, v) -> float:
    reduction = self.reductions[key]
    if reduction == 'last':
      return float(v)
    return float(np.max(v)) if reduction == 'max' else float(np.sum(v))

  def row(self) -> dict[str, float]:
    n = max(self.sums.pop('iterations', 0.0), 1.0)
    out = {k: v / n if self.reductions[k] == 'mean' else v for k, v in self.sums.items()}
    self.sums = {}
    return out
