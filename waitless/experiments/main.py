"""Runs one experiment: `python -m waitless.experiments.main --config=experiments/configs/digits.py:sync --workdir=W`.

Only parses flags and calls `train.train_and_evaluate(config, workdir)`. Rerunning with the same workdir
resumes from its latest checkpoint. `--seeds=N` (N > 1) trains seeds config.seed + 0 .. N-1 as the replicas of
one compiled program (`experiments/harness/replicas.py`), each in `WORKDIR/seed<S>` with the files of a run alone.

User errors (bad config, missing data, a workdir holding another run) print one line and exit with status 2; a
diverged run exits with status 3, a simulated cluster that cannot go on (the algorithm waits for a worker that
failed for good) with status 4 (with --seeds: once every seed has run, 3 if one diverged, else 4 if one
stalled). SIGTERM or Ctrl-C (SIGINT) finish the current block, checkpoint, and exit with status 75
(`preemption.EXIT_PREEMPTED`) and one line: rerunning the same command resumes; a second signal stops at once
(status 75 after a SIGTERM, 130 after Ctrl-C), and a SIGTERM before training starts exits 75 too.

Real time (`--config=...:nonblocking,stragglers.kind=measured`, experiments/harness/measured_time.py): nothing is
simulated; TEST-ONLY `--debug_slow_process=I:S` makes process I sleep S seconds in every micro-batch it computes
(experiments/harness/slowdown.py), a bad value is one line and status 2.

Compiled programs are kept for later runs in ~/.cache/waitless/jax (at most 2 GiB, least recently used
evicted; $WAITLESS_COMPILATION_CACHE_DIR or `--compilation_cache_dir=DIR` elsewhere, '' for none): a repeated
command skips compilation, with identical results. The flags shared with `experiments.compare` are in
`experiments/shared_flags.py`.

Multi-process (multi-host) runs: every process runs the same command plus `--coordinator_address`,
`--num_processes` and `--process_id` (or `--distributed` where JAX detects them: SLURM, Cloud TPU pods); see
experiments/harness/distributed.py and launch/multiprocess_cpu.sh, launch/slurm.sh, launch/tpu_pod.sh.
"""

from __future__ import annotations

import json
import logging as std_logging
import os
import sys

from absl import app
from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from waitless.experiments import shared_flags
from waitless.experiments.harness import compilation_cache  # no JAX import at module level
from waitless.experiments.harness import distributed  # no JAX backend use at import
from waitless.experiments.harness import slowdown  # no JAX import at module level

flags.adopt_module_key_flags(shared_flags)  # --config, --workdir, --seeds, ... in `--help` too

_MOCK_DATA = flags.DEFINE_bool('mock_data', False, 'Run under tfds.testing.mock_data (dry run, no dataset files).')
_MOCK_EXAMPLES = flags.DEFINE_integer('mock_examples', 64, 'Examples per split under --mock_data.')
# Multi-process runs (experiments/harness/distributed.py); none of these set: one process, as before.
_COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'HOST:PORT of process 0 in a multi-process run '
                                   '(default $JAX_COORDINATOR_ADDRESS).')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in the run (default $JAX_NUM_PROCESSES).')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, 0..num_processes-1 (default $JAX_PROCESS_ID).')
_DISTRIBUTED = flags.DEFINE_bool('distributed', False, 'Join a multi-process run whose settings JAX detects '
                                 '(SLURM, Open MPI, Cloud TPU pod).')
_HEARTBEAT = flags.DEFINE_integer('heartbeat_timeout_s', distributed.DEFAULT_HEARTBEAT_TIMEOUT_S,
                                  'Multi-process: seconds without a heartbeat after which a process counts as '
                                  'dead and the run stops; also the longest a checkpoint save (its write and its '
                                  'barrier) may take.')
_VALIDATE_ONLY = flags.DEFINE_bool(
    'validate_only', False, 'Check the config and the flags (a bad one: one line, status 2) and exit without '
    'training; launch/multiprocess_cpu.sh runs this once before it starts its processes.')
