"""Which real arrivals a parameter server's update takes: the schedule of each update, from the pushes as they come.

The math of the whole family is `algorithms.parameter_server` (one update from a `ServerSchedule`); the time
rules (`cluster/rules/NAME.py`) say which learners push what in simulated time. On real machines the pushes
arrive when they arrive, and `Arrivals` turns them into the same schedules, one per server update t:

| variant | a push at delay d = t - (version it read) | the pusher then | the update fires |
| --- | --- | --- | --- |
| `ksync` | taken if d = 0, else discarded (cancelled work) | waits for W_{t+1} | at the K-th taken push |
| `kbatch_sync` (Rennala) | taken if d = 0, else discarded | goes on at once on W_t | at the K-th taken push |
| `kasync` | taken (stale allowed) | waits for W_{t+1} | at the K-th taken push |
| `kbatch_async`, `async` | taken | goes on at once on W_t | at the K-th taken push |
| `ringmaster` | taken if d < R, else discarded | goes on at once on W_t | at the K-th taken push |
| `adasync` | as its base, with K adapted from the loss (`cluster.rules.adasync.adapted_k`) | | |

The pusher of the K-th gradient fetches W_{t+1}. A learner that starts (or that Ray restarted) fetches the
current W_t: unless that is its view already, the update records it as a discarded one's restart (the schedule's
`discarded`: any gradient it pushes in this update was computed at W_t, and without a push its view becomes
W_t), which is what the update's math reads. A real runtime cannot stop a job in flight: where the papers
cancel work (K-sync, K-batch-sync: the slower jobs of a round; Ringmaster: a learner whose delay reached R), the
job runs to its end and is discarded when it arrives, and its learner fetches the current model then. Discarded
work consumes no samples: a learner's data position moves only with its taken pushes, so the data each taken
gradient used is a function of the schedule, which is what the float64 replay needs.

Pure bookkeeping: no JAX, no Ray (`server.py` holds the model and calls the update).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import numpy as np

from waitless.algorithms import parameter_server as ps
from waitless.cluster.rules import adasync as adasync_rule
from waitless.cluster.rules import kasync as kasync_rule
from waitless.cluster.rules import kbatch_async as kbatch_async_rule
from waitless.cluster.rules import kbatch_sync as kbatch_sync_rule
from waitless.cluster.rules import ksync as ksync_rule

# What happened to a push; FETCHED: a learner that (re)started fetched the current model.
TAKEN, TAKEN_LAST, DISCARDED, FETCHED = 'taken', 'taken_last', 'discarded', 'fetched'


@dataclasses.dataclass(frozen=True)
class Policy:
  """How a variant's server treats a push.

  Attributes:
    current_only: only gradients computed at the current version count (K-sync, K-batch-sync); older ones are
      discarded on arrival.
    waits: a learner whose gradient was taken waits for the update (K-sync, K-async); otherwise it fetches the
      current model at once and starts another job.
    max_delay: Ringmaster's R: a gradient whose delay is >= R is discarded (math.inf: none).
  """
  current_only: bool
  waits: bool
  max_delay: float = math.inf


def initial_k(rule) -> int:
  """K of a parameter-server rule's first update (AdaSync: its K0)."""
  return rule.k0 if isinstance(rule, adasync_rule.AdaSync) else rule.k


def policy_of(rule) -> Policy:
  """The arrival policy of a parameter-server time rule (`cluster.registry.time_rule(config)`)."""
  if isinstance(rule, adasync_rule.AdaSync):
    return policy_of(rule.base)
  if isinstance(rule, ksync_rule.KSync):
    return Policy(current_only=True, waits=True)
  if isinstance(rule, kbatch_sync_rule.KBatchSync):
    return Policy(current_only=True, waits=False)
  if isinstance(rule, kasync_rule.KAsync):
    return Policy(current_only=False, waits=True)
  if isinstance(rule, kbatch_async_rule.KBatchAsync):
    return Policy(current_only=False, waits=False,
                  max_delay=math.inf if rule.max_delay is None else rule.max_delay)
  raise TypeError(f'{type(rule).__name__} is not a parameter-server rule')


class Push(NamedTuple):
  """One arrival, as the event log records it."""
  time_s: float     # seconds since the run's start (measured), when the server received it
  learner: int
  version: int      # the server version of the model the gradient was computed on
  delay: int        # server versions since then: t - version
  position: int     # the learner's data position (micro-batches) of the job's first micro-batch
  outcome: str      # TAKEN, TAKEN_LAST (the K-th: the update fires) or DISCARDED
  update: int       # the server update t it belongs to (taken) or arrived during (discarded)


