"""`experiments.main` as a program: one config's run (or its seeds' runs) from the command line to an exit status.

    join the processes of a multi-process run (or none), set the host device count, enable the compilation cache
    train: train.train_and_evaluate (runtime=spmd), ray_runtime.driver.train_and_evaluate (runtime=ray);
           with --seeds=N > 1, the seeds as replicas of one program (spmd) or one after another (ray)
    exit:  0 done; 2 a user error (one line); 3 diverged; 4 stalled; 75 preempted (rerun to resume)

JAX's backend starts only after the device count is set: the harness's training modules are imported inside
`run`, once the processes are joined.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import NamedTuple, Optional

from absl import logging as absl_logging

from waitless import config_errors as errors
from waitless.experiments import shared_flags
from waitless.experiments.harness import compilation_cache
from waitless.experiments.harness import distributed
from waitless.experiments.harness import preemption
from waitless.experiments.harness import slowdown

log = logging.getLogger('waitless')


class Options(NamedTuple):
  """The command line's flags beyond the config (see `experiments/main.py`)."""
  workdir: str
  seeds: int = 1
  max_replicas: Optional[int] = None
  compilation_cache_dir: Optional[str] = None
  mock_data: bool = False
  mock_examples: int = 64
  coordinator_address: Optional[str] = None
  num_processes: Optional[int] = None
  process_id: Optional[int] = None
  auto_join: bool = False  # --distributed: join the processes JAX detects
  heartbeat_timeout_s: int = distributed.DEFAULT_HEARTBEAT_TIMEOUT_S
  debug_slow_process: str = ''
  debug_delay: str = ''
  debug_crash_learner: str = ''
  ray_address: Optional[str] = None


def _settings(options: Options):
  return distributed.settings_from(options.coordinator_address, options.num_processes, options.process_id,
                                   auto=options.auto_join, heartbeat_timeout_s=options.heartbeat_timeout_s)


def _fail(message: str, status: int) -> None:
  print(message, file=sys.stderr)
  sys.exit(status)


def validate_only(config, options: Options) -> None:
  """What every process would check before training, once (exit 2 with one line if bad)."""
  from waitless.experiments.harness import validation
  try:
    settings = _settings(options)
    processes = settings.num_processes if settings and settings.num_processes else 1
    distributed.host_devices_per_process(config.devices, processes)
    slowdown.parse_slow(options.debug_slow_process, processes)
    validation.validate(config)
    validation.check_seeds(config.seed, options.seeds)
  except errors.ConfigError as e:
    _fail(f'error: {e}', 2)


def _join_processes(config, options: Options) -> int:
  """Joins a multi-process run if flags or the environment ask for one; sets this process's CPU devices.
  Returns the number of processes (1 without any distributed setting)."""
  try:
    settings = _settings(options)
    if settings and settings.num_processes:  # a bad split fails before connecting to anyone
      distributed.host_devices_per_process(config.devices, settings.num_processes)
    processes = distributed.initialize(settings)  # before anything starts a JAX backend
    shared_flags.force_host_devices(distributed.host_devices_per_process(config.devices, processes))
  except errors.ConfigError as e:
    _fail(f'error: {e}', 2)
  except distributed.JoinError as e:
    _fail(f'error: {e}', 1)
  return processes


def _seeded(config, seeds: int):
  """The configs of seeds config.seed + 0 .. seeds-1."""
  configs = []
  for i in range(seeds):
    seeded = config.copy_and_resolve_references()
    seeded.seed = config.seed + i
    configs.append(seeded)
  return configs


