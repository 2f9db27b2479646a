"""Real stragglers: wall time per iteration of a 2-process CPU run with one process really slowed, against the
simulator's prediction for the same measured speeds.

  python benchmarks/real_stragglers.py                                   # 2 processes, process 1 slowed
  python benchmarks/real_stragglers.py --debug_slow_process=1:0.004 --timed_iterations=30 --repeats=3

The script starts `--num_processes` copies of itself (one CPU device each), joined by `jax.distributed` over
loopback (`experiments.distributed`, as `launch/multiprocess_cpu.sh` joins `experiments.main`), and each
trains the same MLP least-squares problem (one worker per process, `--microbatches` m micro-batches per
iteration) with sync, nonblocking with measured speeds (`algorithms/measured_speeds.py`), local SGD, D-PSGD
and WAGMA, each from the library's optax transformation in a plain `shard_map` step. Every algorithm runs
`--timed_iterations` timed iterations after a warm-up, `--repeats` times, interleaved (so the other users of the
machine slow all algorithms alike); the min and median per iteration are reported.

TEST-ONLY slowdown, `--debug_slow_process=I:S`: process I sleeps S seconds in every micro-batch it computes (a
host callback inside the loss, so the device is busy for it: a slower device, whose cost grows with the work
it is given, not a fixed per-step delay that no amount of skipped work can hide).

The prediction: `experiments.simulate` for the same algorithm on 2 workers, constant compute time s_fast per
micro-batch with `stragglers.worker_factors` = s_d / s_fast, where s_d are the seconds per micro-batch the
nonblocking run fitted (its call modelled as c_d + n s_d, `measured_speeds.MeasuredSpeeds`), and an ideal
network: it leaves out the all-reduce, the per-call cost c_d (reported beside s_d) and the host's per-iteration
work, which the real run pays (the gap says how much).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ''):  # run as a script: make the repository importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import numpy as np

ALGORITHMS = ('sync', 'nonblocking', 'local_sgd', 'dpsgd', 'wagma')

FLAGS = flags.FLAGS


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
  """The flags, in `flag_values`; defined when the script runs, not on import (a test process that also imports
  another benchmark or `experiments.main` would define `repeats`, `num_processes`, ... twice)."""
  where = {'flag_values': flag_values}
  flags.DEFINE_integer('num_processes', 2, 'Processes (one CPU device and one worker each).', **where)
  flags.DEFINE_string('debug_slow_process', '1:0.004',
                      'TEST-ONLY: "I:S", process I sleeps S seconds per micro-batch it computes ("" for none).',
                      **where)
  flags.DEFINE_integer('microbatches', 4, 'm, micro-batches per worker and iteration.', **where)
  flags.DEFINE_integer('microbatch_size', 64, 'Samples per micro-batch.', **where)
  flags.DEFINE_integer('hidden', 256, 'Width of the MLP\'s two hidden layers.', **where)
  flags.DEFINE_integer('timed_iterations', 20, 'Timed iterations per algorithm and repeat.', **where)
  flags.DEFINE_integer('warmup', 3, 'Untimed iterations per algorithm (compilation; nonblocking: then its probes at '
                       'n = m and n = 1, the fit\'s two sizes).', **where)
  flags.DEFINE_integer('repeats', 3, 'Measurements per algorithm, interleaved.', **where)
  flags.DEFINE_integer('local_steps', 4, 'local_sgd: H.', **where)
  flags.DEFINE_string('out', '', 'Write the results as JSON here (process 0).', **where)
  # Set by the launcher for each process.
  flags.DEFINE_integer('process_id', -1, 'Internal: this process\'s id (the launcher sets it).', **where)
  flags.DEFINE_string('coordinator_address', '', 'Internal: the coordinator (the launcher sets it).', **where)


def parse_slow(value: str, processes: int) -> tuple[int, float]:
  """(process, seconds per micro-batch) of `--debug_slow_process`; (-1, 0) for none."""
  from waitless import config_errors as errors  # pylint: disable=g-import-not-at-top
  if not value:
    return -1, 0.0
  parts = value.split(':')
  ok = len(parts) == 2 and parts[0].isdigit() and int(parts[0]) < processes
  try:
    seconds = float(parts[1]) if ok else -1.0
  except ValueError:
    seconds = -1.0
  errors.require(ok and np.isfinite(seconds) and seconds >= 0, 'debug_slow_process', value,
                 f'must be "I:S", a process I in 0..{processes - 1} and S >= 0 seconds per micro-batch')
  return int(parts[0]), seconds


# The settings every process runs with (not the per-process `out`, `process_id`, `coordinator_address`).
SHARED_FLAGS = ('num_processes', 'debug_slow_process', 'microbatches', 'microbatch_size', 'hidden', 'timed_iterations',
                'warmup', 'repeats', 'local_steps')


def child_flags() -> list[str]:
  """The launcher's parsed values of `SHARED_FLAGS`, as --name=value (the argv that `app.run` hands to `main`
  holds no flags, and `--debug_slow_process=` must reach the processes as the empty value)."""
  return [f'--{name}={getattr(FLAGS, name)}' for name in SHARED_FLAGS]


def launch() -> dict:
  """Starts the processes, waits for them, returns process 0's results."""
  from waitless.experiments import distributed  # pylint: disable=g-import-not-at-top
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
  """One process's part: every algorithm, timed; process 0 also runs the simulator."""
  from waitless.experiments import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize(distributed.settings_from(FLAGS.coordinator_address, FLAGS.num_processes,
                                                   FLAGS.process_id))
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  from waitless.algorithms import dpsgd, local_sgd, measured_speeds, sync, wagma  # pylint: disable=g-import-not-at-top

  slow_process, slow_s = parse_slow(FLAGS.debug_slow_process, FLAGS.num_processes)
  me = jax.process_index()
  mesh = Mesh(np.array(jax.devices()), ('workers',))
  p, m, b, h = mesh.size, FLAGS.microbatches, FLAGS.microbatch_size, FLAGS.hidden
  per_device = NamedSharding(mesh, PartitionSpec('workers'))
  spec = PartitionSpec('workers')

  def slow_down():
    if me == slow_process:
      time.sleep(slow_s)

  def loss_fn(params, mb):
    x, y = mb
    jax.debug.callback(slow_down)  # TEST-ONLY (--debug_slow_process): this process's device is slower
    z = jnp.tanh(x @ params['w1'])
    z = jnp.tanh(z @ params['w2'])
    return 0.5 * jnp.mean((z @ params['w3'] - y) ** 2)

  rng = np.random.default_rng(0)
  init = {'w1': rng.normal(size=(32, h)) / np.sqrt(32), 'w2': rng.normal(size=(h, h)) / np.sqrt(h),
          'w3': rng.normal(size=(h,)) / np.sqrt(h)}
  init = {k: v.astype(np.float32) for k, v in init.items()}
  truth = rng.normal(size=32).astype(np.float32)

  def batch(step):
    """This process's micro-batches (1, m, b, ...) for `step`, as a global (P, m, b, ...) array."""
    r = np.random.default_rng([step, me])
    x = r.normal(size=(1, m, b, 32)).astype(np.float32)
    y = np.sin(x @ truth)
    return tuple(jax.make_array_from_process_local_data(per_device, a, (p,) + a.shape[1:]) for a in (x, y))

  def replicate(tree):
    return jax.tree.map(lambda v: jax.make_array_from_process_local_data(
        per_device, np.asarray(v)[None], (p,) + np.shape(v)), tree)

  inner = optax.sgd(0.05)
  value_and_grad = jax.value_and_grad(loss_fn)

  def lockstep(tx):
    """A plain step: all m micro-batches (a scan), their mean gradient, `tx.update` (which communicates)."""
    def device_step(params, opt_state, x, y, step):
      params, opt_state, x, y = jax.tree.map(lambda v: v[0], (params, opt_state, x, y))

      def micro(carry, mb):
        loss, grads = value_and_grad(params, mb)
        return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], grads)), None
      zeros = (jnp.zeros_like(x[0, 0, 0]), jax.tree.map(jnp.zeros_like, params))
      (loss, grads), _ = lax.scan(micro, zeros, (x, y))
      grads = jax.tree.map(lambda g: g / m, grads)
      updates, opt_state = tx.update(grads, opt_state, params, step=step)
      out = (optax.apply_updates(params, updates), opt_state)
      return jax.tree.map(lambda v: v[None], out) + (lax.pmean(loss / m, 'workers'),)

    fn = jax.jit(jax.shard_map(device_step, mesh=mesh, in_specs=(spec,) * 4 + (PartitionSpec(),),
                               out_specs=(spec, spec, PartitionSpec())), donate_argnums=(0, 1))
    state = {}

    def step(t):
      if not state:
        state['params'] = replicate(init)
        state['opt'] = replicate(tx.init(init))
      x, y = batch(t)
      state['params'], state['opt'], loss = fn(state['params'], state['opt'], x, y, jnp.int32(t))
      return loss
    return step

  def nonblocking_step():
    step_fn = measured_speeds.MeasuredStep(loss_fn, inner, mesh, m)
    state = {'params': replicate(init), 'opt': replicate(step_fn.tx.init(init)), 'counts': []}

    def step(t):
      state['params'], state['opt'], loss = step_fn(state['params'], state['opt'], batch(t))
      state['counts'].append(step_fn.last_counts.tolist())
      return loss
    return step, step_fn, state

  steps = {
      'sync': lockstep(sync.sync_sgd(inner, axis_name='workers')),
      'local_sgd': lockstep(local_sgd.local_sgd(inner, local_steps=FLAGS.local_steps, axis_name='workers')),
      'dpsgd': lockstep(dpsgd.dpsgd(inner, axis_name='workers')),
      'wagma': lockstep(wagma.wagma(inner, axis_name='workers')),
  }
  steps['nonblocking'], measured_step, nb_state = nonblocking_step()
  t = {name: 0 for name in ALGORITHMS}
  for name in ALGORITHMS:  # compile and settle the speed averages
    for _ in range(FLAGS.warmup):
      jax.block_until_ready(steps[name](t[name]))
      t[name] += 1
  seconds = {name: [] for name in ALGORITHMS}
  for _ in range(FLAGS.repeats):
    for name in ALGORITHMS:
      begin = time.perf_counter()
      for _ in range(FLAGS.timed_iterations):
        loss = steps[name](t[name])
        t[name] += 1
      jax.block_until_ready(loss)
      seconds[name].append((time.perf_counter() - begin) / FLAGS.timed_iterations)
  speeds = measured_step.speeds.seconds.tolist()
  counts = np.asarray(nb_state['counts'][FLAGS.warmup:])
  return {'per_iteration_s': seconds, 'speeds_s': speeds, 'overhead_s': measured_step.speeds.overhead.tolist(),
          'mean_counts': counts.mean(axis=0).tolist(), 'min_counts': counts.min(axis=0).tolist(),
          'microbatches': m, 'workers': p, 'slow_process': slow_process, 'slow_s': slow_s,
          'model_bytes': 4 * sum(int(np.size(v)) for v in init.values())}


