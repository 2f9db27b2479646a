"""Real stragglers: wall time per iteration of a multi-process CPU run with processes really slowed, against
the simulator's prediction for the same slowdowns.

  python benchmarks/real_stragglers.py                         # 4 processes, the three conditions below
  python benchmarks/real_stragglers.py --num_processes=2 --conditions=none,slowed --repeats=5

The script starts `--num_processes` copies of itself (one CPU device each), joined by `jax.distributed` over
loopback (`experiments.harness.distributed`, as `launch/multiprocess_cpu.sh` joins `experiments.main`), and each
trains the same MLP least-squares problem (one worker per process, `--microbatches` m micro-batches per
iteration) with sync, nonblocking with measured speeds (`experiments/harness/measured_speeds.py`), local SGD, D-PSGD
and WAGMA, each from the library's optax transformation in a plain `shard_map` step. The lock-step steps
return each worker's own loss (no all-reduce of it), so D-PSGD's ring and WAGMA's group exchanges are the only
collectives of their iterations (WAGMA's every `sync_every`-th is its global average): point-to-point
`ppermute`s, with which a process waits for its partners of that iteration only.

Emulated compute: every process sleeps `--debug_base_sleep` (TEST-ONLY, default 10 ms) in every micro-batch on top
of the MLP's compute. On a machine with fewer cores than processes (4 processes on CI's 2 cores) real compute
would confound the experiment: a sleeping process frees a core and the others compute faster (measured: with
`--debug_base_sleep=0` and 4 processes, sync paid 8 ms of a 32 ms slowdown per iteration). With the base sleep
the devices' time is mostly sleep, of known length, and what the run measures is the waiting that the lock-step
program's collectives impose, which is what the simulator's time rules model.

Conditions (`--conditions`), every one a TEST-ONLY slowdown: process d sleeps sleep[t, d, k] seconds in
micro-batch k of iteration t (a host callback inside the loss whose argument is a per-device input of the step,
so the device is busy for it and the schedule reaches each process with its data, not through a host global
that asynchronous dispatch would read at the wrong iteration):
  none     nobody sleeps (and the run that calibrates the prediction's fixed cost, below).
  slowed   `--debug_slow_process=I:S`: process I sleeps S in every micro-batch (a slower device, whose cost
           grows with the work it is given).
  delayed  `--debug_delay=K:S`: each iteration K processes drawn at random (the same draw on every process,
           from the step) sleep S once, in their first micro-batch (transient stragglers: WAGMA's setting).
Each (algorithm, condition) is its own run from the same initial model: a warm-up of `--warmup` iterations
(compilation; nonblocking: then its probes at n = m and n = 1), then `--repeats` interleaved measurements of
`--timed_iterations` iterations, each started together on every process (a barrier outside the timed part) and
timed until every process has finished (the max over the processes; each process's own time is kept too).

The prediction: `experiments.simulate` for the same algorithm, workers and iterations, with an ideal network
and the replayed compute trace (`stragglers.kind='trace'`): s_d + sleep[t, d, k] for micro-batch k of worker d
in the timed iteration t, s_d the seconds per micro-batch that nonblocking fitted in condition `none` (its
call modelled as c_d + n s_d, `measured_speeds.MeasuredSpeeds`). The simulator has no per-iteration cost of
dispatch, collectives or host work; the "+ fixed" column adds each algorithm's own measured gap in condition
`none` (real - simulated) to its prediction for the other conditions: calibrated on `none`, checked on
`slowed` and `delayed`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags
import numpy as np

from waitless.experiments.harness.slowdown import parse_delay, parse_slow  # no JAX

ALGORITHMS = ('sync', 'nonblocking', 'local_sgd', 'dpsgd', 'wagma')
CONDITIONS = ('none', 'slowed', 'delayed')

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The flags, in `flag_values`; defined when the script runs, not on import (a test process that also imports
  another benchmark or `experiments.main` would define `repeats`, `num_processes`, ... twice)."""
  where = {'flag_values': flag_values}
  flags.DEFINE_integer('num_processes', 4, 'Processes (one CPU device and one worker each).', **where)
  flags.DEFINE_list('conditions', list(CONDITIONS), f'Which of {CONDITIONS} to run ("none" is always run: it '
                    'calibrates the prediction).', **where)
  flags.DEFINE_string('debug_slow_process', '1:0.004',
                      'TEST-ONLY, condition "slowed": "I:S", process I sleeps S seconds per micro-batch.', **where)
  flags.DEFINE_string('debug_delay', '1:0.02',
                      'TEST-ONLY, condition "delayed": "K:S", each iteration K random processes sleep S seconds '
                      'once.', **where)
  flags.DEFINE_float('debug_base_sleep', 0.01,
                     'TEST-ONLY: every process sleeps this many seconds per micro-batch in every condition (emulated '
                     'compute: with more processes than cores, real compute would make a sleeping process free a '
                     'core for the others; 0 for the MLP\'s compute only).', **where)
  flags.DEFINE_integer('microbatches', 4, 'm, micro-batches per worker and iteration.', **where)
  flags.DEFINE_integer('microbatch_size', 64, 'Samples per micro-batch.', **where)
  flags.DEFINE_integer('hidden', 256, 'Width of the MLP\'s two hidden layers.', **where)
  flags.DEFINE_integer('timed_iterations', 20, 'Timed iterations per algorithm, condition and repeat.', **where)
  flags.DEFINE_integer('warmup', 3, 'Untimed iterations per algorithm and condition (compilation; nonblocking: '
                       'then its probes at n = m and n = 1, the fit\'s two sizes).', **where)
  flags.DEFINE_integer('repeats', 3, 'Measurements per algorithm and condition, interleaved.', **where)
  flags.DEFINE_integer('local_steps', 4, 'local_sgd: H.', **where)
  flags.DEFINE_integer('seed', 0, 'The draws of condition "delayed".', **where)
  flags.DEFINE_string('out', '', 'Write the results as JSON here (process 0).', **where)
  # Set by the launcher for each process.
  flags.DEFINE_integer('process_id', -1, 'Internal: this process\'s id (the launcher sets it).', **where)
  flags.DEFINE_string('coordinator_address', '', 'Internal: the coordinator (the launcher sets it).', **where)


