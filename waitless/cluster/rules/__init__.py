"""Time rules: the contract (`base`), helpers shared by rule families, and the rules of algorithms to come.

A rule never touches parameters. Given the clock (per-worker times, the compute and network models), it
advances the clocks by one iteration and returns the typed per-worker schedule that the math consumes (see
`cluster/rules/base.py` for the contract). Each algorithm module in `algorithms/` holds its own rule next to
its math (sync: `Barrier`, local_sgd: `PeriodicAverage`, the parameter-server family: `KSync`, `KBatchSync`,
`KAsync`, `KBatchAsync`, `AdaSync`, dpsgd: `RingGossip`, nonblocking: `NonBlocking`, wagma:
`WaitAvoidingGroups`, dasgd: `DelayedAverage`, lap_sgd / lpp_sgd: `NodeThreads`) and builds it from its config
in `time_rule(config)`.

Here: the shared pieces (`WaitsForEveryone`, the ring helpers, the delayed-average clock of
`cluster/rules/delayed_average.py`).
"""

from waitless.cluster.rules.base import Iteration
from waitless.cluster.rules.base import Steps
from waitless.cluster.rules.base import TimeRule
from waitless.cluster.rules.base import check_positive_int
from waitless.cluster.rules.base import full
from waitless.cluster.rules.synchronous import EveryoneSchedule
from waitless.cluster.rules.synchronous import WaitsForEveryone

__all__ = [
    'EveryoneSchedule', 'Iteration', 'Steps',
    'TimeRule', 'WaitsForEveryone', 'check_positive_int', 'full',
]
