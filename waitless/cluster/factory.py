"""Builds the clock for a config: compute model from `config.stragglers`, network from `config.network`, the
host's time per iteration from `config.cluster`, all three through a cluster profile when `cluster.profile`
names one (`effective`; `cluster/profiles.py` says how a profile and explicit fields combine).

`validate(config)` checks every `stragglers.*` / `network.*` / `cluster.*` field (and the profile's file) before
anything compiles and raises `config_errors.ConfigError` naming the field. Configs written before a field existed
still work: a missing field takes its default from `default_stragglers_config()` / `default_network_config()` /
`default_cluster_config()`.
"""

from __future__ import annotations

import dataclasses

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
NETWORK_KINDS = ('ideal', 'alpha_beta')


def default_stragglers_config() -> ml_collections.ConfigDict:
  """`config.stragglers`: the compute-time model of one micro-batch (seconds)."""
  c = ml_collections.ConfigDict()
  c.kind = 'constant'     # one of STRAGGLER_KINDS; 'measured': real time, nothing simulated (measured_time.py)
  c.base_s = 0.01         # constant / lognormal (median) / slow_workers / random_delay: seconds per micro-batch
  c.calibrate = False     # replace the scale of the distribution by a measured step (cluster/calibration.py)
  # Per-call overhead (any kind): every micro-batch, one accelerator call, costs overhead_s on top of the
  # distribution, which is then the per-sample part of one micro-batch (batch_size / microbatches samples).
  # Splitting a batch into m micro-batches pays m overheads; calls merged by a rule (LAP-SGD's Q threads on one
  # accelerator) pay one. Slow-worker factors scale it. 0: time does not depend on how a batch is split.
  c.overhead_s = 0.0
  c.rate = 100.0          # exponential / shifted_exponential: 1/mean of the exponential part (1/s)
  c.shift_s = 0.005       # shifted_exponential: minimum time
  c.shape = 2.0           # pareto: tail index alpha (mean finite for > 1)
  c.scale = 0.005         # pareto: minimum time x_m (mean scale * shape / (shape - 1))
  c.sigma = 0.5           # lognormal: std of log time
  c.trace_path = ''       # trace: .npy or .csv table (units, workers) of seconds, replayed by position
  # Persistent heterogeneity (any kind): the first round(slow_fraction * P) workers, or the listed ones,
  # are slower by slow_factor.
  c.slow_fraction = 0.0
  c.slow_workers = ()     # worker ids; takes the place of slow_fraction (set one of the two)
  c.slow_factor = 2.0
  # Arbitrary persistent heterogeneity (any kind): worker i's compute times multiplied by worker_factors[i], a
  # tuple of P numbers > 0 (e.g. sqrt(i + 1), the Ringmaster paper's kind of fixed heterogeneity; mnist1d.py's
  # `stragglers=sqrt` preset). () = none; when set it takes the place of slow_fraction / slow_workers /
  # slow_factor (setting it together with slow_fraction or slow_workers is refused).
  c.worker_factors = ()
  # Transient delays (any kind): at each job (iteration) index, `delayed_workers` random workers get +delay_s
  # (WAGMA paper: 2 of 64 workers, 0.32 s).
  c.delayed_workers = 0
  c.delay_s = 0.0
  # The same delay in calls instead of seconds: delay_calls x the mean time of one micro-batch call of the
  # compute model the clock charges (its distribution plus overhead_s, before slow factors; a cluster profile's
  # when the run names one), so that "three calls late" means the same on every cluster. Set delay_s or
  # delay_calls, not both.
  c.delay_calls = 0.0
  # Failure (any kind): worker `fail_worker` (-1: none; from Python also a tuple of ids) is down from
  # fail_at_s until return_at_s (< 0: never returns). A rule that waits for every worker stops the run when it
  # needs a worker that never returns (one line, the simulated time). Typed defaults (not None) so that
  # `--config.stragglers.fail_worker=3` works.
  c.fail_worker = -1
  c.fail_at_s = 0.0
  c.return_at_s = -1.0
  return c


def default_network_config() -> ml_collections.ConfigDict:
  """`config.network`: the cost of collectives."""
  c = ml_collections.ConfigDict()
  c.kind = 'ideal'            # ideal | alpha_beta
  c.latency_s = 5e-6          # alpha_beta: alpha, seconds per message
  c.bandwidth_gbps = 10.0     # alpha_beta: beta, gigabits per second
  return c


