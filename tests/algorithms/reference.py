"""Plain sequential float64 references: one Python loop, numpy only, no collectives.

The model is the linear least-squares model of `experiments/configs/synthetic.py` (MLP without hidden layers:
params {'Dense_0': {'kernel': (d, 1), 'bias': (1,)}}), loss 0.5 * mean((x W + b - y)^2).
"""

from __future__ import annotations

import numpy as np


def unpack(params, worker: int = 0):
  """(W (d,), b scalar) of one worker from the harness's stacked params."""
  dense = params['Dense_0']
  return (np.asarray(dense['kernel'][worker], np.float64)[:, 0], float(np.asarray(dense['bias'][worker])[0]))


def assert_workers_match(params, models, label: str = '') -> None:
  """Every worker's (W, b) in the harness's stacked `params` equals `models[i]` to 1e-10 relative."""
  for i, (want_w, want_b) in enumerate(models):
    got_w, got_b = unpack(params, i)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-10, atol=1e-12, err_msg=f'{label} worker {i}')
    np.testing.assert_allclose(got_b, want_b, rtol=1e-10, atol=1e-12, err_msg=f'{label} worker {i}')


def gradient(w: np.ndarray, b: float, x: np.ndarray, y: np.ndarray):
  """Gradient of 0.5 * mean((x w + b - y)^2) with respect to (w, b)."""
  r = x.astype(np.float64) @ w + b - y.astype(np.float64)
  return x.T.astype(np.float64) @ r / len(y), float(np.mean(r))


class MomentumSGD:
  """optax.sgd(lr, momentum): trace <- g + mu * trace; param <- param - lr * trace."""

  def __init__(self, lr: float, momentum: float):
    self.lr, self.momentum = lr, momentum
    self.trace = None

  def step(self, params: list[np.ndarray], grads: list[np.ndarray]) -> list[np.ndarray]:
    if self.trace is None:
      self.trace = [np.zeros_like(g) for g in grads]
    if self.momentum:
      self.trace = [g + self.momentum * t for g, t in zip(grads, self.trace)]
    else:
      self.trace = list(grads)
    return [p - self.lr * t for p, t in zip(params, self.trace)]
