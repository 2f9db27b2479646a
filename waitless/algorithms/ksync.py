"""K-sync SGD: the server takes the first K gradients of P and cancels the rest; K = P is synchronous SGD.

Update rule (update t): all learners start from W_t; with S_t the first K learners to finish,
    W_{t+1} = W_t + U((1/K) sum_{i in S_t} g_i(W_t))
computed by the shared parameter-server math (`algorithms.parameter_server`); cancelled work consumes no
samples. Time per update with X ~ Exp(mu), ideal network: (H_P - H_{P-K}) / mu.

Reference: Dutta, Joshi, Ghosh, Dube, Nagpurkar, "Slow and Stale Gradients Can Win the Race: Error-Runtime
Trade-offs in Distributed SGD", AISTATS 2018.
"""

from __future__ import annotations

from waitless import config_errors as errors
from waitless.algorithms import parameter_server as ps


# When the slower learners stop (the time rule's choice, `cluster/rules/ksync.py`): `immediate` (the paper) or
# `on_arrival` (a real runtime, the Ray runtime's server: a late job is discarded when it arrives).
CANCEL = ('immediate', 'on_arrival')


def validate(config) -> None:
  ps.validate_k(config)
  errors.require(config.algorithm.cancel in CANCEL, 'algorithm.cancel', config.algorithm.cancel,
                 f'one of {", ".join(CANCEL)}')


SPEC = ps.make_spec('ksync', {'k': 4, 'cancel': 'immediate'}, validate, ps.one_job, several_jobs=False,
                    fresh_views=ps.always_fresh)
