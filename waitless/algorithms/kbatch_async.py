"""K-batch-async SGD, and asynchronous SGD (`async`, K = 1): update after every K gradients, no idle time.

Update rule (update t): with B_t the next K gradients to arrive from any learners, each computed at the view
its learner held when it started,
    W_{t+1} = W_t + U((1/K) sum_{b in B_t} lambda_b g_b(W_{tau_b})),
and a learner fetches the server's current model after every push. Time per update with X ~ Exp(mu), ideal
network: K / (P mu) in the long run; async 1 / (P mu).

Ringmaster ASGD (`ringmaster`, or `max_delay` R >= 1 on `async` / `kbatch_async`): a gradient whose delay
t - tau_b (server versions since its learner fetched its view) is >= R is discarded on arrival, not counted in
B_t, and its learner restarts on the current W_t; discarded work consumes no samples. R = infinity
(`max_delay` = 0) is async / K-batch-async exactly. This is the paper's Algorithm 4 (without calculation
stops): a learner is stopped when its gradient arrives, not as soon as its delay reaches R.

References: Dutta et al., "Slow and Stale Gradients Can Win the Race", AISTATS 2018; Maranjyan, Tyurin,
Richtarik, "Ringmaster ASGD: The First Asynchronous SGD with Optimal Time Complexity", ICML 2025.
"""

from __future__ import annotations

from waitless import config_errors as errors
from waitless.algorithms import parameter_server as ps


def validate_max_delay(config) -> None:
  r = config.algorithm.max_delay
  ok = errors.is_int(r) and r >= 0
  meaning = ('0: R = workers' if config.algorithm.name == 'ringmaster' else '0: no threshold')
  errors.require(ok, 'algorithm.max_delay', r, f'must be an integer >= 0 (Ringmaster\'s R: a gradient whose delay '
                 f'is >= R server versions is discarded; {meaning})')


def validate(config) -> None:
  ps.validate_k(config)
  ps.validate_adaptive_lr(config.algorithm)
  validate_max_delay(config)


def validate_async(config) -> None:
  ps.validate_adaptive_lr(config.algorithm)
  validate_max_delay(config)


_MAX_DELAY = {'max_delay': 0}  # Ringmaster's R; 0: no threshold

SPEC = ps.make_spec('kbatch_async', {'k': 4, **_MAX_DELAY, **ps.ADAPTIVE_LR_DEFAULTS},
                    validate, ps.k_jobs, several_jobs=True)
# `async` and `ringmaster` differentiate through `gradient_params` too: after a discard a learner's gradient is
# computed at W_t, not at its view.
ASYNC = ps.make_spec('async', {**_MAX_DELAY, **ps.ADAPTIVE_LR_DEFAULTS},
                     validate_async, ps.one_job, several_jobs=True)
# Ringmaster ASGD (Maranjyan, Tyurin, Richtarik, ICML 2025): async with R; by default R = P workers (the mean
# delay of async SGD on P equally fast workers is P - 1, so only gradients staler than that are dropped: those
# of the slow workers). The paper's R = max(1, ceil(sigma^2 / epsilon)) depends on the problem; set max_delay.
RINGMASTER = ps.make_spec('ringmaster', {**_MAX_DELAY, **ps.ADAPTIVE_LR_DEFAULTS},
                          validate_async, ps.one_job, several_jobs=True)