class Update(NamedTuple):
  """One server update as the event log records it: its schedule and the data positions it started from."""
  schedule: ps.ServerSchedule
  positions: np.ndarray  # int64 (P,), each learner's data position at the start of the update
  time_s: float          # when it was applied (seconds since the run's start)


class Arrivals:
  """The pushes of the update in progress, and the decision each new push brings.

  Attributes:
    version: t, the server updates applied so far.
    positions: int64 (P,), each learner's data position (micro-batches) for its next job.
    k: K of the update in progress.
  """

  def __init__(self, workers: int, microbatches: int, policy: Policy, k: int, version: int = 0,
               positions: Optional[np.ndarray] = None):
    self.workers, self.microbatches, self.policy = workers, microbatches, policy
    self.version, self.k = version, k
    self.positions = np.zeros(workers, np.int64) if positions is None else np.asarray(positions, np.int64).copy()
    # The server version of each learner's view as the schedules have it; -1: none yet (it fetches first).
    self.view_version = np.full(workers, -1 if version else 0, np.int64)
    self._begin()

  def _begin(self) -> None:
    p = self.workers
    self.start_positions = self.positions.copy()
    self.contributions = np.zeros(p, np.int32)
    self.staleness = np.zeros(p, np.int32)
    self.discarded = np.zeros(p, bool)
    self.last_event = np.full(p, '', object)  # TAKEN / TAKEN_LAST / DISCARDED: the learner's view afterwards
    self.taken = 0

  def push(self, learner: int, version: int, position: int, time_s: float = 0.0) -> Push:
    """Decides one arrival; a TAKEN_LAST push means the caller applies `close_update()` now.

    Raises:
      ValueError: the learner computed at a version that does not exist yet, or at another data position than
        the server gave it (a protocol error, never a user's).
    """
    delay = self.version - version
    if delay < 0 or position != self.positions[learner]:
      raise ValueError(f'learner {learner} pushed a gradient of version {version} at data position {position}; the '
                       f'server is at version {self.version} and gave it position {self.positions[learner]}')
    if (self.policy.current_only and delay > 0) or delay >= self.policy.max_delay:
      if not self.policy.current_only:  # Ringmaster: it restarts on W_t (the schedule's `discarded`)
        self.discarded[learner] = True
        self.last_event[learner] = DISCARDED
        self.view_version[learner] = self.version
      return Push(time_s, learner, version, delay, position, DISCARDED, self.version)
    if self.contributions[learner] == 0:
      self.staleness[learner] = delay
    self.contributions[learner] += 1
    self.positions[learner] += self.microbatches
    self.taken += 1
    outcome = TAKEN_LAST if self.taken == self.k else TAKEN
    self.last_event[learner] = outcome
    return Push(time_s, learner, version, delay, position, outcome, self.version)

  def fetch(self, learner: int, time_s: float = 0.0) -> Optional[Push]:
    """A learner that starts or restarts takes the current model W_t; the FETCHED event when that changes its
    view (the first fetch of a fresh run does not), else None."""
    if self.view_version[learner] == self.version:
      return None
    if not self.policy.current_only:  # fresh views need nothing: every view is W_t
      self.discarded[learner] = True
      self.last_event[learner] = DISCARDED
    self.view_version[learner] = self.version
    return Push(time_s, learner, self.version, 0, int(self.positions[learner]), FETCHED, self.version)

  def close_update(self, time_s: float = 0.0) -> Update:
    """The schedule of the update the K-th push completed; starts the next one (version t + 1)."""
    if self.taken != self.k:
      raise ValueError(f'update {self.version} has {self.taken} of its K={self.k} gradients')
    if self.policy.current_only:  # fresh views: every learner fetches W_{t+1}, cancelled or not
      refresh, fetch_current = np.ones(self.workers, bool), np.zeros(self.workers, bool)
    else:
      refresh = self.last_event == TAKEN_LAST
      fetch_current = (self.last_event == TAKEN) | (self.last_event == DISCARDED)
      if self.policy.waits:  # K-async: the K pushers wait for W_{t+1}
        refresh = self.contributions > 0
        fetch_current = self.last_event == DISCARDED
    schedule = ps.schedule(self.workers, self.k, self.microbatches, self.contributions, staleness=self.staleness,
                           refresh_view=refresh, fetch_current=fetch_current, discarded=self.discarded)
    self.view_version = np.where(refresh, self.version + 1, np.where(fetch_current, self.version, self.view_version))
    update = Update(schedule, self.start_positions, time_s)
    self.version += 1
    self._begin()
    return update

  def set_k(self, k: int) -> None:
    """K of the next updates (AdaSync), between updates only."""
    if self.taken:
      raise ValueError('K changes between updates only')
    if not 1 <= k <= self.workers:
      raise ValueError(f'K={k} must be in 1..{self.workers}')
    self.k = k
