"""K-async SGD: the server updates with the first K learners to push; only they fetch the new model.

Update rule (update t): with S_t the first K learners to push, each gradient computed at that learner's view
W_{tau_i} (possibly stale),
    W_{t+1} = W_t + U((1/K) sum_{i in S_t} lambda_i g_i(W_{tau_i})),
lambda_i = 1, or the staleness-adaptive factor (`adaptive_lr_c` > 0). K = 1 is asynchronous SGD with one
gradient per update. Time per update with X ~ Exp(mu), ideal network: (H_P - H_{P-K}) / mu (memorylessness).

Reference: Dutta et al., "Slow and Stale Gradients Can Win the Race", AISTATS 2018.
"""

from __future__ import annotations

from waitless.algorithms import parameter_server as ps


def validate(config) -> None:
  ps.validate_k(config)
  ps.validate_adaptive_lr(config.algorithm)


SPEC = ps.make_spec('kasync', {'k': 4, **ps.ADAPTIVE_LR_DEFAULTS}, validate, ps.one_job, several_jobs=False)
