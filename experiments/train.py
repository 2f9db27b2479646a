"""The training loop: one algorithm, P workers, a simulated cluster clock, checkpoints that resume exactly.

Each block of iterations: the clock samples the schedules (who finished what, how long it took), the data
streams serve every worker the micro-batches at its own positions, one jitted call runs the block, and the
host logs, evaluates the consensus model and checkpoints at fixed step boundaries. Block lengths depend only on
absolute step numbers, so a resumed run executes the same programs on the same inputs as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from typing import Any

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np

from algorithms import optimizers
from algorithms import registry
from cluster import calibration
from cluster import clock as clock_lib
from cluster import factory as cluster_factory
from cluster import rules as rules_lib
from data import registry as data_registry
from experiments import checkpointing
from experiments import metrics_io
from experiments import preemption
from experiments import step as step_lib
from experiments import tasks
from experiments import validation
from experiments import workers as workers_lib
from experiments.configs import common as config_common
from models import registry as model_registry

# Fields that may differ when a run is resumed: they do not change the trajectory.
RESUMABLE_CHANGES = frozenset({'progress_every_s', 'devices', 'eval_batch_size', 'bleu'})


log = logging.getLogger('waitless')


class TrainingDiverged(RuntimeError):
  """The training loss became NaN or infinite; the last good checkpoint is kept."""


class ClusterStalled(RuntimeError):
  """The simulated cluster cannot go on: the algorithm waits for a worker that failed for good."""


class WorkdirConflict(ValueError):
  """The workdir holds a run with another config."""


def to_host(tree):
  """Fetches (possibly multi-host sharded) arrays as numpy on every process."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def measurements_to_host(packed) -> dict[str, np.ndarray]:
  """The block step's packed measurements as the host dict of `step.unpack_measurements`."""
  return step_lib.unpack_measurements(to_host(packed))


