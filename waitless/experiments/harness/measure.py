"""Measures this machine: the seconds of a call, of a micro-batch, of the harness's iterations and collectives.

Real hardware only; `cluster/calibration.py` fits what it measures, `experiments/calibrate.py` writes the profile.
  time_callable, time_sizes, seconds_per_microbatch   a call's median wall-clock seconds (at several sizes; per
                                                      micro-batch of one worker)
  microbatch_call         one worker's micro-batch call of a config's model
  calibrated_stragglers   `stragglers.calibrate=True`: the run's `config.stragglers` rescaled to its own step
  compute_fits, harness_rounds, collective_rows       what `experiments.calibrate` measures
  host_compute_fits       the compute of every host of the test bed at its own quota (calibrate on the bed)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.cluster import calibration
from waitless.cluster.rules import ring
from waitless.data import registry as data_registry
from waitless.experiments.harness import atomic_files
from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import distributed
from waitless.experiments.harness import inputs as inputs_lib
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import setup
from waitless.experiments.harness import validation
from waitless.experiments.harness.testbed import placement
from waitless.experiments.harness.testbed import runs
from waitless.models import registry as model_registry

log = logging.getLogger(__name__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def time_callable(fn: Callable[..., Any], *args, warmup: int = 2, repeats: int = 5, carry: bool = False) -> float:
  """Median wall-clock seconds of one `fn(*args)`, waiting for its outputs (the first call compiles).

  Args:
    fn: the (jitted) function to time.
    *args: its arguments.
    warmup: untimed calls first (compilation, caches).
    repeats: timed calls; the median is returned (robust to a noisy shared machine).
    carry: `fn` returns a tuple whose first element replaces the first argument of the next call, as a train
      step that donates its state must be called.

  Returns:
    Seconds per call.
  """
  args = list(args)

  def call():
    out = fn(*args)
    jax.block_until_ready(out)
    if carry:
      args[0] = out[0]

  for _ in range(warmup):
    call()
  seconds = []
  for _ in range(repeats):
    begin = time.perf_counter()
    call()
    seconds.append(time.perf_counter() - begin)
  return float(np.median(seconds))


def time_sizes(make_call: Callable[[int], tuple[Callable[..., Any], tuple]], sizes: Sequence[int],
               **timing) -> np.ndarray:
  """float64 seconds of one call at each size: `time_callable(*make_call(size))` (`timing`: its options).

  `make_call(size)` returns (fn, args), a jitted step and its inputs for a micro-batch of `size` samples.
  """
  seconds = []
  for size in sizes:
    fn, args = make_call(int(size))
    seconds.append(time_callable(fn, *args, **timing))
  return np.asarray(seconds, np.float64)


def microbatches_per_call(config: ml_collections.ConfigDict, iterations_per_call: int = 1) -> int:
  """Micro-batches one device computes back to back in one call of the step: (workers / devices) x m x calls."""
  per_device = max(1, config.workers // max(1, config.get('devices', 1)))
  return per_device * config.microbatches * iterations_per_call


def seconds_per_microbatch(fn: Callable[..., Any], *args, microbatches_per_call: int, **timing) -> float:
  """Measured seconds of one worker's micro-batch: `time_callable(fn, *args) / microbatches_per_call`."""
  if microbatches_per_call < 1:
    raise ValueError(f'microbatches_per_call={microbatches_per_call} must be >= 1')
  return time_callable(fn, *args, **timing) / microbatches_per_call


def microbatch_call(config: ml_collections.ConfigDict, size: int, seed: int = 0):
  """(jitted step, its arguments) of one worker on a micro-batch of `size` random inputs of the dataset's shape.

  The step is what one micro-batch costs a worker: the gradient of the cross-entropy at the parameters and the
  inner SGD update (no collective: one device, one worker). It returns its new state first (time it with
  `carry=True`); `calibration.fit_overhead` fits its times at several sizes as t(s) = overhead + s x per_sample.
  """
  dataset = data_registry.make_dataset(config)
  model = model_registry.make_model(config.model, dataset.num_classes)
  example = np.asarray(dataset.example['image'])
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.standard_normal((size,) + example.shape), jnp.float32)
  labels = jnp.asarray(rng.integers(0, dataset.num_classes, size), jnp.int32)
  params = model.init(jax.random.key(seed), images, train=False)['params']
  tx = optax.sgd(config.optimizer.learning_rate, momentum=config.optimizer.momentum or None)

  def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply({'params': params}, x, train=False),
                                                           y).mean()

  @jax.jit
  def step(state, x, y):
    params, opt_state = state
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), value

  return step, ((params, tx.init(params)), images, labels)