_DEBUG_SLOW = flags.DEFINE_string(
    'debug_slow_process', '', 'TEST-ONLY: "I:S", process I sleeps S seconds in every micro-batch it computes (a '
    'slower device, harness/slowdown.py; for testing stragglers.kind=measured on one machine; with runtime=ray, '
    'learner I). "" for none.')
_DEBUG_DELAY = flags.DEFINE_string(
    'debug_delay', '', 'TEST-ONLY, runtime=ray: "K:S", at each job index K learners drawn at random sleep S seconds '
    'once (transient delays, harness/ray_runtime/worker.py). "" for none.')
_DEBUG_CRASH = flags.DEFINE_string(
    'debug_crash_learner', '', 'TEST-ONLY, runtime=ray: "I:T", learner I\'s process exits once it holds a model of '
    'version >= T, in its first life (Ray restarts it; harness/ray_runtime/worker.py). "" for none.')
_RAY_ADDRESS = flags.DEFINE_string(
    'ray_address', None, 'runtime=ray: HOST:PORT of a running Ray cluster\'s head (`ray start --head`), or "auto"; '
    'unset: a local Ray starts and stops with the run.')


def _train_on_ray(config, workdir, stop_requests):
  """A `runtime=ray` run (`ray_runtime.driver`), or with --seeds=N > 1 its N seeds one after another, each in
  `WORKDIR/seed<S>` ({workdir: summary or the failure it stopped with})."""
  from waitless.experiments.harness import loop as loop_lib
  from waitless.experiments.harness.ray_runtime import driver
  from waitless.experiments.harness.ray_runtime import worker
  hooks = worker.DebugHooks(*slowdown.parse_slow(_DEBUG_SLOW.value, config.workers),
                            *slowdown.parse_delay(_DEBUG_DELAY.value, config.workers),
                            *slowdown.parse_crash(_DEBUG_CRASH.value, config.workers))
  train = lambda c, w: driver.train_and_evaluate(c, w, stop_requests, _RAY_ADDRESS.value, hooks)
  if shared_flags.SEEDS.value == 1:
    return train(config, workdir)
  outcomes = {}
  for i in range(shared_flags.SEEDS.value):
    seeded = config.copy_and_resolve_references()
    seeded.seed = config.seed + i
    seed_dir = os.path.join(workdir, f'seed{seeded.seed}')
    try:
      outcomes[seed_dir] = train(seeded, seed_dir)
    except (loop_lib.TrainingDiverged, loop_lib.ClusterStalled) as e:
      outcomes[seed_dir] = e
  return outcomes


def _train(config, workdir, stop_requests, loss_hook=None):
  """One run (`train_and_evaluate`: its summary; a failure is raised), or with --seeds=N > 1 the N seeds' runs as
  replicas (`setup.plan_groups`, then `train.train_group`: {workdir: summary or the failure it stopped with})."""
  from waitless.experiments.harness import validation
  validation.check_seeds(config.seed, shared_flags.SEEDS.value)
  if config.get('runtime') == 'ray':
    return _train_on_ray(config, workdir, stop_requests)
  from waitless.experiments.harness import setup  # imported after XLA_FLAGS is set
  from waitless.experiments.harness import train
  if shared_flags.SEEDS.value == 1:
    return train.train_and_evaluate(config, workdir, stop_requests, loss_hook)
  configs = []
  for i in range(shared_flags.SEEDS.value):
    seeded = config.copy_and_resolve_references()
    seeded.seed = config.seed + i
    configs.append(seeded)
  workdirs = [os.path.join(workdir, f'seed{c.seed}') for c in configs]
  outcomes = {}
  for group in setup.plan_groups(configs, workdirs, shared_flags.MAX_REPLICAS.value):
    results = train.train_group([configs[i] for i in group.indices], [workdirs[i] for i in group.indices],
                                stop_requests, loss_hook, group.built)
    outcomes.update({workdirs[i]: result for i, result in zip(group.indices, results)})
  return {w: outcomes[w] for w in workdirs}


