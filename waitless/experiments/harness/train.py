"""Training entry points: `train_and_evaluate(config, workdir)` trains one run, `train_group` several runs as the
replicas of one program (`experiments/harness/replicas.py`), each resuming from its checkpoints.

`train_group` sets the runs up (`setup`), checks and writes their workdirs, restores them, and hands them to the
one training loop (`loop.Loop`). Several runs share the loop and its program when their configs differ only in
their seed, budget and scalar hyper-parameters: R replicas of one compiled block step, each with its own clock,
data positions, budget and workdir (metrics, summary, TensorBoard, checkpoints: the files a run alone writes).
`train_and_evaluate` is a group of one.

With `stragglers.kind='measured'` nothing is simulated (`experiments/harness/measured_time.py`): the clock is a
`MeasuredClock`, `sim_time` and `time_to_target` hold measured training seconds (every row and the summary say
`"clock": "measured"`), and nonblocking's counts come from the devices' measured speeds.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Sequence

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np

from waitless import config_errors as errors
from waitless.cluster import calibration
from waitless.experiments.harness import atomic_files
from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import checkpointing
from waitless.experiments.harness import inputs as inputs_lib
from waitless.experiments.harness import loop as loop_lib
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import preemption
from waitless.experiments.harness import setup
from waitless.experiments.harness import validation
from waitless.experiments.harness import window as window_lib
from waitless.experiments.harness import workdir as workdir_lib
from waitless.experiments.harness import workdir_lock

log = logging.getLogger('waitless')


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_requests: preemption.StopRequests | None = None, loss_hook=None) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns the summary.

  Writes metrics.jsonl, summary.json, config.json, TensorBoard events and orbax checkpoints in `workdir`.

  Raises:
    loop.TrainingDiverged, loop.ClusterStalled: the run stopped there (its metrics up to then and its last good
      checkpoint are kept).
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
  what a run alone writes (metrics.jsonl, summary.json, config.json, TensorBoard events, orbax checkpoints of its
  own state, at the same steps as the others); its trajectory is the one it has alone (float64: to rounding;
  float32: XLA may round the batched program differently). A replica that has spent its budget, or that
  diverged or stalled, is frozen (it computes what is never read) while the others go on.

  A run whose workdir holds its summary.json finished: it is returned as it is, not trained again.

  `loss_hook`: TEST-ONLY, applied to every micro-batch's loss (`experiments.harness.slowdown.loss_hook`).
  `built`: per config, its run built already (`setup.PlannedGroup.built`) or None (`setup.build_group`).

  Returns:
    Per run, its summary dict, or the `loop.TrainingDiverged` / `loop.ClusterStalled` it stopped with.

  Raises:
    preemption.Preempted: SIGTERM or SIGINT (or `stop_requests.request()`) arrived; every unfinished replica
      finished its block and checkpointed, and the same call resumes them.
  """
  for config in configs:  # the Ray runtime has its own loop (`ray_runtime.driver`); this one is lock-step
    errors.require(config.get('runtime', 'spmd') != 'ray', 'runtime', config.get('runtime'),
                   'runs through experiments.main (ray_runtime.driver.train_and_evaluate), not the lock-step loop')
  finished = [atomic_files.read_json(os.path.join(w, 'summary.json')) for w in workdirs]
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
  lead = jax.process_index() == 0
  state_bytes = setup.state_bytes_of(group.lead)  # shapes only (one trace of the init): nothing allocated yet
  for config, workdir in zip(configs, workdirs):
    workdir_lib.check_workdir(workdir, config)  # on every process, so that a conflict stops all of them
  checkpointing.check_writable(workdirs, checkpoint_bytes=state_bytes / jax.process_count())
  # One program per workdir at a time (process 0 holds the locks): a second would train the same runs again.
  locks = []
  try:
    locks.extend(workdir_lock.WorkdirLock(workdir) for workdir in (workdirs if lead else ()))
    return _train_locked(group, configs, workdirs, state_bytes, stop_requests, loss_hook)
  finally:
    for lock in locks:
      lock.release()