def parse_conditions(value: Sequence[str]) -> tuple[str, ...]:
  """The conditions to run, in CONDITIONS' order, `none` always among them."""
  from waitless import config_errors as errors
  errors.require(all(c in CONDITIONS for c in value), 'conditions', ','.join(value),
                 f'must be a comma-separated subset of {",".join(CONDITIONS)}')
  return tuple(c for c in CONDITIONS if c == 'none' or c in value)


def sleep_table(step: int, condition: str, processes: int, microbatches: int, slow: tuple[int, float],
                delay: tuple[int, float], seed: int, base_s: float = 0.0) -> np.ndarray:
  """float32 (processes, m): the seconds process d sleeps in micro-batch k of iteration `step` (TEST-ONLY):
  `base_s` everywhere (emulated compute) plus the condition's slowdown.

  A function of the step and the settings only, so every process computes the same table (each uses its row)
  and the prediction replays it.
  """
  table = np.full((processes, microbatches), base_s, np.float32)
  if condition == 'slowed' and slow[0] >= 0:
    table[slow[0], :] += slow[1]
  elif condition == 'delayed' and delay[0] > 0:
    chosen = np.random.default_rng([seed, step]).choice(processes, size=delay[0], replace=False)
    table[chosen, 0] += delay[1]
  return table


