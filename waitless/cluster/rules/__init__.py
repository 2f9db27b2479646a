"""Time rules: the contract (`base`), one module per algorithm, and the helpers rule families share.

A rule never touches parameters. Given the clock (per-worker times, the compute and network models), it
advances the clocks by one iteration and returns the typed per-worker schedule that the math consumes (see
`cluster/rules/base.py` for the contract; the schedule records live with the math, in `algorithms/`, and what
an iteration returns, `Iteration` / `Steps`, in `cluster/schedules.py`). Each algorithm's rule is
`cluster/rules/NAME.py`, built from its config by `time_rule(config)` (sync: `Barrier`, local_sgd:
`PeriodicAverage`, the parameter-server family: `KSync`, `KBatchSync`, `KAsync`, `KBatchAsync`, `AdaSync`,
dpsgd: `RingGossip`, matcha: `MatchingGossip`, nonblocking: `NonBlocking`, wagma: `WaitAvoidingGroups`, dasgd:
`DelayedAverage`, lap_sgd / lpp_sgd: `NodeThreads`, streaming_diloco: `StreamingAverage`);
`cluster/registry.py` pairs each with its algorithm.

Shared pieces: `waits_for_everyone` (`WaitsForEveryone`, the base of the rules that wait for every worker),
`ring` (the ring's neighbours), `activation` (the activation broadcast of wait-avoiding collectives),
`delayed_averaging_time` (the clock of delayed model averaging), `parameter_server` (the parameter-server
family's base rule and vectorised path).
"""