def calibrated_stragglers(run: setup.Run, block_step, state, model_bytes: float, workdir: str):
  """`config.stragglers` rescaled to this machine's jitted step, its per-call overhead fitted from two sizes.

  A micro-batch call of the run's block step is timed at the config's micro-batch size and at a second one (half
  of it, or twice it: `_second_size`), and the line t(s) = overhead + s x per_sample through both
  (`calibration.fit_overhead`) gives `stragglers.overhead_s` and the per-sample part (`calibration.calibrated`);
  a config with no second size (an odd micro-batch of an odd count), or times that do not grow with the size
  (noise), keeps its configured overhead. Measured once per workdir on copies of the state (the run's trajectory
  is untouched), broadcast from process 0 and kept in `calibration.json`, so a resumed run simulates the same
  clock.
  """
  config = run.config
  path = os.path.join(workdir, 'calibration.json')
  if os.path.exists(path):
    with open(path) as f:
      saved = json.load(f)
  else:
    sizes = [config.batch_size // config.microbatches]
    seconds = [_run_seconds_per_microbatch(run, block_step, state, model_bytes)]
    second = _second_size(config)
    if second is not None:
      other = setup.build(second)
      group = setup.as_group(other)
      sizes.append(second.batch_size // second.microbatches)
      seconds.append(_run_seconds_per_microbatch(other, block_step_lib.BlockStep(group), setup.init_state(group),
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


def _run_seconds_per_microbatch(run: setup.Run, block_step, state, model_bytes: float) -> float:
  """Seconds of one micro-batch of `run`'s block step on a copy of `state` (timed on this process)."""
  config = run.config
  scratch_clock = setup.clock_for(run, model_bytes)
  inputs, _ = inputs_lib.block_inputs(run, scratch_clock.next_block(config.steps_per_call),
                                      np.zeros(config.workers, np.int64), 0)
  return seconds_per_microbatch(block_step, jax.tree.map(jnp.copy, state), *inputs, carry=True,
                                microbatches_per_call=microbatches_per_call(config, config.steps_per_call))


def compute_fits(config: ml_collections.ConfigDict, rounds: int, repeats: int) -> tuple[np.ndarray, list[int]]:
  """Per round, the (per_sample_s, overhead_s) fit of the config's micro-batch call at four sizes, and the sizes.

  The sizes lie far apart (a quarter of the micro-batch to 16 times it: a small model's noise); a round whose
  times do not grow with the size (a noisy moment) is timed again, up to three times, then calibrate stops.
  """
  unit = config.batch_size // config.microbatches
  sizes = sorted({max(1, unit // 4), unit, 4 * unit, 16 * unit})
  calls = {s: microbatch_call(config, s) for s in sizes}
  fits = []
  for _ in range(rounds):
    for attempt in range(3):
      seconds = time_sizes(lambda s: calls[s], sizes, warmup=3, repeats=repeats, carry=True)
      try:
        fit = calibration.fit_overhead(sizes, seconds)
        break
      except ValueError as e:
        if attempt == 2:
          raise SystemExit(f'calibrate: {e}') from e
    fits.append((fit.per_sample_s, fit.overhead_s))
  return np.asarray(fits), sizes


def sustained_fits(config: ml_collections.ConfigDict, rounds: int, window_s: float = 2.0) -> np.ndarray:
  """Per round, (seconds per sample, 0) of the config's micro-batch call of one worker's whole batch run back to back
  for at least `window_s`: the compute's sustained rate. Under a CPU quota (a cgroup's CFS bandwidth: so much CPU
  per period, 10 ms on the test bed) a call's median time depends on where it falls in the period; the rate over
  many periods is what the quota grants (`harness/host_compute.py`, each host of the test bed at its own quota)."""
  size = config.batch_size
  step, (state, images, labels) = microbatch_call(config, size)
  for _ in range(3):  # compile and warm up
    state, value = step(state, images, labels)
  jax.block_until_ready(value)
  out = []
  for _ in range(rounds):
    calls, begin = 0, time.perf_counter()
    while True:
      state, value = step(state, images, labels)
      jax.block_until_ready(value)
      calls += 1
      elapsed = time.perf_counter() - begin
      if elapsed >= window_s:
        break
    out.append((elapsed / (calls * size), 0.0))
  return np.asarray(out, np.float64)


def harness_pairs(arg: str, algorithm: str, processes: int, microbatches: int, steps: int) -> str:
  """The config argument's pairs of a harness run: `algorithm`, the user's pairs of `arg` (the part after ':' of
  calibrate's --config) but those of the keys the run sets itself (a key given twice is refused: calibrate's
  `microbatches=4` is the run's own m), and the run's."""
  own = ['stragglers.kind=measured', f'workers={processes}', f'devices={processes}', f'microbatches={microbatches}',
         f'num_steps={steps}', f'eval_every={steps}', 'log_every=10', f'checkpoint_every={steps}', 'cluster.profile=""']
  keys = {pair.split('=', 1)[0] for pair in own}
  user = [p for p in arg.split(',')[1:] if p and p.split('=', 1)[0].strip() not in keys]
  return ','.join([algorithm] + user + own)


def harness_seconds_per_iteration(config_arg: str, flags_: list[str], algorithm: str, microbatches: int, steps: int,
                                  workdir: str, processes: int = 1) -> float:
  """Median measured seconds per iteration of a run of the harness (rows after the first) on `processes`
  processes, one worker and one CPU device each (jax.distributed for more than one, as `launch/multiprocess_cpu.sh`
  joins them; on the test bed's hosts when calibrate runs on one); `algorithm`: its name and pairs; `flags_`: the
  `--config.FIELD=VALUE` flags calibrate was given."""
  path, _, arg = config_arg.partition(':')
  config = [f'--config={path}:{harness_pairs(arg, algorithm, processes, microbatches, steps)}', f'--workdir={workdir}',
            *flags_]
  main = [sys.executable, '-m', 'waitless.experiments.main', *config]
  if processes == 1:
    run_processes([main], workdir + '.logs', 'the harness run')
  else:
    address = f'{placement.coordinator_host()}:{distributed.free_port()}'
    run_processes([main + [f'--coordinator_address={address}', f'--num_processes={processes}', f'--process_id={i}']
                   for i in range(processes)], workdir + '.logs', 'the harness run')
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  steps_ = np.array([r['step'] for r in rows], np.float64)
  times = np.array([metrics_io.time_of(r) for r in rows], np.float64)  # a measured run's rows: measured_time
  return float(np.median(np.diff(times) / np.diff(steps_)))


class HarnessTimes(NamedTuple):
  """What one round of `harness_collectives` measured, in seconds per iteration."""
  allreduce_s: float       # the all-reduce: sync less the never-averaging local SGD
  p2p_s: float             # one point-to-point exchange: D-PSGD less it, per ring neighbour
  no_collective_s: float   # the never-averaging local SGD itself: an iteration without any collective


def harness_collectives(config_arg: str, flags_: list[str], processes: int, steps: int,
                        workdir: str) -> HarnessTimes:
  """The `HarnessTimes` of the config's model on `processes` processes: sync, D-PSGD (ring_neighbours exchanges)
  and local SGD that never averages within the run, one micro-batch, nobody slowed, run one after another."""
  seconds = {name: harness_seconds_per_iteration(config_arg, flags_, name, 1, steps, os.path.join(workdir, slug),
                                                 processes)
             for name, slug in (('sync', 'sync'), (f'local_sgd,local_steps={steps}', 'local'), ('dpsgd', 'dpsgd'))}
  local = seconds[f'local_sgd,local_steps={steps}']
  return HarnessTimes(seconds['sync'] - local, (seconds['dpsgd'] - local) / ring.ring_neighbours(processes),
                      local)


FRAGMENTS = 2  # the fragmented all-reduce's split (`harness_allreduce_sizes`)
FRAGMENTED = f'streaming_diloco,fragments={FRAGMENTS},local_steps={FRAGMENTS},delay=0'  # one fragment every step


def harness_allreduce_sizes(config_arg: str, flags_: list[str], processes: int, steps: int,
                            workdir: str) -> tuple[float, float]:
  """(the whole model's all-reduce, one fragment's) in seconds per iteration as the harness pays them on
  `processes` processes: sync, and streaming DiLoCo with F = FRAGMENTS fragments and H = F, d = 0 (one fragment of
  M / F bytes all-reduced, blocking, every step: what a streaming run's fragment costs), each less the
  never-averaging local SGD, one micro-batch, nobody slowed, run one after another."""
  runs = ((f'local_sgd,local_steps={steps}', 'local'), ('sync', 'sync'), (FRAGMENTED, 'fragment'))
  seconds = {name: harness_seconds_per_iteration(config_arg, flags_, name, 1, steps, os.path.join(workdir, slug),
                                                 processes)
             for name, slug in runs}
  local = seconds[runs[0][0]]
  return seconds['sync'] - local, seconds[FRAGMENTED] - local


class HarnessRounds(NamedTuple):
  """Every round of `harness_rounds`, in seconds per iteration."""
  loads: list[float]               # the load average when each round started
  collectives: list[HarnessTimes]  # `harness_collectives` on the rounds' processes
  single_s: np.ndarray             # (rounds, 2): one process's sync run at m = 1 and at m = M micro-batches


def harness_rounds(config_arg: str, flags_: list[str], processes: int, rounds: int, steps: int, microbatches: int,
                   tmp: str) -> HarnessRounds:
  """`rounds` rounds of the harness's runs, each round all of them one after another (a change of the machine's
  load moves them alike): `harness_collectives` on `processes` processes, then one process's sync at m = 1 and at
  m = `microbatches`; every run `steps` iterations in a workdir under `tmp`."""
  loads, collectives, single = [], [], []
  for r in range(rounds):
    loads.append(os.getloadavg()[0])
    collectives.append(harness_collectives(config_arg, flags_, processes, steps, os.path.join(tmp, f'collectives_{r}')))
    single.append([harness_seconds_per_iteration(config_arg, flags_, 'sync', m, steps, os.path.join(tmp, f'{slug}_{r}'))
                   for m, slug in ((1, 'm1'), (microbatches, 'mM'))])
  return HarnessRounds(loads, collectives, np.asarray(single, np.float64))


def collective_rows(processes: int, sizes: list[int], rounds: int, tmp: str) -> dict:
  """The rows of `harness/collective_timing.py`, run on `processes` processes joined over loopback (or over the
  test bed's links when calibrate runs on one)."""
  out = os.path.join(tmp, 'collectives.json')
  address = f'{placement.coordinator_host()}:{distributed.free_port()}'
  command = [sys.executable, '-m', 'waitless.experiments.harness.collective_timing', f'--coordinator_address={address}',
             f'--num_processes={processes}', f'--out={out}', f'--sizes={",".join(map(str, sizes))}',
             f'--rounds={rounds}']
  run_processes([command + [f'--process_id={i}'] for i in range(processes)], tmp, 'the collectives\' processes')
  with open(out) as f:
    return json.load(f)


def host_compute_fits(config_arg: str, flags_: list[str], hosts: int, rounds: int, tmp: str) -> list[np.ndarray]:
  """Per host, `sustained_fits`' rows ((seconds per sample, 0) per round) of the config's model, measured by
  `harness/host_compute.py` in one process per host (process i on the test bed's host i, in its cgroup: the
  host's compute at its own quota), all at once as a run's workers compute."""
  outs = [os.path.join(tmp, f'host_{i}.json') for i in range(hosts)]
  command = [sys.executable, '-m', 'waitless.experiments.harness.host_compute', f'--config={config_arg}', *flags_,
             f'--rounds={rounds}']
  run_processes([command + [f'--out={out}'] for out in outs], tmp, 'the hosts\' compute')
  fits = []
  for out in outs:
    with open(out) as f:
      fits.append(np.asarray(json.load(f)['fits'], np.float64))
  return fits


GRACE_S = 10.0  # between SIGINT to the children's process groups and SIGKILL


def run_processes(argvs: Sequence[Sequence[str]], logs: str, what: str) -> None:
  """Runs process i of `argvs` (on the test bed's host i when calibrate runs on one: `testbed/placement.py`), each
  in a process group of its own, its output in `logs`/process_I.log; returns when all succeeded.

  One that fails stops the others and raises SystemExit with its output's tail. If this process is interrupted
  (KeyboardInterrupt, or SIGTERM turned into one by `experiments.calibrate`) every group gets SIGINT (a harness run
  stops as on Ctrl-C), SIGKILL after `GRACE_S`, and the interruption is re-raised once none of them is left: no
  child outlives its launcher, none writes into a directory it removes.
  """
  os.makedirs(logs, exist_ok=True)
  paths = [os.path.join(logs, f'process_{i}.log') for i in range(len(argvs))]
  procs = []
  try:
    for i, argv in enumerate(argvs):
      with open(paths[i], 'w') as log_file:
        procs.append(placement.popen(i, list(argv), cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT))
    status = runs.watch(procs, grace_s=GRACE_S, log=log.info)
  except BaseException:
    _stop_groups(procs)
    raise
  if status:
    failed = next((i for i, p in enumerate(procs) if p.returncode and p.returncode > 0),
                  next(i for i, p in enumerate(procs) if p.returncode))
    with open(paths[failed]) as f:
      tail = f.read()[-2000:]
    raise SystemExit(f'{what} failed (process {failed}, status {procs[failed].returncode}): {tail}')


def _stop_groups(procs: Sequence[subprocess.Popen]) -> None:
  """SIGINT to every running child's process group, SIGKILL to those left after GRACE_S; waits for all."""
  def signal_all(sig):
    for proc in procs:
      if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
          os.killpg(proc.pid, sig)

  signal_all(signal.SIGINT)
  deadline = time.monotonic() + GRACE_S
  while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
    time.sleep(0.1)
  signal_all(signal.SIGKILL)
  for proc in procs:
    proc.wait()