def _train_locked(group, configs, workdirs, state_bytes, stop_requests, loss_hook) -> list[Any]:
  """`train_group` once its workdirs are checked and locked."""
  lead = jax.process_index() == 0
  setup.check_memory(group, state_bytes)
  if lead:
    for config, workdir in zip(configs, workdirs):
      os.makedirs(workdir, exist_ok=True)
      # Atomic: other processes may be reading it in check_workdir.
      atomic_files.write_text(os.path.join(workdir, 'config.json'), config.to_json_best_effort(indent=2))
  run = group.lead  # num_steps resolved (config.json keeps the duration as given)

  state = setup.init_state(group)
  num_params, model_bytes = setup.param_count_and_bytes(state.params)
  num_params, model_bytes = (num_params // (run.config.workers * group.size),
                             model_bytes // (run.config.workers * group.size))
  block_step = block_step_lib.BlockStep(group, loss_hook=loss_hook)
  if run.config.stragglers.calibrate:  # a calibrated run never shares its program (replicas.program_key)
    setup.set_stragglers(run, calibrated_stragglers(run, block_step, state, model_bytes, workdirs[0]))
  replicas = [loop_lib.Replica.start(r, setup.clock_for(r, model_bytes), workdir)
              for r, workdir in zip(group.runs, workdirs)]
  try:
    state, step = _restore(group, replicas, state)
    for r in replicas:
      r.writer = metrics_io.MetricsWriter(r.workdir, keep_through_step=step or None, enabled=lead)
    loop_lib.Loop(group, replicas, block_step, num_params).run(state, step, stop_requests)
  finally:
    for r in replicas:
      r.checkpointer.close()
      if r.writer is not None:
        r.writer.close()
  return [r.summary if r.failure is None else r.failure for r in replicas]


def _restore(group: setup.Group, replicas: list[loop_lib.Replica], state):
  """Restores every replica from the newest checkpoint step they all have (a kill between the replicas' saves
  leaves some a checkpoint ahead: they go back one); the group's state and that step, or (state, 0) if none.

  A checkpoint that does not read back is moved aside (`checkpointing.quarantine_step`) and the choice made again.
  """
  like = setup.replica_state(group, state, 0) if group.batched else state
  while True:
    steps = [set(r.checkpointer.all_steps()) for r in replicas]
    if not any(steps):
      return state, 0
    common = set.intersection(*steps)
    if not common:
      raise ValueError('the runs of this group have no checkpoint step in common (latest: '
                       + ', '.join(f'{r.workdir}: {max(s) if s else None}' for r, s in zip(replicas, steps))
                       + '): train them in separate groups (experiments.harness.replicas.partition does)')
    step = max(common)
    restored = [r.checkpointer.restore_step(step, like, checkpointing.quarantine_step(r.workdir)) for r in replicas]
    if all(x is not None for x in restored):
      break
  for r, (_, meta) in zip(replicas, restored):
    r.wall_offset = float(meta['wall_time'])
    r.positions = np.asarray(meta['positions'], np.int64)
    r.clock.load_state_dict(meta['clock'])
    r.time_to_target, r.last_eval = meta['time_to_target'], meta['last_eval']
    r.window = window_lib.Window(loop_lib.reports(r.run), meta['window'])
    r.last_train_loss = float(meta['train_loss'])
    r.sim_time = r.clock.sim_time
    log.info('Resumed from the checkpoint at step %d in %s', step, r.workdir)
  return setup.stack_replicas(group, [s for s, _ in restored]), step


def calibrated_stragglers(run: setup.Run, block_step, state, model_bytes: float, workdir: str):
  """`config.stragglers` rescaled to this machine's jitted step, its per-call overhead fitted from two sizes.

  A micro-batch call is timed at the config's micro-batch size and at a second one (half of it, or twice it:
  `_second_size`), and the line t(s) = overhead + s x per_sample through both (`calibration.fit_overhead`) gives
  `stragglers.overhead_s` and the per-sample part (`calibration.calibrated`); a config with no second size (an
  odd micro-batch of an odd count), or times that do not grow with the size (noise), keeps its configured
  overhead. Measured once per workdir
  on copies of the state (the run's trajectory is untouched), broadcast from process 0 and kept in
  `calibration.json`, so a resumed run simulates the same clock.
  """
  config = run.config
  path = os.path.join(workdir, 'calibration.json')
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
  else:
    sizes = [config.batch_size // config.microbatches]
    seconds = [_seconds_per_microbatch(run, block_step, state, model_bytes)]
    second = _second_size(config)
    if second is not None:
      other = setup.build(second)
      group = setup.as_group(other)
      sizes.append(second.batch_size // second.microbatches)
      seconds.append(_seconds_per_microbatch(other, block_step_lib.BlockStep(group), setup.init_state(group),
                                             model_bytes))
    seconds = [float(multihost_utils.broadcast_one_to_all(np.float64(t))) for t in seconds]
    saved = {'seconds_per_microbatch': seconds[0], 'device': str(jax.devices()[0].device_kind),
             'sizes': sizes, 'seconds': seconds}
    if len(sizes) > 1:
      try:
        fit = calibration.fit_overhead(sizes, seconds)
        saved.update(overhead_s=fit.overhead_s, seconds_per_microbatch=fit.seconds(sizes[0]))
      except ValueError as e:  # times that do not grow with the size: this machine's noise; one size it is
        log.info('calibration keeps the configured overhead: %s', e)
    if jax.process_index() == 0:
      atomic_files.write_json(path, saved)
  overhead = saved.get('overhead_s')  # None: one size timed (or a calibration.json of one): the configured one
  log.info('calibrated: %.3g s per micro-batch on this machine%s', saved['seconds_per_microbatch'],
           '' if overhead is None else f', {overhead:.3g} s of it the per-call overhead')
  return calibration.calibrated(config.stragglers, saved['seconds_per_microbatch'], overhead_s=overhead)


def _second_size(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict | None:
  """The config with micro-batches of another size for the overhead's fit: twice as many (half the size) where
  the batch splits so, else half as many; None where neither does, or the variant is not a valid config."""
  m, b = config.microbatches, config.batch_size
  count = 2 * m if b % (2 * m) == 0 else (m // 2 if m % 2 == 0 else None)
  if count is None:
    return None
  variant = config.copy_and_resolve_references()
  variant.microbatches = count
  try:
    validation.validate(variant)
  except errors.ConfigError:
    return None
  return variant


def _seconds_per_microbatch(run: setup.Run, block_step, state, model_bytes: float) -> float:
  """Seconds of one micro-batch of `run`'s block step on a copy of `state` (timed on this process)."""
  config = run.config
  scratch_clock = setup.clock_for(run, model_bytes)
  inputs, _ = inputs_lib.block_inputs(run, scratch_clock.next_block(config.steps_per_call),
                                      np.zeros(config.workers, np.int64), 0)
  return calibration.seconds_per_microbatch(
      block_step, jax.tree.map(jnp.copy, state), *inputs, carry=True,
      microbatches_per_call=calibration.microbatches_per_call(config, config.steps_per_call))
