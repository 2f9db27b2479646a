"""Runs one experiment: `python -m waitless.experiments.main --config=experiments/configs/digits.py:sync --workdir=W`.

Parses the flags and hands the config to `harness/program.py`, which joins the processes of a multi-process run,
calls `train.train_and_evaluate(config, workdir)` (or the Ray runtime's) and turns the outcome into an exit
status. Rerunning with the same workdir resumes from its latest checkpoint. `--seeds=N` (N > 1) trains seeds
config.seed + 0 .. N-1 as the replicas of one compiled program (`experiments/harness/replicas.py`), each in
`WORKDIR/seed<S>` with the files of a run alone.

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

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from waitless.experiments import shared_flags
from waitless.experiments.harness import distributed  # no JAX backend use at import
from waitless.experiments.harness import preemption
from waitless.experiments.harness import program  # the training modules only once the device count is set

flags.adopt_module_key_flags(shared_flags)  # --config, --workdir, --seeds, ... in `--help` too

_MOCK_DATA = flags.DEFINE_bool('mock_data', False, 'Run under tfds.testing.mock_data (dry run, no dataset files).')
_MOCK_EXAMPLES = flags.DEFINE_integer('mock_examples', 64, 'Examples per split under --mock_data.')
# Multi-process runs (experiments/harness/distributed.py); none of these set: one process.
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


def main(argv):
  del argv
  config = shared_flags.CONFIG.value
  from waitless.experiments.configs import arguments
  arguments.apply_flag_rules(config, config_flags.get_override_values(flags.FLAGS['config']))
  options = program.Options(
      workdir=shared_flags.WORKDIR.value, seeds=shared_flags.SEEDS.value, max_replicas=shared_flags.MAX_REPLICAS.value,
      compilation_cache_dir=shared_flags.COMPILATION_CACHE.value, mock_data=_MOCK_DATA.value,
      mock_examples=_MOCK_EXAMPLES.value, coordinator_address=_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
      process_id=_PROCESS_ID.value, auto_join=_DISTRIBUTED.value, heartbeat_timeout_s=_HEARTBEAT.value,
      debug_slow_process=_DEBUG_SLOW.value, debug_delay=_DEBUG_DELAY.value, debug_crash_learner=_DEBUG_CRASH.value,
      ray_address=_RAY_ADDRESS.value)
  if _VALIDATE_ONLY.value:
    program.validate_only(config, options)
  else:
    program.run(config, options)


def run():
  preemption.exit_before_training()  # from here, not after the seconds of imports that main() starts with
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')  # TensorFlow only feeds data here; silences its notice
  app.run(main, flags_parser=shared_flags.parse_flags)


if __name__ == '__main__':
  run()
