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
with k=B, max_delay=1 (tests/algorithms/test_ps_simulator.py: RennalaTest), and `cancel=on_arrival` is that
time rule for K-batch-sync (`cluster/rules/kbatch_sync.py`): what a real runtime, the Ray runtime's server
included, does. The update is the same either way.

References: Dutta et al., "Slow and Stale Gradients Can Win the Race", AISTATS 2018; Tyurin, Richtarik,
"Optimal Time Complexities of Parallel Stochastic Optimization Methods Under a Fixed Computation Model",
NeurIPS 2023.
"""

from __future__ import annotations

from waitless import config_errors as errors
from waitless.algorithms import ksync
from waitless.algorithms import parameter_server as ps

# When the work in flight at an update stops (the time rule's choice): as K-sync's `cancel`.
CANCEL = ksync.CANCEL


def validate(config) -> None:
  ps.validate_k(config)
  errors.require(config.algorithm.cancel in CANCEL, 'algorithm.cancel', config.algorithm.cancel,
                 f'one of {", ".join(CANCEL)}')


SPEC = ps.make_spec('kbatch_sync', {'k': 4, 'cancel': 'immediate'}, validate, ps.k_jobs, several_jobs=True,
                    fresh_views=ps.always_fresh)