def _run(config, workdir, stop_requests, loss_hook=None):
  if not _MOCK_DATA.value:
    return _train(config, workdir, stop_requests, loss_hook)
  import tensorflow_datasets as tfds
  # tfds's mock generator reads the deprecated `TensorInfo.dtype` itself, a warning per feature per split: not
  # this run's business, and it buried the run's own lines. Only that message is dropped.
  deprecated = lambda record: '`TensorInfo.dtype` is deprecated' not in record.getMessage()
  absl_logging.get_absl_logger().addFilter(deprecated)
  try:
    with tfds.testing.mock_data(num_examples=_MOCK_EXAMPLES.value):
      return _train(config, workdir, stop_requests, loss_hook)
  finally:
    absl_logging.get_absl_logger().removeFilter(deprecated)


def _report_seeds(outcomes) -> None:
  """Each seed's summary or failure, one line each; exits 3 if one diverged, else 4 if one stalled."""
  from waitless.experiments.harness import loop as loop_lib
  progress = std_logging.getLogger('waitless')
  for workdir, outcome in outcomes.items():
    if isinstance(outcome, Exception):
      print(f'error: {workdir}: {outcome}', file=sys.stderr)
    else:
      progress.info('summary %s: %s', workdir, json.dumps(outcome))
  if any(isinstance(o, loop_lib.TrainingDiverged) for o in outcomes.values()):
    sys.exit(3)
  if any(isinstance(o, loop_lib.ClusterStalled) for o in outcomes.values()):
    sys.exit(4)


def _is_jax_runtime_error(e: BaseException) -> bool:
  import jax
  return isinstance(e, jax.errors.JaxRuntimeError)


def _first_line(e: BaseException) -> str:
  return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def _watch_peers(stop_requests, workdir):
  """Starts the dead-peer watchdog of a multi-process run (half of JAX's heartbeat timeout)."""
  from jax._src import distributed as jax_distributed
  from waitless.experiments.harness import peer_watchdog
  watchdog = peer_watchdog.PeerWatchdog(
      jax_distributed.global_state.client, distributed.process_index(), distributed.process_count(),
      timeout_s=_HEARTBEAT.value / 2, completed_step=lambda: stop_requests.completed_step, workdir=workdir)
  watchdog.start()
  return watchdog


def _validate_only(config) -> None:
  """--validate_only: what every process would check before training, once (exit 2 with one line if bad)."""
  from waitless import config_errors as errors
  from waitless.experiments.harness import validation
  try:
    settings = distributed.settings_from(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                                         auto=_DISTRIBUTED.value, heartbeat_timeout_s=_HEARTBEAT.value)
    processes = settings.num_processes if settings and settings.num_processes else 1
    distributed.host_devices_per_process(config.devices, processes)
    slowdown.parse_slow(_DEBUG_SLOW.value, processes)
    validation.validate(config)
    validation.check_seeds(config.seed, shared_flags.SEEDS.value)
  except errors.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


def _join_processes(config) -> int:
  """Joins a multi-process run if flags or the environment ask for one; sets this process's CPU devices.

  Returns the number of processes (1 without any distributed setting).
  """
  from waitless import config_errors as errors
  try:
    settings = distributed.settings_from(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                                         auto=_DISTRIBUTED.value, heartbeat_timeout_s=_HEARTBEAT.value)
    if settings and settings.num_processes:  # a bad split fails before connecting to anyone
      distributed.host_devices_per_process(config.devices, settings.num_processes)
    processes = distributed.initialize(settings)  # before anything starts a JAX backend
    shared_flags.force_host_devices(distributed.host_devices_per_process(config.devices, processes))
  except errors.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  except distributed.JoinError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(1)
  return processes


