"""K-sync SGD: the server takes the first K gradients of P and cancels the rest; K = P is synchronous SGD.

Update rule (update t): all learners start from W_t; with S_t the first K learners to finish,
    W_{t+1} = W_t + U((1/K) sum_{i in S_t} g_i(W_t))
computed by the shared parameter-server math (`algorithms.parameter_server`); cancelled work consumes no
samples. Time per update with X ~ Exp(mu), ideal network: (H_P - H_{P-K}) / mu.

Reference: Dutta, Joshi, Ghosh, Dube, Nagpurkar, "Slow and Stale Gradients Can Win the Race: Error-Runtime
Trade-offs in Distributed SGD", AISTATS 2018.
"""

from __future__ import annotations

from waitless.algorithms import parameter_server as ps


SPEC = ps.make_spec('ksync', {'k': 4}, ps.validate_k, ps.one_job, several_jobs=False, fresh_views=ps.always_fresh)