def default_cluster_config() -> ml_collections.ConfigDict:
  """`config.cluster`: the named cluster the clock is tied to, and the host's time per iteration."""
  c = ml_collections.ConfigDict()
  # '': no profile, the configured stragglers.* and network.* (the ideal network by default: tests, closed
  # forms); a shipped name (cluster.profiles.names()) or the path of a profile JSON (experiments.calibrate).
  c.profile = ''
  c.host_s = 0.0     # seconds of serial host work per iteration, added to every iteration by the clock
  # The fields the user set (flags, the config argument's pairs) that win over the profile's values; the
  # programs fill it (experiments.configs.common.mark_explicit), a config file may too.
  c.explicit = ()
  return c


_STRAGGLER_DEFAULTS = default_stragglers_config()
_NETWORK_DEFAULTS = default_network_config()
_CLUSTER_DEFAULTS = default_cluster_config()
# The config fields a profile gives values to: an explicit one of them wins over the profile.
COMPUTE_FIELDS = ('stragglers.base_s', 'stragglers.rate', 'stragglers.shift_s', 'stragglers.scale')
PROFILE_FIELDS = COMPUTE_FIELDS + ('stragglers.overhead_s', 'network.kind', 'network.latency_s',
                                   'network.bandwidth_gbps', 'cluster.host_s')


def _get(section: ml_collections.ConfigDict, name: str, defaults: ml_collections.ConfigDict):
  return section.get(name, defaults[name])


def _is_number(value) -> bool:
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _worker_list(value) -> tuple:
  if value is None or (_is_int(value) and value == -1):  # -1: nobody
    return ()
  return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _return_time(value):
  """`return_at_s` as a time, or None for never (None or a negative number)."""
  return None if value is None or (_is_number(value) and value < 0) else value