def check_settings(processes: int) -> dict:
  """Every flag that needs checking, parsed; a bad one refused (one line) before any process starts."""
  from waitless import config_errors as errors
  errors.require_number(FLAGS.debug_base_sleep, 'debug_base_sleep', 'must be a finite number of seconds >= 0',
                        lambda v: v >= 0)
  return {'slow': parse_slow(FLAGS.debug_slow_process, processes),
          'delay': parse_delay(FLAGS.debug_delay, processes),
          'conditions': parse_conditions(FLAGS.conditions)}


# The settings every process runs with (not the per-process `out`, `process_id`, `coordinator_address`).
SHARED_FLAGS = ('num_processes', 'conditions', 'debug_slow_process', 'debug_delay', 'debug_base_sleep',
                'microbatches', 'microbatch_size', 'hidden', 'timed_iterations', 'warmup', 'repeats', 'local_steps',
                'seed')


def child_flags() -> list[str]:
  """The launcher's parsed values of `SHARED_FLAGS`, as --name=value (the argv that `app.run` hands to `main`
  holds no flags, and `--debug_slow_process=` must reach the processes as the empty value)."""
  def text(value):
    return ','.join(value) if isinstance(value, (list, tuple)) else value
  return [f'--{name}={text(getattr(FLAGS, name))}' for name in SHARED_FLAGS]


def launch() -> dict:
  """Starts the processes, waits for them, returns process 0's results."""
  from waitless.experiments.harness import distributed
  address = f'127.0.0.1:{distributed.free_port()}'
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, 'results.json')
    env = {**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=1', 'JAX_PLATFORMS': 'cpu'}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *child_flags(), f'--process_id={i}',
                               f'--coordinator_address={address}', f'--out={out}'], env=env)
             for i in range(FLAGS.num_processes)]
    codes = [p.wait() for p in procs]
    if any(codes):
      raise SystemExit(f'a process failed: exit codes {codes}')
    with open(out) as f:
      return json.load(f)