def _train(config, options: Options, stop_requests, loss_hook):
  """One run's summary (a failure is raised), or with --seeds=N > 1 {seed workdir: summary or failure}."""
  from waitless.experiments.harness import recorder
  from waitless.experiments.harness import setup
  from waitless.experiments.harness import train
  from waitless.experiments.harness import validation
  validation.check_seeds(config.seed, options.seeds)
  on_ray = config.get('runtime') == 'ray'
  if on_ray:
    from waitless.experiments.harness.ray_runtime import driver
    from waitless.experiments.harness.ray_runtime import worker
    hooks = worker.DebugHooks(*slowdown.parse_slow(options.debug_slow_process, config.workers),
                              *slowdown.parse_delay(options.debug_delay, config.workers),
                              *slowdown.parse_crash(options.debug_crash_learner, config.workers))
    alone = lambda c, w: driver.train_and_evaluate(c, w, stop_requests, options.ray_address, hooks)
  else:
    alone = lambda c, w: train.train_and_evaluate(c, w, stop_requests, loss_hook)
  if options.seeds == 1:
    return alone(config, options.workdir)
  configs = _seeded(config, options.seeds)
  workdirs = [os.path.join(options.workdir, f'seed{c.seed}') for c in configs]
  outcomes = {}
  if on_ray:  # Ray runs one after another
    for c, w in zip(configs, workdirs):
      try:
        outcomes[w] = alone(c, w)
      except (recorder.TrainingDiverged, recorder.ClusterStalled) as e:
        outcomes[w] = e
    return outcomes
  for group in setup.plan_groups(configs, workdirs, options.max_replicas):
    results = train.train_group([configs[i] for i in group.indices], [workdirs[i] for i in group.indices],
                                stop_requests, loss_hook, group.built)
    outcomes.update({workdirs[i]: result for i, result in zip(group.indices, results)})
  return {w: outcomes[w] for w in workdirs}


def _train_maybe_mocked(config, options: Options, stop_requests, loss_hook):
  if not options.mock_data:
    return _train(config, options, stop_requests, loss_hook)
  import tensorflow_datasets as tfds
  # tfds's mock generator warns about `TensorInfo.dtype` once per feature and split: not this run's business.
  deprecated = lambda record: '`TensorInfo.dtype` is deprecated' not in record.getMessage()
  absl_logging.get_absl_logger().addFilter(deprecated)
  try:
    with tfds.testing.mock_data(num_examples=options.mock_examples):
      return _train(config, options, stop_requests, loss_hook)
  finally:
    absl_logging.get_absl_logger().removeFilter(deprecated)


def _report_seeds(outcomes) -> None:
  """Each seed's summary or failure, one line each; exits 3 if one diverged, else 4 if one stalled."""
  from waitless.experiments.harness import recorder
  for workdir, outcome in outcomes.items():
    if isinstance(outcome, Exception):
      print(f'error: {workdir}: {outcome}', file=sys.stderr)
    else:
      log.info('summary %s: %s', workdir, json.dumps(outcome))
  if any(isinstance(o, recorder.TrainingDiverged) for o in outcomes.values()):
    sys.exit(3)
  if any(isinstance(o, recorder.ClusterStalled) for o in outcomes.values()):
    sys.exit(4)


def _first_line(e: BaseException) -> str:
  return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def _log_to_stderr() -> logging.Handler:
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every checkpoint file at INFO
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter('%(asctime)s %(message)s', '%H:%M:%S'))
  log.addHandler(handler)
  log.setLevel(logging.INFO)
  log.propagate = False
  return handler


def _watch_peers(stop_requests, options: Options):
  """Starts the dead-peer watchdog of a multi-process run (half of JAX's heartbeat timeout)."""
  from jax._src import distributed as jax_distributed
  from waitless.experiments.harness import peer_watchdog
  watchdog = peer_watchdog.PeerWatchdog(
      jax_distributed.global_state.client, distributed.process_index(), distributed.process_count(),
      timeout_s=options.heartbeat_timeout_s / 2, completed_step=lambda: stop_requests.completed_step,
      workdir=options.workdir)
  watchdog.start()
  return watchdog