def _next_boundary(step: int, config) -> int:
  candidates = [config.num_steps]
  for every in (config.log_every, config.eval_every, config.checkpoint_every):
    candidates.append((step // every + 1) * every)
  return min(candidates)


def block_length(step: int, config, round_length: int | None = None) -> int:
  """Iterations in the block starting at `step`: never crosses a log, eval or checkpoint boundary.

  With a round length R the block is whole rounds where it can be (max(1, steps_per_call // R) of them); after
  a boundary that falls inside a round, a shorter block reaches the next round boundary. Lengths depend only on
  absolute step numbers, so a resumed run runs the same blocks.
  """
  limit = _next_boundary(step, config) - step
  if round_length is None:
    return min(config.steps_per_call, limit)
  if step % round_length:
    return min(round_length - step % round_length, limit)
  return min(round_length * max(1, config.steps_per_call // round_length), limit)


def param_count_and_bytes(params) -> tuple[int, int]:
  leaves = jax.tree.leaves(params)
  return sum(x.size for x in leaves), sum(x.size * x.dtype.itemsize for x in leaves)


@dataclasses.dataclass
class Run:
  """Everything built from a config before training starts (no compilation yet)."""
  config: ml_collections.ConfigDict
  spec: Any
  layout: workers_lib.WorkerLayout
  dataset: Any
  task: tasks.Task
  model: Any
  tx: Any
  rule: rules_lib.TimeRule

  @property
  def round_length(self) -> int | None:
    """The algorithm's fixed period (whole-round blocks), or None."""
    return self.spec.round_length(self.config)

  @property
  def microbatches(self) -> int:
    """Micro-batches in each worker's batch per iteration (the step masks those not finished)."""
    return self.spec.microbatches_per_iteration(self.config)

  @property
  def finished_only(self) -> bool:
    """The batch can hold more than m micro-batches per worker (K-batch rules: up to K mini-batches, about K / P
    of them finished): each block's batch then holds only as many as its busiest worker finished (rounded up
    to a power of two, so that few programs compile), and the step loops over the finished ones."""
    return self.microbatches > self.config.microbatches


def build(config: ml_collections.ConfigDict) -> Run:
  """Validates the config and builds the pieces of a run.

  A config with `num_epochs` is resolved here, once: `run.config` is a copy with
  num_steps = ceil(num_epochs x train_size / (workers x batch_size)) (`common.steps_for_epochs`; the global
  batch is workers x per-worker batch) and num_epochs None. Otherwise `run.config` is `config` itself.
  """
  validation.validate(config)
  layout = workers_lib.WorkerLayout.create(config.workers, config.devices)
  dataset = data_registry.make_dataset(config)
  if config.get('num_epochs') is not None:
    epochs = config.num_epochs
    config = config_common.resolve_num_steps(config, dataset.train_size)
    validation.validate(config)  # checks that depend on the number of steps
    log.info('num_epochs=%g: %d steps (%d training examples, global batch %d x %d)', epochs, config.num_steps,
             dataset.train_size, config.workers, config.batch_size)
  spec = registry.get(config.algorithm.name)
  model = model_registry.make_model(config.model, dataset.num_classes)
  inner = optimizers.make_optimizer(config.optimizer, config.num_steps)
  tx = spec.build(config, inner, layout.axis_name)
  return Run(config=config, spec=spec, layout=layout, dataset=dataset, task=tasks.get(dataset.task),
             model=model, tx=tx, rule=spec.time_rule(config))


def rounds_pay_off(layout: workers_lib.WorkerLayout) -> bool:
  """Whether whole-round blocks run the round-structured program on this mesh: on accelerators (GPU, TPU), where
  a collective issued at a static position can run under the compute that follows it; not on XLA:CPU, where
  collectives are rendezvous of the device threads and nothing overlaps. There the unrolled round measured
  10-35% slower per iteration than the per-iteration program (digits MLP, 8 workers: `local_sgd`, `dasgd`,
  `diloco`, `streaming_diloco`), without a collective too (plain SGD unrolled 8 times: 244 us against 132 us per
  iteration). Block lengths are whole rounds either way, so the blocks, logs and checkpoints are the same."""
  return layout.mesh.devices.flat[0].platform != 'cpu'


class BlockStep:
  """The run's jitted block step (`experiments.step.make_block_step`) with the algorithm's declared hooks.

  `(state, batches, schedules, steps) -> (state, measurements)`, `steps` a host int32 array: a block of whole
  rounds of the algorithm's `round_length` runs the round-structured program where `rounds` is true (default:
  `rounds_pay_off`, i.e. on accelerators), any other block the per-iteration one. The two programs compute the
  same update (the tests check it in float64); in float32 they round differently. Each program compiles once
  per block length (and, for `run.finished_only`, once per power-of-two batch size).
  """

  def __init__(self, run: Run, rounds: bool | None = None):
    make = functools.partial(
        step_lib.make_block_step, run.task, run.model, run.tx, run.layout, run.microbatches, run.config.seed,
        schedule_type=run.rule.schedule_type, gradient_params=run.spec.gradient_params,
        finished_only=run.finished_only, gradient_sums=run.spec.gradient_sums)
    if rounds is None:
      rounds = rounds_pay_off(run.layout)
    self.round_length = run.round_length if rounds else None
    self.per_iteration = make()
    self.rounds = None if self.round_length is None else make(round_length=self.round_length)

  def whole_rounds(self, steps: np.ndarray) -> bool:
    r = self.round_length
    return r is not None and int(steps[0]) % r == 0 and len(steps) % r == 0

  def program(self, steps: np.ndarray):
    """The jitted program that runs the block of `steps`."""
    return self.rounds if self.whole_rounds(steps) else self.per_iteration

  def __call__(self, state, batches, schedules, steps):
    return self.program(steps)(state, batches, schedules, steps)

  def lower(self, state, batches, schedules, steps):
    return self.program(steps).lower(state, batches, schedules, steps)


def make_block_step(run: Run, rounds: bool | None = None) -> BlockStep:
  """The run's block step; `rounds`: see `BlockStep` (None: the round-structured program on accelerators only)."""
  return BlockStep(run, rounds)


def make_clock(run: Run, model_bytes: float):
  """A fresh seeded clock driving the run's time rule."""
  return cluster_factory.make_clock(run.config, run.rule, model_bytes)


def init_state(run: Run) -> step_lib.TrainState:
  """Identical initial parameters on every worker (from the seed), each worker's algorithm state."""
  example = jax.tree.map(lambda x: np.asarray(x)[None], run.dataset.example)
  inputs = run.task.model_inputs(example)

  def init():
    variables = run.model.init(jax.random.key(run.config.seed), inputs, train=False)
    params = variables['params']
    model_state = {k: v for k, v in variables.items() if k != 'params'}
    stack = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (run.config.workers,) + x.shape), tree)
    params, model_state = stack(params), stack(model_state)
    return step_lib.TrainState(params=params, opt_state=jax.vmap(run.tx.init)(params), model_state=model_state)

  return jax.jit(init, out_shardings=run.layout.sharding())()


def _to_devices(layout, per_worker, uniform):
  """(`per_worker` as global arrays sharded on the worker dimension, axis 1, from this process's workers'
  rows; `uniform` replicated). On one process, one batched transfer for both trees."""
  sharding = layout.sharding(None)
  if jax.process_count() == 1:
    shardings = (jax.tree.map(lambda _: sharding, per_worker), jax.tree.map(lambda _: layout.replicated(), uniform))
    return jax.device_put((per_worker, uniform), shardings)
  shape = lambda v: v.shape[:1] + (layout.workers,) + v.shape[2:]
  return (jax.tree.map(lambda v: jax.make_array_from_process_local_data(sharding, v, shape(v)), per_worker),
          jax.tree.map(jnp.asarray, uniform))


def block_inputs(run: Run, block, positions: np.ndarray, step: int):
  """The step's (batches, schedules, steps) for `block`: every worker's micro-batches at its own positions.

  Returns the three arguments after the state, and the data positions after the block.
  """
  done = block.schedule.microbatches_done.astype(np.int64)
  starts = positions[None] + np.cumsum(done, axis=0) - done
  local_ids = run.layout.local_worker_ids()
  slots = run.microbatches
  if run.finished_only:  # the same on every process: the schedule is
    slots = min(slots, 1 << max(int(done.max()) - 1, 0).bit_length())
  batches = run.dataset.train.read(local_ids, starts[:, local_ids], slots)
  per_worker, same = rules_lib.base.split(block.schedule)
  per_worker = {name: v[:, local_ids] for name, v in per_worker.items()}
  (batches, per_worker), same = _to_devices(run.layout, (batches, per_worker), same)
  schedules = type(block.schedule)(**per_worker, **same)
  steps = np.arange(step, step + len(done), dtype=np.int32)  # on the host: BlockStep picks the program by it
  return (batches, schedules, steps), positions + done.sum(axis=0)


def prepare_block(run: Run, clock, positions: np.ndarray, step: int):
  """Samples the schedules of the block starting at `step` and reads every worker's micro-batches for it.

  Returns:
    (the clock's Block, the step's inputs after the state, the data positions after the block).
  """
  block = clock.next_block(block_length(step, run.config, run.round_length))
  inputs, positions = block_inputs(run, block, positions, step)
  return block, inputs, positions


def advance(run: Run, block_step, state, clock, positions: np.ndarray, step: int, n: int):
  """Runs iterations step .. step+n-1: samples their schedules, reads each worker's micro-batches, steps.

  Returns:
    (new state, measurements on the host (`step.unpack_measurements`), the clock's Block, new data positions).
  """
  block = clock.next_block(n)
  inputs, positions = block_inputs(run, block, positions, step)
  state, measured = block_step(state, *inputs)
  return state, measurements_to_host(measured), block, positions


def calibrated_stragglers(run: Run, block_step, state, model_bytes: float, workdir: str):
  """`config.stragglers` rescaled to the measured seconds per micro-batch of this machine's jitted step.

  Measured once per workdir on a copy of the state (the run's trajectory is untouched), broadcast from process
  0 and kept in `calibration.json`, so a resumed run simulates the same clock.
  """
  config = run.config
  path = os.path.join(workdir, 'calibration.json')
  if os.path.exists(path):
    with open(path) as f:
      seconds = json.load(f)['seconds_per_microbatch']
  else:
    scratch_clock = make_clock(run, model_bytes)
    inputs, _ = block_inputs(run, scratch_clock.next_block(config.steps_per_call),
                             np.zeros(config.workers, np.int64), 0)
    seconds = calibration.seconds_per_microbatch(
        block_step, jax.tree.map(jnp.copy, state), *inputs, carry=True,
        microbatches_per_call=calibration.microbatches_per_call(config, config.steps_per_call))
    seconds = float(multihost_utils.broadcast_one_to_all(np.float64(seconds)))
    if jax.process_index() == 0:
      with open(path, 'w') as f:
        json.dump({'seconds_per_microbatch': seconds, 'device': str(jax.devices()[0].device_kind)}, f)
  log.info('calibrated: %.3g s per micro-batch on this machine', seconds)
  return calibration.calibrated(config.stragglers, seconds)


def make_evaluator(run: Run):
  """Returns evaluate(state) -> {'eval_loss', 'eval_accuracy', 'param_norm', and the task's extra metrics} of
  the algorithm's consensus model."""
  def consensus_and_norm(state):
    params = run.spec.consensus(state.params, state.opt_state)
    model_state = jax.tree.map(lambda x: jnp.mean(x, axis=0).astype(x.dtype), state.model_state)
    return params, model_state, step_lib.tree_l2(params)  # the norm here: no op-by-op compiles on the host

  consensus = jax.jit(consensus_and_norm, out_shardings=run.layout.replicated())
  sums = jax.jit(lambda params, model_state, batch: run.task.eval_sums(run.model, params, model_state, batch))

  def evaluate(state):
    params, model_state, param_norm = consensus(state)
    total = {'loss_sum': 0.0, 'correct': 0.0, 'count': 0.0}
    for batch in run.dataset.eval_batches(run.config.eval_batch_size):
      batch = jax.device_put(batch, run.layout.replicated())
      for k, v in to_host(sums(params, model_state, batch)).items():
        total[k] += float(v)
    count = max(total['count'], 1.0)
    metrics = {'eval_loss': total['loss_sum'] / count, 'eval_accuracy': total['correct'] / count,
               'param_norm': float(to_host(param_norm))}
    if run.task.extra_eval is not None:
      place = lambda x: jax.device_put(x, run.layout.replicated())
      metrics.update(run.task.extra_eval(run.model, params, run.dataset, run.config, place))
    return metrics

  return evaluate


def _check_workdir(workdir: str, config) -> None:
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    return
  with open(path) as f:
    saved = json.load(f)
  current = json.loads(config.to_json_best_effort())
  differ = sorted(k for k in set(saved) | set(current)
                  if k not in RESUMABLE_CHANGES and saved.get(k) != current.get(k))
  if differ:
    raise WorkdirConflict(f'workdir {workdir} holds a run with a different config (fields: {", ".join(differ)}); '
                          'use a new --workdir or the same config to resume')


class _Window:
  """Per-iteration measurements since the last metrics row, each reduced as declared.

  The step's per-iteration measurements, idle fraction and staleness are means over the window's iterations,
  bytes a sum; `l2_params`, measured once per block, is the value after the window's last block ('last'); the
  time rule's own measurements are reduced as its `reports` declare ('mean', 'sum' or 'max').
  """

  def __init__(self, reports: dict[str, str], saved: dict[str, float] | None = None):
    self.reductions = {'train_loss': 'mean', 'l2_grads': 'mean', 'l2_params': 'last', 'idle_fraction': 'mean',
                       'staleness': 'mean', 'bytes_communicated': 'sum', **reports}
    self.sums = dict(saved or {})

  def add(self, block, **measured: np.ndarray) -> None:
    """Adds one block: the step's `measured` values ((n,), or a scalar for 'last') plus what the clock's
    `block` reports."""
    values = dict(measured, idle_fraction=block.idle_fraction, staleness=block.mean_staleness,
                  bytes_communicated=block.bytes_communicated, **block.measurements)
    for key, v in values.items():
      reduction = self.reductions[key]
      if reduction == 'last':
        self.sums[key] = float(v)
      elif reduction == 'max':
        self.sums[key] = max(self.sums.get(key, -np.inf), float(np.max(v)))
      else:
        self.sums[key] = self.sums.get(key, 0.0) + float(np.sum(v))
    self.sums['iterations'] = self.sums.get('iterations', 0.0) + len(block.duration)

  def row(self) -> dict[str, float]:
    n = max(self.sums.pop('iterations', 0.0), 1.0)
    out = {k: v / n if self.reductions[k] == 'mean' else v for k, v in self.sums.items()}
    self.sums = {}
    return out


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_requests: preemption.StopRequests | None = None) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns the summary.

  Writes metrics.jsonl, summary.json, config.json, TensorBoard events and orbax checkpoints in `workdir`.

  Raises:
    preemption.Preempted: SIGTERM or SIGINT (or `stop_requests.request()`) arrived; the run finished its
      block and checkpointed, and the same call resumes it.
  """
  run = build(config)
  lead = jax.process_index() == 0
  _check_workdir(workdir, config)  # on every process, so that a conflict stops all of them
  checkpointing.check_writable(workdir)
  if lead:
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, 'config.json')
    with open(path + '.tmp', 'w') as f:  # atomic: other processes may be reading it in _check_workdir
      f.write(config.to_json_best_effort(indent=2))
    os.replace(path + '.tmp', path)
  config = run.config  # num_steps resolved (config.json keeps the duration as given)

  state = init_state(run)
  num_params, model_bytes = param_count_and_bytes(state.params)
  num_params, model_bytes = num_params // config.workers, model_bytes // config.workers
  block_step = make_block_step(run)
  if config.stragglers.calibrate:
    config.stragglers = calibrated_stragglers(run, block_step, state, model_bytes, workdir)
  clock = make_clock(run, model_bytes)
  _, state_bytes = param_count_and_bytes(state)
  checkpointing.check_writable(workdir, checkpoint_bytes=state_bytes / jax.process_count())
  checkpointer = checkpointing.Checkpointer(os.path.join(workdir, 'checkpoints'))
  positions = np.zeros(config.workers, np.int64)
  step, wall_offset, time_to_target, window = 0, 0.0, None, _Window(run.rule.reports)
  last_train_loss = float('nan')
  last_eval: dict[str, float] = {}
  restored = checkpointer.restore_latest(state, checkpointing.quarantine_step(workdir))
  latest = None if restored is None else restored[0]
  if restored is not None:
    _, state, meta = restored
    step, wall_offset = int(meta['step']), float(meta['wall_time'])
    positions = np.asarray(meta['positions'], np.int64)
    clock.load_state_dict(meta['clock'])
    time_to_target, last_eval = meta['time_to_target'], meta['last_eval']
    window = _Window(run.rule.reports, meta['window'])
    last_train_loss = float(meta['train_loss'])
    log.info('Resumed from the checkpoint at step %d in %s', step, workdir)
  writer = metrics_io.MetricsWriter(workdir, keep_through_step=latest, enabled=lead)
  log.info('%s: %d workers on %d %s device(s), %d parameters per worker, %d steps',
               config.algorithm.name, config.workers, run.layout.devices, jax.devices()[0].platform,
               num_params, config.num_steps)

  evaluate = make_evaluator(run)
  start_wall, start_step, last_progress = time.time(), step, time.time()
  sim_time = clock.sim_time
  # Keep the device busy: while it runs a block, the host samples the next block's schedule and reads its
  # data; between boundaries the next block is even dispatched before this one's results are read. Not across
  # a checkpoint (the saved clock and data positions must be those after the saved step), not before an
  # evaluation (it reads this block's state, which the next block would donate), and not at all for a rule
  # that adapts to this block's loss (AdaSync): the schedules, and so the trajectory, stay exactly the same.
  lookahead = not run.rule.uses_feedback
  stop_requests = preemption.StopRequests() if stop_requests is None else stop_requests
  try:
    stop_requests.install()
    if step < config.num_steps:  # else: a finished run, resumed
      try:
        block, inputs, positions = prepare_block(run, clock, positions, step)
      except clock_lib.StalledError as e:
        raise ClusterStalled(f'{e} Stopped at step {step}.') from None
      state, measured = block_step(state, *inputs)
    while step < config.num_steps:
      end = step + len(block.duration)
      is_eval = end % config.eval_every == 0 or end == config.num_steps
      stop = stop_requests.agreed(step)  # then this block is the last: checkpoint after it, no lookahead
      is_checkpoint = end % config.checkpoint_every == 0 or end == config.num_steps or stop
      following = following_dispatched = stalled = None
      if lookahead and not is_checkpoint:
        try:
          following = prepare_block(run, clock, positions, end)
        except clock_lib.StalledError as e:
          stalled = e  # raised once this block is logged
        if following is not None and not is_eval:
          next_block, next_inputs, _ = following
          state, next_measured = block_step(state, *next_inputs)
          following_dispatched = (next_block, next_measured)

      measured = measurements_to_host(measured)
      done = block.schedule.microbatches_done
      contributed = done > 0
      losses = np.where(contributed, measured['loss'], 0.0).sum(1) / np.maximum(contributed.sum(1), 1)
      if not np.all(np.isfinite(losses)):
        bad = step + int(np.argmin(np.isfinite(losses)))
        raise TrainingDiverged(f'training loss is {losses[bad - step]} at step {bad + 1}; stopped, the last good '
                               f'checkpoint (step {checkpointer.latest_step()}) is kept in {workdir}')
      window.add(block, train_loss=losses, l2_grads=measured['l2_grads'].mean(1),
                 l2_params=measured['l2_params'].mean())
      clock.feedback(train_loss=float(losses.mean()))  # AdaSync adapts K from it; other rules ignore it
      step, sim_time = end, float(block.sim_time[-1])
      last_train_loss = float(losses[-1])
      wall = wall_offset + time.time() - start_wall

      if is_eval or step % config.log_every == 0:
        row = {'step': step, 'sim_time': sim_time, 'wall_time': wall, **window.row()}
        if is_eval:
          last_eval = evaluate(state)
          row.update({k: v for k, v in last_eval.items() if k != 'param_norm'})
          if time_to_target is None and last_eval['eval_accuracy'] >= config.target_accuracy:
            time_to_target = row['sim_time']
        writer.write(row)
      if is_checkpoint:
        checkpointer.save(step, state, {
            'step': step, 'wall_time': wall, 'positions': positions.tolist(), 'clock': clock.state_dict(),
            'time_to_target': time_to_target, 'window': window.sums, 'last_eval': last_eval,
            'train_loss': last_train_loss})
      if time.time() - last_progress >= config.progress_every_s or step == config.num_steps:
        last_progress = time.time()
        rate = (step - start_step) / max(time.time() - start_wall, 1e-9)
        log.info('step %d/%d  loss %.4f  sim %.2fs  %.1f steps/s  ETA %.0fs', step, config.num_steps,
                 last_train_loss, sim_time, rate, (config.num_steps - step) / max(rate, 1e-9))
      if stop and step < config.num_steps:
        raise preemption.Preempted(step, workdir, stop_requests.signal_name)
      if step >= config.num_steps:
        break  # the end: nothing more to prepare
      if following_dispatched is not None:
        block, measured = following_dispatched
        positions = following[2]
      else:
        try:
          if stalled is not None:
            raise stalled
          if following is None:
            following = prepare_block(run, clock, positions, step)
        except clock_lib.StalledError as e:
          raise ClusterStalled(f'{e} Stopped after step {step}; its metrics are in {workdir}.') from None
        block, inputs, positions = following
        state, measured = block_step(state, *inputs)
  finally:
    stop_requests.uninstall()
    checkpointer.close()
    writer.close()

  summary = {
      'steps': step, 'sim_time': sim_time, 'wall_time': wall_offset + time.time() - start_wall,
      'final_train_loss': last_train_loss, 'final_eval_loss': last_eval.get('eval_loss'),
      'final_eval_accuracy': last_eval.get('eval_accuracy'), 'param_norm': last_eval.get('param_norm'),
      'time_to_target': time_to_target, 'num_params': num_params,
      **{f'final_{k}': v for k, v in last_eval.items() if k not in ('eval_loss', 'eval_accuracy', 'param_norm')},
  }
  if lead:
    with open(os.path.join(workdir, 'summary.json'), 'w') as f:
      json.dump(summary, f, indent=2)
  return summary