def main(argv):
  del argv
  config = shared_flags.CONFIG.value
  from waitless.experiments.configs import arguments
  arguments.apply_flag_rules(config, config_flags.get_override_values(flags.FLAGS['config']))
  if _VALIDATE_ONLY.value:
    _validate_only(config)
    return
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every checkpoint file at INFO
  handler = std_logging.StreamHandler(sys.stderr)
  handler.setFormatter(std_logging.Formatter('%(asctime)s %(message)s', '%H:%M:%S'))
  progress = std_logging.getLogger('waitless')
  progress.addHandler(handler)
  progress.setLevel(std_logging.INFO)
  progress.propagate = False
  from waitless import config_errors as errors
  from waitless.experiments.harness import checkpointing
  from waitless.experiments.harness import loop as loop_lib
  from waitless.experiments.harness import preemption
  from waitless.experiments.harness import workdir as workdir_lib
  from waitless.experiments.harness import workdir_lock
  from waitless.experiments.harness.ray_runtime import ray_config  # no JAX import
  preemption.exit_before_training()
  stop_requests, watchdog = preemption.StopRequests(), None
  cache = shared_flags.COMPILATION_CACHE.value
  cache = compilation_cache.user_dir() if cache is None else cache
  if cache:
    compilation_cache.enable(cache)
  on_ray = config.get('runtime') == 'ray'
  processes = 1 if on_ray else _join_processes(config)  # Ray runs join no jax.distributed mesh
  if on_ray:  # the driver evaluates beside the learners: on a GPU they share, it must not take 75% of it
    os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  try:
    if on_ray:
      slowdown.parse_slow(_DEBUG_SLOW.value, config.workers)  # learners, checked before Ray starts
      slowdown.parse_delay(_DEBUG_DELAY.value, config.workers)
      slowdown.parse_crash(_DEBUG_CRASH.value, config.workers)
      loss_hook = None
    else:
      ray_only = {'--debug_delay': _DEBUG_DELAY.value, '--debug_crash_learner': _DEBUG_CRASH.value,
                  '--ray_address': _RAY_ADDRESS.value}
      given = [name for name, value in ray_only.items() if value]
      errors.require(not given, ', '.join(given), ', '.join(ray_only[n] for n in given),
                     'for runtime=ray runs only (add runtime=ray to the config argument)')
      loss_hook = slowdown.loss_hook(*slowdown.parse_slow(_DEBUG_SLOW.value, processes))
  except errors.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  if processes > 1:
    handler.setFormatter(std_logging.Formatter(
        f'%(asctime)s [process {distributed.process_index()}] %(message)s', '%H:%M:%S'))
    watchdog = _watch_peers(stop_requests, shared_flags.WORKDIR.value)
    absl_logging.get_absl_logger().addFilter(checkpointing.background_error_filter)  # reported in one line below
  try:
    summary = _run(config, shared_flags.WORKDIR.value, stop_requests, loss_hook)
  except (errors.ConfigError, workdir_lib.WorkdirConflict, checkpointing.UnusableWorkdir, FileNotFoundError,
          workdir_lock.WorkdirBusy, ray_config.RayUnavailable) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  except loop_lib.TrainingDiverged as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(3)
  except loop_lib.ClusterStalled as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(4)
  except preemption.Preempted as e:
    print(str(e), file=sys.stderr)
    sys.exit(preemption.EXIT_PREEMPTED)
  except KeyboardInterrupt as e:
    print(f'interrupted: rerun the same command to resume from the last checkpoint in {shared_flags.WORKDIR.value}',
          file=sys.stderr)
    sys.exit(preemption.exit_code(e))
  except TimeoutError as e:  # a checkpoint's barrier that a peer never reached (checkpointing.Checkpointer)
    if watchdog is None:
      raise
    watchdog.report(f'a checkpoint barrier timed out after {_HEARTBEAT.value}s ({_first_line(e)}), a peer process '
                    'is stuck')
  except RuntimeError as e:  # jax.errors.JaxRuntimeError: in a multi-process run, a collective lost its peer
    if watchdog is None or not _is_jax_runtime_error(e):
      raise
    watchdog.report(f'a collective failed ({_first_line(e)}), a peer process probably died')
  finally:
    if watchdog is not None:
      watchdog.finish()
  if shared_flags.SEEDS.value > 1:
    _report_seeds(summary)
  else:
    progress.info('summary: %s', json.dumps(summary))


def run():
  from waitless.experiments.harness import preemption  # light: no JAX at import
  preemption.exit_before_training()  # from here, not after the seconds of imports that main() starts with
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')  # TensorFlow only feeds data here; silences its notice
  app.run(main, flags_parser=shared_flags.parse_flags)


if __name__ == '__main__':
  run()
