"""Builds the clock for a config: compute model from `config.stragglers`, network from `config.network`, the
host's time per iteration from `config.cluster`, all three through a cluster profile when `cluster.profile`
names one (`effective`; `cluster/profiles.py` says how a profile and explicit fields combine).

The fields and their meaning are those of `experiments/configs/common.py:base_config` (every config has all of
them). `validate(config)` checks every `stragglers.*` / `network.*` / `cluster.*` field (and the profile's file)
before anything compiles, raises `config_errors.ConfigError` naming the field, and returns the checked cost
model (`Effective`) that `make_clock` then charges: a profile is read and parsed once per run.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import ml_collections
import numpy as np

from waitless import config_errors as errors

from waitless.cluster import calibration
from waitless.cluster import clock as clock_lib
from waitless.cluster import compute as compute_lib
from waitless.cluster import faults
from waitless.cluster import network as network_lib
from waitless.cluster import profiles
from waitless.cluster.rules import base as rules_base

DISTRIBUTIONS = ('constant', 'exponential', 'shifted_exponential', 'pareto', 'lognormal', 'trace')
# `slow_workers` and `random_delay` are `constant` with that modifier required; the modifiers
# (slow_*, delayed_workers / delay_s, fail_*) compose with every kind.
# `measured`: no compute model at all. The run's clock is the measured time of the real devices
# (`experiments/harness/measured_time.py`); the rule is driven by a clock on which every worker takes `base_s` per
# micro-batch, so it gives its synchronous schedule (every worker finishes its m micro-batches).
MEASURED = 'measured'
# The longest time one micro-batch's fields may give (11.6 days): beyond, a sum of iterations overflows float64
# (1e308 read as "never finishes": a failed worker) or loses the clock's sub-second resolution.
MAX_SECONDS = 1e6
STRAGGLER_KINDS = DISTRIBUTIONS + ('slow_workers', 'random_delay', MEASURED)
# `delayed_workers` distinct workers per job, or that many independent draws (which may coincide).
DELAY_DRAWS = ('distinct', 'independent')
NETWORK_KINDS = ('ideal', 'alpha_beta')


# What a measured run leaves unset (`stragglers.kind='measured'`: nothing is simulated): the value of each compute-time
# modifier that modifies nothing.
_UNMODIFIED = {'calibrate': False, 'overhead_s': 0.0, 'slow_fraction': 0.0, 'delayed_workers': 0, 'delay_s': 0.0,
               'delay_calls': 0.0}
_WORKER_LISTS = ('slow_workers', 'fail_worker', 'worker_factors')  # unset: empty (or -1: nobody)


def _worker_list(value) -> tuple:
  if value is None or (errors.is_int(value) and value == -1):  # -1: nobody
    return ()
  return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _return_time(value):
  """`return_at_s` as a time, or None for never (None or a negative number)."""
  return None if value is None or (errors.is_number(value) and value < 0) else value


def _require_workers(value, field: str, workers: int) -> tuple[int, ...]:
  ids = _worker_list(value)
  ok = all(errors.is_int(w) and 0 <= w < workers for w in ids) and len(set(ids)) == len(ids)
  errors.require(ok, field, value, f'must be distinct worker ids in 0..{workers - 1} (-1: none)')
  return tuple(int(w) for w in ids)


def _require_factors(value, workers: int) -> tuple[float, ...]:
  """`stragglers.worker_factors` as floats: () or exactly `workers` finite numbers > 0."""
  field = 'stragglers.worker_factors'
  errors.require(isinstance(value, (list, tuple, np.ndarray)), field, value,
                 f'must be a tuple of {workers} per-worker factors > 0 (one per worker), or () for none')
  factors = tuple(value)
  if not factors:
    return ()
  errors.require(len(factors) == workers, field, value,
                 f'has {len(factors)} factors; needs exactly one per worker (workers={workers})')
  ok = all(errors.is_number(f) and bool(np.isfinite(f)) and f > 0 for f in factors)
  errors.require(ok, field, value, 'every factor must be a finite number > 0')
  return tuple(float(f) for f in factors)


def validate(config: ml_collections.ConfigDict) -> Effective:
  """Checks every `stragglers.*`, `network.*` and `cluster.*` field, and the profile `cluster.profile` names.

  Returns:
    The cost model the clock charges (`effective(config)`): the profile's file read and parsed once, here.

  Raises:
    config_errors.ConfigError: naming the first bad field, its value and what is allowed.
  """
  s, p = config.stragglers, config.workers
  kind = s.kind
  errors.require(kind in STRAGGLER_KINDS, 'stragglers.kind', kind, f'known: {", ".join(STRAGGLER_KINDS)}')
  errors.require_number(s.base_s, 'stragglers.base_s', f'must be a number > 0 and <= {MAX_SECONDS:g} (seconds)',
                        lambda v: 0 < v <= MAX_SECONDS)
  errors.require(isinstance(s.calibrate, bool), 'stragglers.calibrate', s.calibrate, 'must be a bool')
  errors.require_number(s.overhead_s, 'stragglers.overhead_s',
                        f'must be a number >= 0 and <= {MAX_SECONDS:g} (seconds per call)',
                        lambda v: 0 <= v <= MAX_SECONDS)
  # Every parameter is checked, also those the chosen kind does not read: a typo is caught either way.
  errors.require_number(s.rate, 'stragglers.rate', 'must be a number > 0 (1/seconds)', lambda v: v > 0)
  errors.require_number(s.shift_s, 'stragglers.shift_s', f'must be a number >= 0 and <= {MAX_SECONDS:g} (seconds)',
                        lambda v: 0 <= v <= MAX_SECONDS)
  errors.require_number(s.shape, 'stragglers.shape', 'must be a number > 0', lambda v: v > 0)
  errors.require_number(s.scale, 'stragglers.scale', f'must be a number > 0 and <= {MAX_SECONDS:g} (seconds)',
                        lambda v: 0 < v <= MAX_SECONDS)
  errors.require_number(s.sigma, 'stragglers.sigma', 'must be a number >= 0', lambda v: v >= 0)
  if kind == 'trace':
    compute_lib.load_trace(s.trace_path, p)
  else:
    errors.require(s.trace_path in ('', None), 'stragglers.trace_path', s.trace_path,
                   f"is read only with kind=trace (kind={kind!r}); leave it empty")

  errors.require_number(s.slow_fraction, 'stragglers.slow_fraction', 'must be a fraction in [0, 1]',
                        lambda v: 0 <= v <= 1)
  errors.require_number(s.slow_factor, 'stragglers.slow_factor', 'must be a number > 0', lambda v: v > 0)
  slow = _require_workers(s.slow_workers, 'stragglers.slow_workers', p)
  errors.require(not (slow and s.slow_fraction > 0), 'stragglers.slow_workers', s.slow_workers,
                 'set either slow_workers or slow_fraction, not both')
  factors = _require_factors(s.worker_factors, p)
  errors.require(not (factors and (slow or s.slow_fraction > 0)), 'stragglers.worker_factors',
                 s.worker_factors, 'set either worker_factors or slow_fraction / slow_workers, not both')
  if kind == 'slow_workers':
    errors.require(bool(slow) or s.slow_fraction > 0 or bool(factors), 'stragglers.slow_fraction',
                   s.slow_fraction, 'kind=slow_workers needs slow_fraction > 0, a slow_workers list or '
                   'worker_factors')

  delayed = s.delayed_workers
  errors.require(errors.is_int(delayed) and 0 <= delayed <= p, 'stragglers.delayed_workers', delayed,
                 f'must be an integer in 0..{p} (workers)')
  errors.require_number(s.delay_s, 'stragglers.delay_s', f'must be a number >= 0 and <= {MAX_SECONDS:g} (seconds)',
                        lambda v: 0 <= v <= MAX_SECONDS)
  errors.require_number(s.delay_calls, 'stragglers.delay_calls',
                        f'must be a number >= 0 and <= {MAX_SECONDS:g} (micro-batch calls)',
                        lambda v: 0 <= v <= MAX_SECONDS)
  errors.require(not (s.delay_s > 0 and s.delay_calls > 0), 'stragglers.delay_calls', s.delay_calls,
                 f'and stragglers.delay_s={s.delay_s!r} both set the delay: set one of them')
  errors.require(s.delay_draws in DELAY_DRAWS, 'stragglers.delay_draws', s.delay_draws,
                 f'one of {", ".join(DELAY_DRAWS)}')
  if kind == 'random_delay':
    errors.require(delayed >= 1, 'stragglers.delayed_workers', delayed, 'kind=random_delay needs >= 1')
    errors.require(s.delay_s > 0 or s.delay_calls > 0, 'stragglers.delay_s', s.delay_s,
                   'kind=random_delay needs > 0 (or stragglers.delay_calls > 0)')

  failed = _require_workers(s.fail_worker, 'stragglers.fail_worker', p)
  errors.require_number(s.fail_at_s, 'stragglers.fail_at_s', 'must be a number >= 0', lambda v: v >= 0)
  back = s.return_at_s
  errors.require(back is None or errors.is_number(back), 'stragglers.return_at_s', back,
                 'must be a time > fail_at_s, or -1 (never returns)')
  if failed and _return_time(back) is not None:
    errors.require_number(back, 'stragglers.return_at_s', 'must be a time > fail_at_s, or -1 (never returns)',
                          lambda v: v > s.fail_at_s)

  if kind == MEASURED:  # nothing is simulated: a modifier of the simulated compute times would be ignored
    for name in (*_UNMODIFIED, *_WORKER_LISTS):
      value = s[name]
      unset = not _worker_list(value) if name in _WORKER_LISTS else value == _UNMODIFIED[name]
      errors.require(unset, f'stragglers.{name}', value,
                     f'modifies simulated compute times; with stragglers.kind={MEASURED!r} the devices are real '
                     f'and nothing is simulated: leave it unset')
    errors.require(config.network.kind == 'ideal', 'network.kind', config.network.kind,
                   f"must be 'ideal' with stragglers.kind={MEASURED!r}: the network is the real one, not simulated")

  n = config.network
  errors.require(n.kind in NETWORK_KINDS, 'network.kind', n.kind, f'known: {", ".join(NETWORK_KINDS)}')
  errors.require_number(n.latency_s, 'network.latency_s', 'must be a number >= 0', lambda v: v >= 0)
  errors.require_number(n.bandwidth_gbps, 'network.bandwidth_gbps', 'must be a number > 0', lambda v: v > 0)
  _validate_cluster(config, kind)
  return effective(config)  # with a profile: the file, its fields, and a compute entry for this config's model


def _validate_cluster(config: ml_collections.ConfigDict, kind: str) -> None:
  c = config.cluster
  errors.require_number(c.host_s, 'cluster.host_s', 'must be a number >= 0 (seconds per iteration)',
                        lambda v: v >= 0)
  errors.require(isinstance(c.get('slow_hosts', False), bool), 'cluster.slow_hosts', c.get('slow_hosts'),
                 'must be True or False')
  explicit = c.explicit
  errors.require(isinstance(explicit, (list, tuple)) and all(f in profiles.PROFILE_FIELDS for f in explicit),
                 'cluster.explicit', explicit, f'must be a tuple of fields among {", ".join(profiles.PROFILE_FIELDS)}')
  profile = c.profile
  if profile in ('', None):
    return
  errors.require(kind != MEASURED, 'cluster.profile', profile,
                 f'a run with stragglers.kind={MEASURED!r} is timed on its real devices; leave the profile empty')
  errors.require(not config.stragglers.calibrate, 'stragglers.calibrate', True,
                 'measures this machine\'s step; with cluster.profile the profile gives the compute: set one of them')


def slow_factors(stragglers: ml_collections.ConfigDict, workers: int) -> np.ndarray:
  """float64 (P,): per-worker multiplier of compute times (1 for normal workers).

  `worker_factors` when set (validated: P finite numbers > 0); else `slow_factor` for the slow workers
  (`slow_workers`, or the first round(slow_fraction P)) and 1 for the others.
  """
  if len(stragglers.worker_factors):
    return np.asarray(stragglers.worker_factors, np.float64).reshape(workers)
  slow = list(_worker_list(stragglers.slow_workers))
  if not slow and stragglers.slow_fraction > 0:
    slow = list(range(int(round(stragglers.slow_fraction * workers))))
  factors = np.ones(workers, np.float64)
  factors[slow] = stragglers.slow_factor
  return factors


def make_compute(stragglers: ml_collections.ConfigDict, workers: int) -> compute_lib.ComputeModel:
  """The per-micro-batch compute model: (overhead + distribution) x per-worker slow factors.

  `CallOverhead` wraps the distribution only when `overhead_s` > 0, and `SlowWorkers` only when a factor is not 1:
  with neither, the clock samples the distribution itself.
  """
  kind = stragglers.kind
  if kind in ('constant', 'slow_workers', 'random_delay', MEASURED):
    model = compute_lib.Constant(base_s=float(stragglers.base_s))
  elif kind == 'exponential':
    model = compute_lib.Exponential(rate=float(stragglers.rate))
  elif kind == 'shifted_exponential':
    model = compute_lib.ShiftedExponential(shift_s=float(stragglers.shift_s), rate=float(stragglers.rate))
  elif kind == 'pareto':
    model = compute_lib.Pareto(shape=float(stragglers.shape), scale=float(stragglers.scale))
  elif kind == 'lognormal':
    model = compute_lib.Lognormal(base_s=float(stragglers.base_s), sigma=float(stragglers.sigma))
  elif kind == 'trace':
    model = compute_lib.Trace(times=compute_lib.load_trace(stragglers.trace_path, workers))
  else:
    raise errors.ConfigError('stragglers.kind', kind, f'known: {", ".join(STRAGGLER_KINDS)}')
  if stragglers.overhead_s > 0:
    model = compute_lib.CallOverhead(base=model, overhead_s=float(stragglers.overhead_s))
  factors = slow_factors(stragglers, workers)
  if np.any(factors != 1.0):
    model = compute_lib.SlowWorkers(base=model, factors=factors)
  return model


def make_network(network: ml_collections.ConfigDict) -> network_lib.Network:
  kind = network.kind
  if kind == 'ideal':
    return network_lib.Ideal()
  if kind == 'alpha_beta':
    return network_lib.AlphaBeta(latency_s=float(network.latency_s),
                                 bandwidth_gbps=float(network.bandwidth_gbps))
  raise errors.ConfigError('network.kind', kind, f'known: {", ".join(NETWORK_KINDS)}')


def mean_call_s(stragglers: ml_collections.ConfigDict, workers: int) -> float:
  """The mean time of one micro-batch call of the compute model `stragglers` gives (distribution plus overhead;
  slow factors, delays and failures left out): the unit of `delay_calls` and of `experiments.compare
  --sim_calls`. Pass the effective fields (`effective(config).stragglers`) for a run on a cluster profile."""
  call = ml_collections.ConfigDict(stragglers.to_dict())
  call.slow_fraction, call.slow_workers, call.worker_factors = 0.0, (), ()
  return make_compute(call, workers).mean()


def delay_seconds(stragglers: ml_collections.ConfigDict, workers: int) -> float:
  """The transient delay in seconds: `delay_s`, or `delay_calls` x `mean_call_s`, rounded to the picosecond so
  that three calls of 10 ms are 0.03 s exactly."""
  if not stragglers.delay_calls > 0:
    return float(stragglers.delay_s)
  return round(float(stragglers.delay_calls) * mean_call_s(stragglers, workers), 12)


def make_faults(stragglers: ml_collections.ConfigDict, workers: int, seed: int):
  """(RandomDelay or None, Failure or None) from the modifiers of `stragglers` (the effective ones, with a
  profile's compute, when the delay is given in calls)."""
  delay = None
  delay_s = delay_seconds(stragglers, workers) if stragglers.delayed_workers > 0 else 0.0
  if delay_s > 0:
    delay = faults.RandomDelay(count=int(stragglers.delayed_workers), delay_s=delay_s, workers=workers, seed=seed,
                               independent=stragglers.delay_draws == 'independent')
  failure = None
  failed = _worker_list(stragglers.fail_worker)
  if failed:
    back = _return_time(stragglers.return_at_s)
    failure = faults.Failure(failed=tuple(int(w) for w in failed), fail_at_s=float(stragglers.fail_at_s),
                             return_at_s=None if back is None else float(back))
  return delay, failure


@dataclasses.dataclass(frozen=True)
class Effective:
  """What the clock charges: the config's own fields, or the profile's where it names one and the user did not
  set the field explicitly."""
  stragglers: ml_collections.ConfigDict
  network: network_lib.Network
  host_s: float
  profile: str  # the profile's name, '' for none


def effective(config: ml_collections.ConfigDict) -> Effective:
  """The compute model's fields, the network and the host time per iteration the clock charges for `config`.

  With `cluster.profile` set (and the field not in `cluster.explicit`):
    stragglers   `calibration.calibrated(stragglers, o + s x per_sample_s, overhead_s=o)`, s = batch_size /
                 microbatches samples per micro-batch, o = the profile's overhead_s (or the explicit one); a
                 `trace` keeps its measured table and takes only o; an explicit distribution field
                 (`profiles.COMPUTE_FIELDS`) keeps the configured distribution, and takes only o
    network      the profile's `network.Collectives`, unless a `network.*` field is explicit; with
                 `runtime=ray` its point-to-point link is the profile's `ray_p2p` where it has one (the Ray
                 runtime's pushes and replies move through Ray, not through the library the collectives use);
                 its `learner_s` (the learner host's own CPU work in a push and its reply) moved out of the two
                 transfers (half from each) into the learner's job (`overhead_s` + learner_s / microbatches per
                 call), where a slow host's factor slows it as it slows the compute
    host_s       the profile's, unless `cluster.host_s` is explicit
  """
  c = config.cluster
  host_s = float(c.host_s)
  if not c.profile:
    return Effective(config.stragglers, make_network(config.network), host_s, '')
  profile = profiles.load(c.profile)
  explicit = set(c.explicit)
  compute = profile.compute_for(profiles.model_key(config))
  stragglers = config.stragglers
  network = make_network(config.network) if any(f.startswith('network.') for f in explicit) else profile.network
  learner = 0.0  # seconds per job of the learner host's own work in its push and reply (Ray's), charged as compute
  if network is profile.network and profile.ray_p2p is not None and config.get('runtime') == 'ray':
    learner = profile.ray_learner_s
    link = profile.ray_p2p
    network = dataclasses.replace(network, p2p_link=dataclasses.replace(link, latency_s=link.latency_s - learner / 2))
  overhead = float(stragglers.overhead_s) if 'stragglers.overhead_s' in explicit else compute.overhead_s
  overhead += learner / config.microbatches  # a job is `microbatches` calls: `learner` once per job
  samples = config.batch_size / config.microbatches
  if explicit.isdisjoint(profiles.COMPUTE_FIELDS) and stragglers.kind != 'trace':
    stragglers = calibration.calibrated(stragglers, overhead + samples * compute.per_sample_s, overhead_s=overhead)
  else:
    stragglers = ml_collections.ConfigDict(stragglers.to_dict())
    stragglers.overhead_s = overhead
  return Effective(stragglers, network, host_s if 'cluster.host_s' in explicit else profile.host_s, profile.name)


def make_clock(config: ml_collections.ConfigDict, rule: rules_base.TimeRule, model_bytes: float,
               cost: Optional[Effective] = None) -> clock_lib.Clock:
  """The seeded clock for `config`, driving `rule` (`cluster.registry.time_rule(config)`), charging `cost`.

  `cost`: the cost model `validate(config)` returned (None: `effective(config)`, which reads the profile again).

  A worker that fails for good is simulated as it happens: a rule that can go on without it does; one that
  waits for it raises `clock.StalledError` at the first iteration that needs it, naming the worker, when it
  failed and when the run got stuck (the training loop stops there with one line, never hangs).
  """
  rules_base.check_rule(rule)
  p = config.workers
  cost = effective(config) if cost is None else cost
  delay, failure = make_faults(cost.stragglers, p, config.seed)
  return clock_lib.Clock(
      workers=p, rule=rule, compute=make_compute(cost.stragglers, p), network=cost.network,
      model_bytes=model_bytes, seed=config.seed, delay=delay, failure=failure, host_s=cost.host_s,
      host_factors=slow_factors(cost.stragglers, p) if config.cluster.get('slow_hosts', False) else None)