def predict(results: dict) -> dict:
  """Simulated seconds per iteration of each algorithm for the measured speeds (ideal network)."""
  from waitless.experiments import simulate  # pylint: disable=g-import-not-at-top
  from waitless.experiments.configs import synthetic  # pylint: disable=g-import-not-at-top
  speeds = np.asarray(results['speeds_s'])
  out = {}
  for name in ALGORITHMS:
    config = synthetic.get_config(name)
    config.workers = config.devices = results['workers']
    config.microbatches = results['microbatches']
    config.batch_size = 8 * results['microbatches']
    config.stragglers.kind = 'constant'
    config.stragglers.base_s = float(speeds.min())
    config.stragglers.worker_factors = tuple(float(s) for s in speeds / speeds.min())
    config.network.kind = 'ideal'
    if name == 'local_sgd':
      config.algorithm.local_steps = FLAGS.local_steps
    out[name] = simulate.simulate(config, iterations=400, nbytes=results['model_bytes'])['mean_iteration_time']
  return out


def report(results: dict, predicted: dict) -> str:
  counts = zip(results['mean_counts'], results['min_counts'])
  lines = [f"workers {results['workers']}, m = {results['microbatches']}, slowed process "
           f"{results['slow_process']} (+{results['slow_s'] * 1e3:.1f} ms per micro-batch); fitted call "
           f"c + n s: c {', '.join(f'{c * 1e3:.2f} ms' for c in results['overhead_s'])}, s "
           f"{', '.join(f'{s * 1e3:.2f} ms' for s in results['speeds_s'])}; nonblocking's micro-batches per "
           f"device, mean (min) {', '.join(f'{c:.2f} ({n})' for c, n in counts)}",
           '', '| algorithm | real min (ms/it) | real median | simulated | real median / simulated |',
           '|---|---|---|---|---|']
  for name in ALGORITHMS:
    real = np.asarray(results['per_iteration_s'][name])
    lines.append(f'| {name} | {real.min() * 1e3:.2f} | {np.median(real) * 1e3:.2f} | {predicted[name] * 1e3:.2f} '
                 f'| {np.median(real) / predicted[name]:.2f} |')
  return '\n'.join(lines)


def main(argv):
  if FLAGS.process_id >= 0:
    results = run_process()
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_index() == 0 and FLAGS.out:
      with open(FLAGS.out, 'w') as f:
        json.dump(results, f)
    return
  parse_slow(FLAGS.debug_slow_process, FLAGS.num_processes)  # a bad flag is refused before anything starts
  results = launch()
  predicted = predict(results)
  print(report(results, predicted))
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      json.dump({**results, 'simulated_s': predicted}, f, indent=1)


if __name__ == '__main__':
  define_flags()
  app.run(main)