def _require_workers(value, field: str, workers: int) -> tuple[int, ...]:
  ids = _worker_list(value)
  ok = all(_is_int(w) and 0 <= w < workers for w in ids) and len(set(ids)) == len(ids)
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
  ok = all(_is_number(f) and bool(np.isfinite(f)) and f > 0 for f in factors)
  errors.require(ok, field, value, 'every factor must be a finite number > 0')
  return tuple(float(f) for f in factors)


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises config_errors.ConfigError for a bad `stragglers.*` or `network.*` field."""
  s, p = config.stragglers, config.workers
  get = lambda name: _get(s, name, _STRAGGLER_DEFAULTS)
  kind = get('kind')
  errors.require(kind in STRAGGLER_KINDS, 'stragglers.kind', kind, f'known: {", ".join(STRAGGLER_KINDS)}')
  errors.require_number(get('base_s'), 'stragglers.base_s', f'must be a number > 0 and <= {MAX_SECONDS:g} (seconds)',
                        lambda v: 0 < v <= MAX_SECONDS)
  errors.require(isinstance(get('calibrate'), bool), 'stragglers.calibrate', get('calibrate'), 'must be a bool')
  errors.require_number(get('overhead_s'), 'stragglers.overhead_s',
                        f'must be a number >= 0 and <= {MAX_SECONDS:g} (seconds per call)',
                        lambda v: 0 <= v <= MAX_SECONDS)
  # Every parameter is checked, also those the chosen kind does not read: a typo is caught either way.
  errors.require_number(get('rate'), 'stragglers.rate', 'must be a number > 0 (1/seconds)', lambda v: v > 0)
  errors.require_number(get('shift_s'), 'stragglers.shift_s', f'must be a number >= 0 and <= {MAX_SECONDS:g} (seconds)',
                        lambda v: 0 <= v <= MAX_SECONDS)
  errors.require_number(get('shape'), 'stragglers.shape', 'must be a number > 0', lambda v: v > 0)
  errors.require_number(get('scale'), 'stragglers.scale', f'must be a number > 0 and <= {MAX_SECONDS:g} (seconds)',
                        lambda v: 0 < v <= MAX_SECONDS)
  errors.require_number(get('sigma'), 'stragglers.sigma', 'must be a number >= 0', lambda v: v >= 0)
  if kind == 'trace':
    compute_lib.load_trace(get('trace_path'), p)
  else:
    errors.require(get('trace_path') in ('', None), 'stragglers.trace_path', get('trace_path'),
                   f"is read only with kind=trace (kind={kind!r}); leave it empty")

  errors.require_number(get('slow_fraction'), 'stragglers.slow_fraction', 'must be a fraction in [0, 1]',
                        lambda v: 0 <= v <= 1)
  errors.require_number(get('slow_factor'), 'stragglers.slow_factor', 'must be a number > 0', lambda v: v > 0)
  slow = _require_workers(get('slow_workers'), 'stragglers.slow_workers', p)
  errors.require(not (slow and get('slow_fraction') > 0), 'stragglers.slow_workers', get('slow_workers'),
                 'set either slow_workers or slow_fraction, not both')
  factors = _require_factors(get('worker_factors'), p)
  errors.require(not (factors and (slow or get('slow_fraction') > 0)), 'stragglers.worker_factors',
                 get('worker_factors'), 'set either worker_factors or slow_fraction / slow_workers, not both')
  if kind == 'slow_workers':
    errors.require(bool(slow) or get('slow_fraction') > 0 or bool(factors), 'stragglers.slow_fraction',
                   get('slow_fraction'), 'kind=slow_workers needs slow_fraction > 0, a slow_workers list or '
                   'worker_factors')

  delayed = get('delayed_workers')
  errors.require(_is_int(delayed) and 0 <= delayed <= p, 'stragglers.delayed_workers', delayed,
                 f'must be an integer in 0..{p} (workers)')
  errors.require_number(get('delay_s'), 'stragglers.delay_s', f'must be a number >= 0 and <= {MAX_SECONDS:g} (seconds)',
                        lambda v: 0 <= v <= MAX_SECONDS)
  errors.require_number(get('delay_calls'), 'stragglers.delay_calls',
                        f'must be a number >= 0 and <= {MAX_SECONDS:g} (micro-batch calls)',
                        lambda v: 0 <= v <= MAX_SECONDS)
  errors.require(not (get('delay_s') > 0 and get('delay_calls') > 0), 'stragglers.delay_calls', get('delay_calls'),
                 f'and stragglers.delay_s={get("delay_s")!r} both set the delay: set one of them')
  if kind == 'random_delay':
    errors.require(delayed >= 1, 'stragglers.delayed_workers', delayed, 'kind=random_delay needs >= 1')
    errors.require(get('delay_s') > 0 or get('delay_calls') > 0, 'stragglers.delay_s', get('delay_s'),
                   'kind=random_delay needs > 0 (or stragglers.delay_calls > 0)')

  failed = _require_workers(get('fail_worker'), 'stragglers.fail_worker', p)
  errors.require_number(get('fail_at_s'), 'stragglers.fail_at_s', 'must be a number >= 0', lambda v: v >= 0)
  back = get('return_at_s')
  errors.require(back is None or (_is_number(back) and bool(np.isfinite(back))), 'stragglers.return_at_s', back,
                 'must be a time > fail_at_s, or -1 (never returns)')
  if failed and _return_time(back) is not None:
    errors.require_number(back, 'stragglers.return_at_s', 'must be a time > fail_at_s, or -1 (never returns)',
                          lambda v: v > get('fail_at_s'))

  if kind == MEASURED:  # nothing is simulated: a modifier of the simulated compute times would be ignored
    for name in ('calibrate', 'overhead_s', 'slow_fraction', 'slow_workers', 'worker_factors', 'delayed_workers',
                 'delay_s', 'delay_calls', 'fail_worker'):
      value = get(name)
      unset = not _worker_list(value) if name in ('slow_workers', 'fail_worker', 'worker_factors') else (
          value == _STRAGGLER_DEFAULTS[name])
      errors.require(unset, f'stragglers.{name}', value,
                     f'modifies simulated compute times; with stragglers.kind={MEASURED!r} the devices are real '
                     f'and nothing is simulated: leave it unset')
    errors.require(_get(config.network, 'kind', _NETWORK_DEFAULTS) == 'ideal', 'network.kind',
                   _get(config.network, 'kind', _NETWORK_DEFAULTS),
                   f"must be 'ideal' with stragglers.kind={MEASURED!r}: the network is the real one, not simulated")

  n = config.network
  net_kind = _get(n, 'kind', _NETWORK_DEFAULTS)
  errors.require(net_kind in NETWORK_KINDS, 'network.kind', net_kind, f'known: {", ".join(NETWORK_KINDS)}')
  errors.require_number(_get(n, 'latency_s', _NETWORK_DEFAULTS), 'network.latency_s', 'must be a number >= 0',
                        lambda v: v >= 0)
  errors.require_number(_get(n, 'bandwidth_gbps', _NETWORK_DEFAULTS), 'network.bandwidth_gbps',
                        'must be a number > 0', lambda v: v > 0)
  _validate_cluster(config, kind)


def _cluster(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  return config.get('cluster') or _CLUSTER_DEFAULTS


def _validate_cluster(config: ml_collections.ConfigDict, kind: str) -> None:
  c = _cluster(config)
  get = lambda name: _get(c, name, _CLUSTER_DEFAULTS)
  errors.require_number(get('host_s'), 'cluster.host_s', 'must be a number >= 0 (seconds per iteration)',
                        lambda v: v >= 0)
  explicit = get('explicit')
  errors.require(isinstance(explicit, (list, tuple)) and all(f in PROFILE_FIELDS for f in explicit),
                 'cluster.explicit', explicit, f'must be a tuple of fields among {", ".join(PROFILE_FIELDS)}')
  profile = get('profile')
  if profile in ('', None):
    return
  errors.require(kind != MEASURED, 'cluster.profile', profile,
                 f'a run with stragglers.kind={MEASURED!r} is timed on its real devices; leave the profile empty')
  errors.require(not _get(config.stragglers, 'calibrate', _STRAGGLER_DEFAULTS), 'stragglers.calibrate', True,
                 'measures this machine\'s step; with cluster.profile the profile gives the compute: set one of them')
  effective(config)  # the file, its fields, and a compute entry for this config's model


def slow_factors(stragglers: ml_collections.ConfigDict, workers: int) -> np.ndarray:
  """float64 (P,): per-worker multiplier of compute times (1 for normal workers).

  `worker_factors` when set (validated: P finite numbers > 0); else `slow_factor` for the slow workers
  (`slow_workers`, or the first round(slow_fraction P)) and 1 for the others.
  """
  get = lambda name: _get(stragglers, name, _STRAGGLER_DEFAULTS)
  if len(get('worker_factors')):
    return np.asarray(get('worker_factors'), np.float64).reshape(workers)
  slow = list(_worker_list(get('slow_workers')))
  if not slow and get('slow_fraction') > 0:
    slow = list(range(int(round(get('slow_fraction') * workers))))
  factors = np.ones(workers, np.float64)
  factors[slow] = get('slow_factor')
  return factors


def make_compute(stragglers: ml_collections.ConfigDict, workers: int) -> compute_lib.ComputeModel:
  """The per-micro-batch compute model: (overhead + distribution) x per-worker slow factors.

  The overhead is wrapped only when > 0, so a config without it builds the model it always built.
  """
  get = lambda name: _get(stragglers, name, _STRAGGLER_DEFAULTS)
  kind = get('kind')
  if kind in ('constant', 'slow_workers', 'random_delay', MEASURED):
    model = compute_lib.Constant(base_s=float(get('base_s')))
  elif kind == 'exponential':
    model = compute_lib.Exponential(rate=float(get('rate')))
  elif kind == 'shifted_exponential':
    model = compute_lib.ShiftedExponential(shift_s=float(get('shift_s')), rate=float(get('rate')))
  elif kind == 'pareto':
    model = compute_lib.Pareto(shape=float(get('shape')), scale=float(get('scale')))
  elif kind == 'lognormal':
    model = compute_lib.Lognormal(base_s=float(get('base_s')), sigma=float(get('sigma')))
  elif kind == 'trace':
    model = compute_lib.Trace(times=compute_lib.load_trace(get('trace_path'), workers))
  else:
    raise errors.ConfigError('stragglers.kind', kind, f'known: {", ".join(STRAGGLER_KINDS)}')
  if get('overhead_s') > 0:
    model = compute_lib.CallOverhead(base=model, overhead_s=float(get('overhead_s')))
  factors = slow_factors(stragglers, workers)
  if np.any(factors != 1.0):
    model = compute_lib.SlowWorkers(base=model, factors=factors)
  return model


def make_network(network: ml_collections.ConfigDict) -> network_lib.Network:
  kind = _get(network, 'kind', _NETWORK_DEFAULTS)
  if kind == 'ideal':
    return network_lib.Ideal()
  if kind == 'alpha_beta':
    return network_lib.AlphaBeta(latency_s=float(_get(network, 'latency_s', _NETWORK_DEFAULTS)),
                                 bandwidth_gbps=float(_get(network, 'bandwidth_gbps', _NETWORK_DEFAULTS)))
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
  get = lambda name: _get(stragglers, name, _STRAGGLER_DEFAULTS)
  if not get('delay_calls') > 0:
    return float(get('delay_s'))
  return round(float(get('delay_calls')) * mean_call_s(stragglers, workers), 12)


def make_faults(stragglers: ml_collections.ConfigDict, workers: int, seed: int):
  """(RandomDelay or None, Failure or None) from the modifiers of `stragglers` (the effective ones, with a
  profile's compute, when the delay is given in calls)."""
  get = lambda name: _get(stragglers, name, _STRAGGLER_DEFAULTS)
  delay = None
  delay_s = delay_seconds(stragglers, workers) if get('delayed_workers') > 0 else 0.0
  if delay_s > 0:
    delay = faults.RandomDelay(count=int(get('delayed_workers')), delay_s=delay_s, workers=workers, seed=seed)
  failure = None
  failed = _worker_list(get('fail_worker'))
  if failed:
    back = _return_time(get('return_at_s'))
    failure = faults.Failure(failed=tuple(int(w) for w in failed), fail_at_s=float(get('fail_at_s')),
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
                 (COMPUTE_FIELDS) keeps the configured distribution, and takes only o
    network      the profile's `network.Collectives`, unless a `network.*` field is explicit
    host_s       the profile's, unless `cluster.host_s` is explicit
  """
  c = _cluster(config)
  host_s = float(_get(c, 'host_s', _CLUSTER_DEFAULTS))
  name = _get(c, 'profile', _CLUSTER_DEFAULTS)
  if not name:
    return Effective(config.stragglers, make_network(config.network), host_s, '')
  profile = profiles.load(name)
  explicit = set(_get(c, 'explicit', _CLUSTER_DEFAULTS))
  compute = profile.compute_for(profiles.model_key(config))
  stragglers = config.stragglers
  overhead = (float(_get(stragglers, 'overhead_s', _STRAGGLER_DEFAULTS)) if 'stragglers.overhead_s' in explicit
              else compute.overhead_s)
  samples = config.batch_size / config.microbatches
  if explicit.isdisjoint(COMPUTE_FIELDS) and _get(stragglers, 'kind', _STRAGGLER_DEFAULTS) != 'trace':
    stragglers = calibration.calibrated(stragglers, overhead + samples * compute.per_sample_s, overhead_s=overhead)
  else:
    stragglers = ml_collections.ConfigDict(stragglers.to_dict())
    stragglers.overhead_s = overhead
  network = (make_network(config.network) if any(f.startswith('network.') for f in explicit)
             else profile.network)
  return Effective(stragglers, network, host_s if 'cluster.host_s' in explicit else profile.host_s, profile.name)


def make_clock(config: ml_collections.ConfigDict, rule: rules_base.TimeRule, model_bytes: float) -> clock_lib.Clock:
  """The seeded clock for `config`, driving `rule` (`cluster.registry.time_rule(config)`).

  A worker that fails for good is simulated as it happens: a rule that can go on without it does; one that
  waits for it raises `clock.StalledError` at the first iteration that needs it, naming the worker, when it
  failed and when the run got stuck (the training loop stops there with one line, never hangs).
  """
  rules_base.check_rule(rule)
  p = config.workers
  cost = effective(config)
  delay, failure = make_faults(cost.stragglers, p, config.seed)
  return clock_lib.Clock(
      workers=p, rule=rule, compute=make_compute(cost.stragglers, p), network=cost.network,
      model_bytes=model_bytes, seed=config.seed, delay=delay, failure=failure, host_s=cost.host_s)
