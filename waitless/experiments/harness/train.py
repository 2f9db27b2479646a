"""Training entry points: `train_and_evaluate(config, workdir)` trains one run, `train_group` several runs as the
replicas of one program (`replicas.py`), each resuming from its checkpoints.

    runs   = setup.build_group(configs)        validated configs, data, model, the algorithm's transformation
    state  = setup.init_state(runs)            every worker's parameters and algorithm state
    step   = restore(...)                      the newest checkpoint every run has, or 0
    loop.Loop(runs, ...).run(state, step)      block by block until every run finished (`loop.py`)

Each run writes what `recorder.RunRecorder` writes (metrics, checkpoints, summary) in its own workdir. With
`stragglers.kind='measured'` nothing is simulated (`measured_time.py`): the clock is a `MeasuredClock` and the
rows and summary hold `measured_time` instead of `sim_time`.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np

from waitless import config_errors as errors
from waitless.experiments.harness import atomic_files
from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import checkpointing
from waitless.experiments.harness import loop as loop_lib
from waitless.experiments.harness import measure
from waitless.experiments.harness import preemption
from waitless.experiments.harness import recorder as recorder_lib
from waitless.experiments.harness import setup
from waitless.experiments.harness import slowdown
from waitless.experiments.harness import workdir as workdir_lib
from waitless.experiments.harness import workdir_lock

log = logging.getLogger('waitless')


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_requests: preemption.StopRequests | None = None, loss_hook=None) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns the summary.

  Writes metrics.jsonl, summary.json, config.json, TensorBoard events and orbax checkpoints in `workdir`.

  Raises:
    recorder.TrainingDiverged, recorder.ClusterStalled: the run stopped there (its metrics up to then and its last
      good checkpoint are kept).
    preemption.Preempted: SIGTERM or SIGINT (or `stop_requests.request()`) arrived; the run finished its
      block and checkpointed, and the same call resumes it.
  """
  outcome, = train_group([config], [workdir], stop_requests, loss_hook)
  if isinstance(outcome, Exception):
    raise outcome
  return outcome


def train_group(configs: Sequence[ml_collections.ConfigDict], workdirs: Sequence[str],
                stop_requests: preemption.StopRequests | None = None, loss_hook=None,
                built: Sequence[setup.Run | None] | None = None) -> list[Any]:
  """Trains the runs of `configs` in `workdirs` as the replicas of one program, resuming from their checkpoints.

  The configs must be able to share a program (`replicas.partition`): the same workload, algorithm and cadence,
  differing only in seed, budget (`num_steps`) and scalar hyper-parameters. Each replica writes in its workdir
  what a run alone writes, at the same steps as the others; its trajectory is the one it has alone (float64: to
  rounding; float32: XLA may round the batched program differently). A replica that has spent its budget, or
  that diverged or stalled, is frozen (it computes what is never read) while the others go on. A run whose
  workdir holds its summary.json finished: it is returned as it is, not trained again.

  `loss_hook`: TEST-ONLY, applied to every micro-batch's loss (`slowdown.loss_hook`).
  `built`: per config, its run built already (`setup.PlannedGroup.built`) or None (`setup.build_group`).

  Returns:
    Per run, its summary dict, or the `recorder.TrainingDiverged` / `recorder.ClusterStalled` it stopped with.

  Raises:
    preemption.Preempted: SIGTERM or SIGINT (or `stop_requests.request()`) arrived; every unfinished replica
      finished its block and checkpointed, and the same call resumes them.
  """
  for config in configs:  # the Ray runtime has its own driver (`ray_runtime.driver`); this loop is lock-step
    errors.require(config.get('runtime', 'spmd') != 'ray', 'runtime', config.get('runtime'),
                   'runs through experiments.main (ray_runtime.driver.train_and_evaluate), not the lock-step loop')
  finished = [atomic_files.read_json(os.path.join(w, recorder_lib.SUMMARY_FILE)) for w in workdirs]
  if any(s is not None for s in finished):  # as they finished: a rerun must not train them again, nor rewrite them
    for config, workdir, summary in zip(configs, workdirs, finished):
      if summary is not None:
        workdir_lib.check_workdir(workdir, config)  # the same run, not one of another config
    pending = [i for i, s in enumerate(finished) if s is None]
    outcomes = train_group([configs[i] for i in pending], [workdirs[i] for i in pending], stop_requests,
                           loss_hook, [built[i] for i in pending] if built else None) if pending else []
    for i, outcome in zip(pending, outcomes):
      finished[i] = outcome
    return finished
  group = setup.build_group(configs, built)
  if loss_hook is not None:
    for run in group.runs:
      run.task = slowdown.slowed_task(run.task, loss_hook)
  state_bytes = setup.state_bytes_of(group.lead)  # shapes only (one trace of the init): nothing allocated yet
  for config, workdir in zip(configs, workdirs):
    workdir_lib.check_workdir(workdir, config)  # on every process, so that a conflict stops all of them
  checkpointing.check_writable(workdirs, checkpoint_bytes=state_bytes / jax.process_count())
  # One program per workdir at a time (process 0 holds the locks): a second would train the same runs again.
  locks = []
  try:
    locks.extend(workdir_lock.WorkdirLock(workdir) for workdir in (workdirs if jax.process_index() == 0 else ()))
    return _train_locked(group, configs, workdirs, state_bytes, stop_requests)
  finally:
    for lock in locks:
      lock.release()


def _train_locked(group, configs, workdirs, state_bytes, stop_requests) -> list[Any]:
  """`train_group` once its workdirs are checked and locked."""
  setup.check_memory(group, state_bytes)
  if jax.process_index() == 0:
    for config, workdir in zip(configs, workdirs):
      recorder_lib.write_config(workdir, config)  # as given (num_epochs unresolved)
  run = group.lead
  state = setup.init_state(group)
  num_params, model_bytes = setup.param_count_and_bytes(state.params)
  num_params, model_bytes = (num_params // (run.config.workers * group.size),
                             model_bytes // (run.config.workers * group.size))
  block_step = block_step_lib.BlockStep(group)
  if run.config.stragglers.calibrate:  # a calibrated run never shares its program (replicas.program_key)
    setup.set_stragglers(run, measure.calibrated_stragglers(run, block_step, state, model_bytes, workdirs[0]))
  replicas = [loop_lib.Replica.start(r, setup.clock_for(r, model_bytes), workdir)
              for r, workdir in zip(group.runs, workdirs)]
  try:
    state, step = _restore(group, replicas, state)
    for r in replicas:
      r.recorder.open(resumed_step=step)
    loop_lib.Loop(group, replicas, block_step, num_params).run(state, step, stop_requests)
  finally:
    for r in replicas:
      r.recorder.close()
  return [r.recorder.summary if r.recorder.failure is None else r.recorder.failure for r in replicas]


def _restore(group: setup.Group, replicas: list[loop_lib.Replica], state):
  """Every replica as it was at the newest checkpoint step they all have: the group's state and that step, or
  (state, 0) if none (`recorder.restore_common_step`)."""
  like = setup.replica_state(group, state, 0) if group.batched else state
  found = recorder_lib.restore_common_step([r.recorder for r in replicas], like)
  if found is None:
    return state, 0
  step, restored = found
  for r, (_, meta) in zip(replicas, restored):
    r.recorder.restore(step, meta)
    r.positions = np.asarray(meta['positions'], np.int64)
    r.clock.load_state_dict(meta['clock'])
  return setup.stack_replicas(group, [s for s, _ in restored]), step
