"""Time rules: how one iteration of an algorithm family advances the per-worker clocks.

A rule never touches parameters. Given the clock (per-worker times, the compute and network models), it
advances the clocks by one iteration and returns the per-worker schedule that the math consumes. Each
algorithm module builds its rule from its config in `time_rule(config)` (`AlgorithmSpec.time_rule`).

A rule is an object with
  iterate(clock, iteration) -> Iteration     advance one iteration (required)
  tolerated_failures(workers) -> int         workers it can lose for good and still progress (0 if absent)
  feedback(clock, measurements)              optional: training measurements (AdaSync's loss)
and keeps whatever it carries between iterations in `clock.rule_state` (checkpointed with the clock).

Every schedule holds `microbatches_done`: int32 (P,), the micro-batches each worker contributes this
iteration. Each rule's docstring lists its other fields with dtype, shape and meaning.

  family (algorithm)                    rule
  sync                                  Barrier(microbatches)
  local_sgd                             PeriodicAverage(averages_at, microbatches)
  dpsgd                                 RingGossip(microbatches)
  nonblocking                           NonBlocking(microbatches, trigger, deadline_s, topology)
  ksync                                 KSync(k, microbatches)
  kbatch_sync                           KBatchSync(k, microbatches)
  kasync                                KAsync(k, microbatches)
  kbatch_async, async (K = 1)           KBatchAsync(k, microbatches)
  adasync                               AdaSync(base=<one of the four K rules>, k0, period_s)
  dasgd                                 DelayedAverage(period, delay, microbatches)
  lap_sgd, lpp_sgd                      NodeThreads(threads, averages_at, microbatches, delay_steps)
  wagma                                 WaitAvoidingGroups(group_size, period, microbatches)
"""

from cluster.rules.base import Iteration
from cluster.rules.delayed_average import DelayedAverage
from cluster.rules.delayed_average import NodeThreads
from cluster.rules.nonblocking import NonBlocking
from cluster.rules.parameter_server import AdaSync
from cluster.rules.parameter_server import KAsync
from cluster.rules.parameter_server import KBatchAsync
from cluster.rules.parameter_server import KBatchSync
from cluster.rules.parameter_server import KSync
from cluster.rules.synchronous import Barrier
from cluster.rules.synchronous import PeriodicAverage
from cluster.rules.synchronous import RingGossip
from cluster.rules.wagma import WaitAvoidingGroups
from cluster.rules.wagma import group_ids
from cluster.rules.wagma import group_masks

__all__ = [
    'AdaSync', 'Barrier', 'DelayedAverage', 'Iteration', 'KAsync', 'KBatchAsync', 'KBatchSync', 'KSync',
    'NodeThreads', 'NonBlocking', 'PeriodicAverage', 'RingGossip', 'WaitAvoidingGroups', 'group_ids',
    'group_masks',
]