def _debug_hook(config, options: Options, processes: int):
  """The TEST-ONLY loss hook of --debug_slow_process (spmd), after checking the flags that only Ray runs take."""
  if config.get('runtime') == 'ray':
    slowdown.parse_slow(options.debug_slow_process, config.workers)  # learners, checked before Ray starts
    slowdown.parse_delay(options.debug_delay, config.workers)
    slowdown.parse_crash(options.debug_crash_learner, config.workers)
    return None
  ray_only = {'--debug_delay': options.debug_delay, '--debug_crash_learner': options.debug_crash_learner,
              '--ray_address': options.ray_address}
  given = [name for name, value in ray_only.items() if value]
  errors.require(not given, ', '.join(given), ', '.join(ray_only[n] for n in given),
                 'for runtime=ray runs only (add runtime=ray to the config argument)')
  return slowdown.loss_hook(*slowdown.parse_slow(options.debug_slow_process, processes))


def run(config, options: Options) -> None:
  """Runs `config` as `experiments.main` does, and exits with its status on a failure (module docstring)."""
  handler = _log_to_stderr()
  preemption.exit_before_training()
  stop_requests, watchdog = preemption.StopRequests(), None
  cache = compilation_cache.user_dir() if options.compilation_cache_dir is None else options.compilation_cache_dir
  if cache:
    compilation_cache.enable(cache)
  on_ray = config.get('runtime') == 'ray'
  processes = 1 if on_ray else _join_processes(config, options)  # Ray runs join no jax.distributed mesh
  if on_ray:  # the driver evaluates beside the learners: on a GPU they share, it must not take 75% of it
    os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  # The training modules import JAX's backend users: after the device count is set.
  from waitless.experiments.harness import checkpointing
  from waitless.experiments.harness import recorder
  from waitless.experiments.harness import workdir as workdir_lib
  from waitless.experiments.harness import workdir_lock
  from waitless.experiments.harness.ray_runtime import ray_config
  try:
    loss_hook = _debug_hook(config, options, processes)
  except errors.ConfigError as e:
    _fail(f'error: {e}', 2)
  if processes > 1:
    handler.setFormatter(logging.Formatter(
        f'%(asctime)s [process {distributed.process_index()}] %(message)s', '%H:%M:%S'))
    watchdog = _watch_peers(stop_requests, options)
    absl_logging.get_absl_logger().addFilter(checkpointing.background_error_filter)  # reported in one line below
  try:
    summary = _train_maybe_mocked(config, options, stop_requests, loss_hook)
  except (errors.ConfigError, workdir_lib.WorkdirConflict, checkpointing.UnusableWorkdir, FileNotFoundError,
          workdir_lock.WorkdirBusy, ray_config.RayUnavailable) as e:
    _fail(f'error: {e}', 2)
  except recorder.TrainingDiverged as e:
    _fail(f'error: {e}', 3)
  except recorder.ClusterStalled as e:
    _fail(f'error: {e}', 4)
  except preemption.Preempted as e:
    _fail(str(e), preemption.EXIT_PREEMPTED)
  except KeyboardInterrupt as e:
    _fail(f'interrupted: rerun the same command to resume from the last checkpoint in {options.workdir}',
          preemption.exit_code(e))
  except TimeoutError as e:  # a checkpoint's barrier that a peer never reached (checkpointing.Checkpointer)
    if watchdog is None:
      raise
    watchdog.report(f'a checkpoint barrier timed out after {options.heartbeat_timeout_s}s ({_first_line(e)}), a '
                    'peer process is stuck')
  except RuntimeError as e:  # jax.errors.JaxRuntimeError: in a multi-process run, a collective lost its peer
    import jax
    if watchdog is None or not isinstance(e, jax.errors.JaxRuntimeError):
      raise
    watchdog.report(f'a collective failed ({_first_line(e)}), a peer process probably died')
  finally:
    if watchdog is not None:
      watchdog.finish()
  if options.seeds > 1:
    _report_seeds(summary)
  else:
    log.info('summary: %s', json.dumps(summary))
