"""K-batch-sync SGD: the first K mini-batch gradients from any learners, all computed at W_t, then cancel.

Update rule (update t): all learners start from W_t; a learner that finishes a mini-batch pushes it and starts
another at W_t; with B_t the first K mini-batch gradients,
    W_{t+1} = W_t + U((1/K) sum_{b in B_t} g_b(W_t)).
Time per update with X ~ Exp(mu), ideal network: K / (P mu). A learner's c_i gradients are computed on
consecutive mini-batches of its stream.

Rennala SGD (Tyurin & Richtarik, NeurIPS 2023) with batch B is this update with K = B: B gradients computed at
the current point from any workers, then one step. The time rules differ in one place: Rennala lets a worker
that is mid-computation at an update finish its gradient at the old point, discards it on arrival and sends
the worker to the new point; K-batch-sync cancels that work at the update and every learner restarts at once
(Rennala with calculation stops: the same updates, never later). Rennala event by event is `kbatch_async`
with k=B, max_delay=1 (tests/algorithms/test_ps_simulator.py: RennalaTest).

References: Dutta et al., "Slow and Stale Gradients Can Win the Race", AISTATS 2018; Tyurin, Richtarik,
"Optimal Time Complexities of Parallel Stochastic Optimization Methods Under a Fixed Computation Model",
NeurIPS 2023.
"""

from __future__ import annotations

from waitless.algorithms import parameter_server as ps


SPEC = ps.make_spec('kbatch_sync', {'k': 4}, ps.validate_k, ps.k_jobs, several_jobs=True,
                    fresh_views=ps.always_fresh)