def run_process() -> dict:
  """One process's part: every algorithm in every condition, timed."""
  from waitless.experiments.harness import distributed
  distributed.initialize(distributed.settings_from(FLAGS.coordinator_address, FLAGS.num_processes,
                                                   FLAGS.process_id))
  import jax
  from jax.experimental import multihost_utils
  import jax.numpy as jnp
  import optax
  from jax import lax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from waitless.algorithms import dpsgd, local_sgd, sync, wagma
  from waitless.experiments.harness import measured_speeds

  settings = check_settings(FLAGS.num_processes)
  conditions = settings['conditions']
  me = jax.process_index()
  mesh = Mesh(np.array(jax.devices()), ('workers',))
  p, m, b, h = mesh.size, FLAGS.microbatches, FLAGS.microbatch_size, FLAGS.hidden
  per_device = NamedSharding(mesh, PartitionSpec('workers'))
  spec = PartitionSpec('workers')

  def sleep(seconds):
    # `seconds` arrives as a jax.Array: a jax operation on it (even `seconds > 0`) would dispatch a computation
    # from inside the running one, which deadlocks once the CPU client's in-flight limit is reached (seen with
    # 4 processes); np.asarray reads the buffer without one.
    value = float(np.asarray(seconds))
    if value > 0:
      time.sleep(value)

  def loss_fn(params, mb):
    x, y, seconds = mb
    jax.debug.callback(sleep, seconds)  # TEST-ONLY: this micro-batch's slowdown, a per-device input
    z = jnp.tanh(x @ params['w1'])
    z = jnp.tanh(z @ params['w2'])
    return 0.5 * jnp.mean((z @ params['w3'] - y) ** 2)

  rng = np.random.default_rng(0)
  init = {'w1': rng.normal(size=(32, h)) / np.sqrt(32), 'w2': rng.normal(size=(h, h)) / np.sqrt(h),
          'w3': rng.normal(size=(h,)) / np.sqrt(h)}
  init = {k: v.astype(np.float32) for k, v in init.items()}
  truth = rng.normal(size=32).astype(np.float32)

  def batch(step, condition):
    """This process's micro-batches and sleeps (1, m, ...) for `step`, as global (P, m, ...) arrays."""
    r = np.random.default_rng([step, me])
    x = r.normal(size=(1, m, b, 32)).astype(np.float32)
    y = np.sin(x @ truth)
    sleeps = sleep_table(step, condition, p, m, settings['slow'], settings['delay'], FLAGS.seed,
                         FLAGS.debug_base_sleep)[me][None]
    return tuple(jax.make_array_from_process_local_data(per_device, a, (p,) + a.shape[1:]) for a in (x, y, sleeps))

  def replicate(tree):
    return jax.tree.map(lambda v: jax.make_array_from_process_local_data(
        per_device, np.asarray(v)[None], (p,) + np.shape(v)), tree)

  inner = optax.sgd(0.05)
  value_and_grad = jax.value_and_grad(loss_fn)

  def lockstep(tx):
    """A plain step: all m micro-batches (a scan), their mean gradient, `tx.update` (which communicates). Returns
    each worker's own loss: an all-reduce of it would be a global barrier every iteration."""
    def device_step(params, opt_state, x, y, seconds, step):
      params, opt_state, x, y, seconds = jax.tree.map(lambda v: v[0], (params, opt_state, x, y, seconds))

      def micro(carry, mb):
        loss, grads = value_and_grad(params, mb)
        return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], grads)), None
      zeros = (jnp.zeros_like(x[0, 0, 0]), jax.tree.map(jnp.zeros_like, params))
      (loss, grads), _ = lax.scan(micro, zeros, (x, y, seconds))
      grads = jax.tree.map(lambda g: g / m, grads)
      updates, opt_state = tx.update(grads, opt_state, params, step=step)
      return jax.tree.map(lambda v: v[None], (optax.apply_updates(params, updates), opt_state, loss / m))

    fn = jax.jit(jax.shard_map(device_step, mesh=mesh, in_specs=(spec,) * 5 + (PartitionSpec(),),
                               out_specs=(spec, spec, spec)), donate_argnums=(0, 1))

    def make(condition):
      state = {'params': replicate(init), 'opt': replicate(tx.init(init))}

      def step(t):
        state['params'], state['opt'], loss = fn(state['params'], state['opt'], *batch(t, condition), jnp.int32(t))
        return loss
      return step, state, None
    return make

  def nonblocking(condition):
    step_fn = measured_speeds.MeasuredStep(loss_fn, inner, mesh, m)
    state = {'params': replicate(init), 'opt': replicate(step_fn.tx.init(init))}
    counts = []

    def step(t):
      state['params'], state['opt'], loss = step_fn(state['params'], state['opt'], batch(t, condition))
      counts.append(step_fn.last_counts.tolist())
      return loss
    return step, state, (step_fn, counts)

  makers = {
      'sync': lockstep(sync.sync_sgd(inner, axis_name='workers')),
      'nonblocking': nonblocking,
      'local_sgd': lockstep(local_sgd.local_sgd(inner, local_steps=FLAGS.local_steps, axis_name='workers')),
      'dpsgd': lockstep(dpsgd.dpsgd(inner, axis_name='workers')),
      'wagma': lockstep(wagma.wagma(inner, axis_name='workers')),
  }
  runs = {(name, c): makers[name](c) for name in ALGORITHMS for c in conditions}
  t = {key: 0 for key in runs}
  # A run's last step is waited for whole (its state, not only its loss) before another run or a barrier
  # starts: two programs' collectives in flight at once could run in different orders on different
  # processes (deadlock: independent executions may run concurrently on a CPU device).
  for key, (step, state, _) in runs.items():  # compile and settle the speed averages
    for _ in range(FLAGS.warmup):
      step(t[key])
      t[key] += 1
    jax.block_until_ready(state)
  seconds = {f'{name}/{c}': [] for name, c in runs}
  own = {f'{name}/{c}': [] for name, c in runs}  # each process's time per measurement (P,)
  for r in range(FLAGS.repeats):
    if me == 0:
      print(f'[real_stragglers] measurement {r + 1} of {FLAGS.repeats}', flush=True)
    for (name, c), (step, state, _) in runs.items():
      multihost_utils.sync_global_devices(f'{name}/{c}/{r}')  # start together, outside the timed part
      begin = time.perf_counter()
      for _ in range(FLAGS.timed_iterations):
        step(t[name, c])
        t[name, c] += 1
      jax.block_until_ready(state)
      mine = (time.perf_counter() - begin) / FLAGS.timed_iterations
      every = np.asarray(multihost_utils.process_allgather(np.float64(mine))).reshape(-1)
      seconds[f'{name}/{c}'].append(float(every.max()))
      own[f'{name}/{c}'].append(every.tolist())
  nonblocking_runs = {c: runs['nonblocking', c][2] for c in conditions}
  counts = {c: np.asarray(n[FLAGS.warmup:]) for c, (_, n) in nonblocking_runs.items()}
  return {'per_iteration_s': seconds, 'per_process_s': own, 'conditions': list(conditions),
          'speeds_s': {c: s.speeds.seconds.tolist() for c, (s, _) in nonblocking_runs.items()},
          'overhead_s': {c: s.speeds.overhead.tolist() for c, (s, _) in nonblocking_runs.items()},
          'mean_counts': {c: n.mean(axis=0).tolist() for c, n in counts.items()},
          'min_counts': {c: n.min(axis=0).tolist() for c, n in counts.items()},
          'microbatches': m, 'workers': p, 'slow': settings['slow'], 'delay': settings['delay'],
          'seed': FLAGS.seed, 'base_sleep_s': FLAGS.debug_base_sleep, 'warmup': FLAGS.warmup,
          'timed': FLAGS.repeats * FLAGS.timed_iterations,
          'model_bytes': 4 * sum(int(np.size(v)) for v in init.values())}


