"""The simulated wall-clock: per-worker clocks advanced one iteration at a time by an algorithm's time rule.

The clock is the only owner of randomness about time. It is seeded from the config, and its whole state
(per-worker times, per-worker unit counters, the generator, the rule's own state) round-trips through
`state_dict()` / `load_state_dict()` as JSON, so a resumed run sees exactly the schedules an uninterrupted run
would have seen.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from cluster import compute as compute_lib
from cluster import network as network_lib


@dataclasses.dataclass(frozen=True)
class Block:
  """Several iterations' schedules, stacked for one jitted call.

  Attributes:
    schedule: name -> array (n, P, ...): the per-worker schedule of each iteration.
    duration: float64 (n,): simulated seconds each iteration added to the global clock.
    sim_time: float64 (n,): global simulated time at the end of each iteration.
    idle_fraction: float64 (n,): share of worker-seconds spent waiting in each iteration.
    mean_staleness: float64 (n,): mean staleness of the contributions applied in each iteration.
    bytes_communicated: float64 (n,).
  """
  schedule: dict[str, np.ndarray]
  duration: np.ndarray
  sim_time: np.ndarray
  idle_fraction: np.ndarray
  mean_staleness: np.ndarray
  bytes_communicated: np.ndarray


class Clock:
  """Per-worker simulated clocks, advanced by a time rule.

  Attributes (read by rules):
    workers: P.
    times: float64 (P,), each worker's current simulated time; rules update it in place.
    network: the network model.
    model_bytes: bytes of one model copy (the size of every averaging message).
    rule_state: dict of numpy arrays or numbers that a stateful rule keeps between iterations.
  """

  def __init__(self, *, workers: int, rule: Any, compute: compute_lib.ComputeModel,
               network: network_lib.Network, model_bytes: float, seed: int):
    self.workers = workers
    self.rule = rule
    self.compute = compute
    self.network = network
    self.model_bytes = float(model_bytes)
    self.times = np.zeros(workers, np.float64)
    self.units = np.zeros(workers, np.int64)
    self.iteration = 0
    self.sim_time = 0.0
    self.rule_state: dict[str, Any] = {}
    self._rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))

  def compute_units(self, workers: np.ndarray, count: int) -> np.ndarray:
    """Seconds each of `workers` needs for its next `count` micro-batches; advances their unit counters."""
    workers = np.asarray(workers)
    total = np.zeros(workers.shape, np.float64)
    for _ in range(count):
      total += self.compute.sample(self._rng, workers, self.units[workers])
      self.units[workers] += 1
    return total

  def sample_one(self, worker: int) -> float:
    """Seconds for worker `worker`'s next micro-batch (for event-driven rules)."""
    return float(self.compute_units(np.array([worker]), 1)[0])

  def next_block(self, n: int) -> Block:
    """Advances n iterations and returns their schedules and timings."""
    iterations = []
    sim_times, durations = np.zeros(n), np.zeros(n)
    for k in range(n):
      it = self.rule.iterate(self, self.iteration)
      now = max(self.sim_time, float(self.times.max()))
      durations[k] = now - self.sim_time
      self.sim_time = sim_times[k] = now
      self.iteration += 1
      iterations.append(it)
    schedule = {key: np.stack([it.schedule[key] for it in iterations]) for key in iterations[0].schedule}
    idle = np.array([it.idle.sum() for it in iterations])
    worker_seconds = np.maximum(durations * self.workers, 1e-300)
    return Block(
        schedule=schedule, duration=durations, sim_time=sim_times,
        idle_fraction=np.where(durations > 0, idle / worker_seconds, 0.0),
        mean_staleness=np.array([it.staleness.mean() for it in iterations]),
        bytes_communicated=np.array([it.bytes_communicated for it in iterations]))

  def state_dict(self) -> dict[str, Any]:
    """JSON-serialisable state; `load_state_dict` of it continues the same sequence."""
    return {
        'times': self.times.tolist(), 'units': self.units.tolist(), 'iteration': self.iteration,
        'sim_time': self.sim_time, 'rng': self._rng.bit_generator.state,
        'rule_state': {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in self.rule_state.items()},
    }

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.times = np.asarray(state['times'], np.float64)
    self.units = np.asarray(state['units'], np.int64)
    self.iteration = int(state['iteration'])
    self.sim_time = float(state['sim_time'])
    self._rng.bit_generator.state = state['rng']
    self.rule_state = {k: (np.asarray(v) if isinstance(v, list) else v) for k, v in state['rule_state'].items()}
