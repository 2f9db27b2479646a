"""The activation broadcast of a wait-avoiding collective (WAGMA's group average, non-blocking SGD's trigger).

The first worker(s) to reach the collective start it and the others learn of it over the hypercube, one
activation latency a per hop (a network latency plus a progress thread noticing the message and forwarding
it): worker i learns of it at
    A_i = min_k (c_k + popcount(k XOR i) a),      c_k: when worker k raised it (+inf: never).
For P not a power of two the same formula holds on workers 0..P-1 (a shortest path from k to i may clear
k's extra bits first, then set i's, through workers numbered at most max(i, k)).
Idealised: a worker forwards to all its hypercube neighbours at once (a binomial-tree broadcast sends one
message per round: worker i would be reached after the rank of the highest differing bit, not popcount).
"""

from __future__ import annotations

import functools

import numpy as np

from waitless import config_errors as errors


def check_latency(value) -> None:
  """Raises ConfigError (a ValueError) unless `value` is a valid activation latency: a finite number >= 0."""
  errors.require_number(value, 'activation_latency_s', 'must be a number >= 0 (seconds)', lambda v: v >= 0)


def activation_times(finished: np.ndarray, latency: float) -> np.ndarray:
  """A_i = min_k (finished_k + popcount(k XOR i) latency) along the last axis (P workers, any P).

  Shortest paths on the hypercube with edge weight `latency` >= 0: relaxing each dimension once, in any
  order, is exact (a shortest path may flip its bits in increasing order). For P not a power of two the
  relaxation runs on the next power of two with the missing workers at +inf (they relay, never start: the
  distances between real workers are popcounts either way). Every step adds `latency` to an arrival and
  takes a minimum, so A_i = min_k f^popcount(k XOR i)(finished_k) exactly with f(x) = x + latency rounded.
  O(P log P).
  """
  out = np.array(finished, np.float64)
  p = out.shape[-1]
  size = 1 << max(p - 1, 0).bit_length()
  if size != p:
    out = np.concatenate([out, np.full(out.shape[:-1] + (size - p,), np.inf)], axis=-1)
  index = np.arange(size)
  bit = 1
  while bit < size:
    out = np.minimum(out, out[..., index ^ bit] + latency)
    bit <<= 1
  return out[..., :p]


def hops_from(sources, workers: int, ignore: int = 0) -> np.ndarray:
  """int16 (..., P): popcount((k XOR i) & ~ignore) for each source k in `sources` (an int or an array of them)
  and every worker i < P: the hypercube distance from k, the bits of `ignore` not counted.

  Only the rows that are needed, O(P) each: a dense (P, P) table would be 8.6 GB at P = 32,768 (issue 59).
  """
  k = np.asarray(sources, np.int64)
  return np.bitwise_count((k[..., None] ^ np.arange(workers, dtype=np.int64)) & ~np.int64(ignore)).astype(np.int16)


@functools.lru_cache(maxsize=8)
def eccentricity(workers: int) -> np.ndarray:
  """int64 (P,): max over k < P of popcount(i XOR k), the hops of the farthest worker from each worker i.

  Max-plus relaxation on the next power of two with the missing workers at -inf, one pass per dimension (as
  `activation_times` with min): E_i = max over the subsets S of the dimensions of f(i XOR S) + |S|, f = 0 on
  workers, -inf elsewhere. O(P log P), no (P, P) table.
  """
  size = 1 << max(workers - 1, 0).bit_length()
  out = np.where(np.arange(size) < workers, 0.0, -np.inf)
  index = np.arange(size)
  bit = 1
  while bit < size:
    out = np.maximum(out, out[index ^ bit] + 1)
    bit <<= 1
  out = out[:workers].astype(np.int64)
  out.flags.writeable = False  # cached: shared by every call
  return out


@functools.lru_cache(maxsize=1024)
def hops_row(source: int, workers: int, ignore: int = 0) -> np.ndarray:
  """`hops_from(source, workers, ignore)` for one source, cached (read-only): a rule asks for the same few
  sources' rows block after block."""
  row = hops_from(source, workers, ignore)
  row.flags.writeable = False
  return row