def replayed_trace(results: dict, condition: str) -> np.ndarray:
  """(timed iterations x m, P) seconds per micro-batch for the simulator: s_d of condition `none` (the base
  sleep included) plus the condition's sleeps of the timed iterations, in the order the run met them."""
  p, m = results['workers'], results['microbatches']
  base = np.asarray(results['speeds_s']['none'], np.float64)
  steps = range(results['warmup'], results['warmup'] + results['timed'])
  sleeps = np.stack([sleep_table(t, condition, p, m, tuple(results['slow']), tuple(results['delay']),
                                 results['seed']) for t in steps])  # (T, P, m)
  return (base[None, :, None] + sleeps).transpose(0, 2, 1).reshape(-1, p)


def simulate_iteration_seconds(trace: np.ndarray, microbatches: int, model_bytes: float, iterations: int,
                               local_steps: int, nonblocking_deadline_s: Optional[float] = None) -> dict[str, float]:
  """Each algorithm's simulated mean seconds per iteration on `trace` ((rows, P) seconds per micro-batch,
  replayed by position: `stragglers.kind='trace'`) with an ideal network, P = trace.shape[1] workers.
  `nonblocking_deadline_s`: also 'nonblocking_deadline', nonblocking with `trigger='deadline'` at that budget
  (the rule measured speeds run: a round as long as the slowest device's measured count needs)."""
  from waitless.experiments import simulate
  from waitless.experiments.configs import synthetic
  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, 'trace.npy')
    np.save(path, np.asarray(trace, np.float64))
    for name in ALGORITHMS:
      config = synthetic.get_config(name)
      config.workers = config.devices = trace.shape[1]
      config.microbatches = microbatches
      config.batch_size = 8 * microbatches
      config.stragglers.kind = 'trace'
      config.stragglers.trace_path = path
      config.network.kind = 'ideal'
      if name == 'local_sgd':
        config.algorithm.local_steps = local_steps
      out[name] = simulate.simulate(config, iterations=iterations, nbytes=model_bytes)['mean_iteration_time']
      if name == 'nonblocking' and nonblocking_deadline_s is not None:
        config.algorithm.trigger, config.algorithm.deadline_s = 'deadline', float(nonblocking_deadline_s)
        out['nonblocking_deadline'] = simulate.simulate(config, iterations=iterations,
                                                        nbytes=model_bytes)['mean_iteration_time']
  return out


