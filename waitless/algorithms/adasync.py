"""AdaSync: K of a K-family variant adapted every t0 seconds of simulated time from the training loss.

    K <- min(P - lost, max(1, round(K0 sqrt(F(W_0) / F(W_t)))))

The math is the parameter server's (`algorithms.parameter_server`); only K changes, through the time rule.
The training loop reports the training loss to the clock after each block (`Clock.feedback`), the only place
where training feeds back into the simulator.

Reference: Dutta, Joshi, Ghosh, Dube, Nagpurkar, "Slow and Stale Gradients Can Win the Race: Error-Runtime
Trade-offs in Distributed SGD", AISTATS 2018; the journal version with AdaSync, arXiv 2003.10579.
"""

from __future__ import annotations

from waitless import config_errors as errors
from waitless.algorithms import parameter_server as ps

# The variants AdaSync can adapt (their time rules: `cluster/rules/adasync.py`).
BASES = ('ksync', 'kbatch_sync', 'kasync', 'kbatch_async')
_FRESH = ('ksync', 'kbatch_sync')
_STALE = ('kasync', 'kbatch_async')
_SEVERAL_JOBS = ('kbatch_sync', 'kbatch_async')


def validate(config) -> None:
  a = config.algorithm
  errors.require(a.base in BASES, 'algorithm.base', a.base, f'one of {", ".join(BASES)}')
  ps.require_k(a.k0, 'algorithm.k0', config.workers)
  errors.require_number(a.adapt_every_s, 'algorithm.adapt_every_s',
                        'must be a number of simulated seconds > 0: AdaSync adapts K from the training loss every '
                        'adapt_every_s; without it there is no loss signal (use a fixed-K variant instead)',
                        lambda v: v > 0)
  # The loop reports the training loss to the clock after each block of <= steps_per_call iterations; the
  # first report is F(W_0), so K can only change from the third block on.
  # With num_epochs (num_steps None) this is checked on the resolved config (experiments/harness/setup.py:build).
  # On the Ray runtime the server sees the loss of every update: no blocks.
  blocks = config.get('runtime', 'spmd') != 'ray'
  errors.require(not blocks or config.num_steps is None or config.num_steps > 2 * config.steps_per_call, 'num_steps',
                 config.num_steps,
                 f'adasync needs > 2 x steps_per_call={config.steps_per_call} iterations: the training loss '
                 'reaches the clock once per block, and K adapts only after two reports (no loss signal otherwise)')
  ps.validate_adaptive_lr(a)
  errors.require(a.adaptive_lr_c == 0 or a.base in _STALE, 'algorithm.adaptive_lr_c', a.adaptive_lr_c,
                 f'the staleness-adaptive learning rate needs stale views: base in {", ".join(_STALE)}, '
                 f'not {a.base!r} (or 0)')


def fresh_views(config) -> bool:
  """The synchronous bases have every learner fetch the new model after every update."""
  return config.algorithm.base in _FRESH


def microbatches_per_iteration(config) -> int:
  if config.algorithm.base in _SEVERAL_JOBS:
    return config.workers * config.microbatches  # K may grow to P
  return config.microbatches


SPEC = ps.make_spec('adasync', {'base': 'ksync', 'k0': 1, 'adapt_every_s': 1.0, **ps.ADAPTIVE_LR_DEFAULTS},
                    validate, microbatches_per_iteration, several_jobs=True, fresh_views=fresh_views)
