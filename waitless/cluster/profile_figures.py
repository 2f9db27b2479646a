"""The figures `python -m waitless.experiments.calibrate` writes into a cluster profile, robust to a shared machine:
the median of several rounds after dropping the rounds another user's job landed on (numpy only, no JAX)."""

from __future__ import annotations

import numpy as np


MAD_SCALE = 1.4826  # a normal sample's standard deviation / its median absolute deviation
OUTLIER_MADS = 3.0  # a round further than this many scaled MADs from the median is dropped


def robust(values) -> tuple[float, float, list[int]]:
  """(median of the kept rounds, their scaled MAD, the dropped rounds' indices) of a figure's per-round values.

  A shared machine makes some rounds slow (another user's job lands on them): a round further than
  OUTLIER_MADS scaled median absolute deviations from the median of all rounds is dropped, and the spread is
  the kept rounds' scaled MAD (their standard deviation if they were normal, not inflated by a dropped round).
  Two rounds can drop nothing (both lie one MAD from their median); a MAD of 0 drops nothing either."""
  values = np.asarray(values, np.float64)
  median = np.median(values)
  mad = MAD_SCALE * np.median(np.abs(values - median))
  dropped = [i for i, v in enumerate(values) if mad > 0 and abs(v - median) > OUTLIER_MADS * mad]
  kept = np.delete(values, dropped)
  median = float(np.median(kept))
  return median, float(MAD_SCALE * np.median(np.abs(kept - median))), dropped


def figure(values, source: str, loads=None, **extra) -> dict:
  """A profile figure: the median of the rounds' values after `robust` dropped the outliers, the kept rounds'
  scaled MAD as `spread`, every round's value (`rounds`), the dropped ones (`dropped`, indices) and, where
  given, the load average when each round started (`load`: what the machine's other users were doing)."""
  value, spread, dropped = robust(values)
  out = {'value': value, 'spread': spread, 'rounds': np.asarray(values, np.float64).tolist(), 'dropped': dropped,
         'source': source, **extra}
  if loads is not None:
    out['load'] = [round(float(x), 2) for x in loads]
  return out