def predict(results: dict, local_steps: int) -> dict:
  """Simulated seconds per iteration of each algorithm in each condition, `algorithm/condition` -> seconds
  (the replayed trace, an ideal network)."""
  out = {}
  for condition in results['conditions']:
    simulated = simulate_iteration_seconds(replayed_trace(results, condition), results['microbatches'],
                                           results['model_bytes'], results['timed'], local_steps)
    out.update({f'{name}/{condition}': seconds for name, seconds in simulated.items()})
  return out


def report(results: dict, predicted: dict) -> str:
  slow, delay = results['slow'], results['delay']
  what = {'none': 'nobody slowed', 'slowed': f'process {slow[0]} +{slow[1] * 1e3:.1f} ms per micro-batch',
          'delayed': f'{delay[0]} random process(es) +{delay[1] * 1e3:.1f} ms once per iteration'}
  ms = lambda values: ', '.join(f'{v * 1e3:.2f}' for v in values)
  lines = [f"{results['workers']} processes, m = {results['microbatches']}, every micro-batch "
           f"+{results['base_sleep_s'] * 1e3:.1f} ms (emulated compute); nonblocking's fit in condition none: "
           f"c (ms) {ms(results['overhead_s']['none'])}, s (ms) {ms(results['speeds_s']['none'])}"]
  real = {key: np.median(v) for key, v in results['per_iteration_s'].items()}
  fixed = {name: real[f'{name}/none'] - predicted[f'{name}/none'] for name in ALGORITHMS}
  for condition in results['conditions']:
    counts = zip(results['mean_counts'][condition], results['min_counts'][condition])
    sync_predicted = predicted[f'sync/{condition}'] + fixed['sync']
    lines += ['', f"**{condition}** ({what[condition]}); nonblocking's micro-batches per process, mean (min): "
              f"{', '.join(f'{c:.2f} ({n})' for c, n in counts)}", '',
              '| algorithm | real ms/it, median (min) | simulated | simulated + fixed | real / (sim + fixed) '
              '| the slowdown\'s cost, real (simulated) | real / sync (predicted) |', '|---|---|---|---|---|---|---|']
    for name in ALGORITHMS:
      key = f'{name}/{condition}'
      calibrated = predicted[key] + fixed[name]
      added = real[key] - real[f'{name}/none'], predicted[key] - predicted[f'{name}/none']
      cost = f'{added[0] * 1e3:.2f} ({added[1] * 1e3:.2f})' if condition != 'none' else ''
      lines.append(f"| {name} | {real[key] * 1e3:.2f} ({min(results['per_iteration_s'][key]) * 1e3:.2f}) "
                   f'| {predicted[key] * 1e3:.2f} | {calibrated * 1e3:.2f} | {real[key] / calibrated:.2f} | {cost} '
                   f"| {real[key] / real[f'sync/{condition}']:.2f} ({calibrated / sync_predicted:.2f}) |")
  return '\n'.join(lines)


def main(argv):
  if FLAGS.process_id >= 0:
    results = run_process()
    import jax
    if jax.process_index() == 0 and FLAGS.out:
      with open(FLAGS.out, 'w') as f:
        json.dump(results, f)
    return
  check_settings(FLAGS.num_processes)  # a bad flag is refused before anything starts
  results = launch()
  predicted = predict(results, FLAGS.local_steps)
  print(report(results, predicted))
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      json.dump({**results, 'simulated_s': predicted}, f, indent=1)


if __name__ == '__main__':
  define_flags()
  app.run(main)
