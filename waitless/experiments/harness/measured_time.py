"""Real time instead of the simulator: `config.stragglers.kind = 'measured'` (one switch).

  python -m waitless.experiments.main --config=experiments/configs/digits.py:nonblocking,stragglers.kind=measured,\
workers=2,devices=2,microbatches=4 --workdir=/tmp/nb_measured
  bash launch/multiprocess_cpu.sh 2 --config=experiments/configs/digits.py:nonblocking,stragglers.kind=measured,\
workers=2,devices=2,microbatches=4 --workdir=/tmp/nb_2p --debug_slow_process=1:0.004   # TEST-ONLY slowdown

Nothing is simulated. The run's clock (`measured_time` in metrics.jsonl and summary.json, `time_to_target`;
summary.json says `"clock": "measured"`) is the measured training time of this process (each process of a
multi-process run measures its own, and only process 0 writes the files: they hold process 0's): per block, the
host's work to prepare it (schedules, data, transfers) plus the time from its dispatch until its results are
ready. Evaluation, checkpoints (waited for before the next block, so that they do not run under it) and metrics
are left out, and so is the all-gather that brings the block's measurements to every host (it compiles once
per block length); so is compilation: a block whose call compiled a program is counted from when the program
started on this process's devices (the `Stopwatch` reads), not from its dispatch. While a block runs, the
host thread only waits (no lookahead, the evaluation's consensus model taken after the block): the clock reads
inside the program need the Python lock.

Schedules: an algorithm whose time rule is the synchronous schedule runs it as on a real lock-step cluster:
its rule is driven by a clock on which every worker takes the same constant time (`cluster/factory.py`:
'measured' builds no straggler model), so every worker finishes its m micro-batches and the rule's periodic
events (averaging periods, WAGMA's groups, MATCHA's draws) come out as they would anyway. `nonblocking` is the
exception that makes the mode worth having: worker w's `microbatches_done` is `MeasuredSpeeds.counts()` of its
device (`harness/measured_speeds.py`, the one place counts are computed), and the step loops over exactly
those micro-batches (`finished_only`: a `while_loop` with a per-device trip count), so a slow device really
computes less. Rules that need simulated events (who finishes first, stale views, cancelled jobs, an adaptive
K) are refused before anything compiles (`REFUSED` says why for each).

Measuring a device inside a lock-step program: the program's collectives make every process's call as long
as the slowest device's, so each device's gradient phase is timed from inside the program, by host clock reads
on that device right before and right after its gradients, before the update's collectives
(`Stopwatch`, below, which says why it is chosen over two calls per iteration). The seconds and
counts of every device reach every process with the block's measurements (one all-gather), so every process
feeds the same table to `MeasuredSpeeds.observe_calls` and computes the same counts. The first measured
iteration of a process is not fed (first execution of a program); then, as `MeasuredStep` does, the counts
follow the probe (m, then 1 on every device: the fit's two sizes), one iteration per block. After that a
block has its usual length (`steps_per_call`) and its counts are those of the speeds when it starts: they
follow a change of speed one block late, and the per-block host work (schedules, data, the all-gather of the
measurements) is paid once per block, as in any run. The loop never dispatches a block before it read the
previous one's (no lookahead, for every algorithm in this mode: the counts need the last block's times, and
the clock times one block at a time).

Resume: the speed estimates are not checkpointed; a resumed run probes again (the process may be on other
hardware, or the slowdown gone). The checkpoint keeps the measured time so far and the schedule clock.

Metrics: besides the usual rows, `microbatches_done` (per worker, the mean over the row's window),
`compute_s` (the mean measured gradient-phase seconds of a device per iteration); `idle_fraction` is
measured: the share of an iteration a device did not spend in its gradient phase (waiting at the collectives,
communicating, host work), each iteration of a block taken as the block's mean. summary.json adds the fitted
per-device `measured_seconds_per_microbatch` and `measured_overhead_s` (c_d + n s_d).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from waitless import config_errors as errors
from waitless.experiments.harness import measured_speeds
from waitless.algorithms import nonblocking
from waitless.cluster import factory as cluster_factory

KIND = cluster_factory.MEASURED

# Algorithms whose time rule is the synchronous schedule (every worker m micro-batches; the rule's events are
# periodic or the algorithm's own draws), and nonblocking, whose counts come from measured speeds.
ALLOWED = ('sync', 'local_sgd', 'diloco', 'streaming_diloco', 'dasgd', 'dpsgd', 'matcha', 'wagma', 'lap_sgd',
           'lpp_sgd', 'nonblocking')
_PARAMETER_SERVER = ('a parameter server that applies the first finishers (the K of P, or one at a time) needs '
                     'simulated finish times: stale views and cancelled jobs exist only in simulated time')
REFUSED = {
    'ksync': _PARAMETER_SERVER,
    'kbatch_sync': _PARAMETER_SERVER,
    'kasync': _PARAMETER_SERVER,
    'kbatch_async': _PARAMETER_SERVER,
    'async': _PARAMETER_SERVER,
    'ringmaster': _PARAMETER_SERVER + ' (and which gradients to discard)',
    'adasync': _PARAMETER_SERVER + ' (and its K adapts to the simulated loss over simulated time)',
}


def is_measured(config: ml_collections.ConfigDict) -> bool:
  return config.stragglers.get('kind') == KIND


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises config_errors.ConfigError (naming stragglers.kind) for an algorithm that cannot run on measured time."""
  if not is_measured(config):
    return
  name = config.algorithm.name
  if name in REFUSED:
    raise errors.ConfigError('stragglers.kind', KIND, f'{name} cannot run on measured time: {REFUSED[name]}; '
                             f'allowed: {", ".join(ALLOWED)}')
  errors.require(name in ALLOWED, 'stragglers.kind', KIND,
                 f'{name} is not known to run on measured time; allowed: {", ".join(ALLOWED)}')
  if name in ('lap_sgd', 'lpp_sgd'):
    errors.require(config.algorithm.delay is not None, 'algorithm.delay', None,
                   f'{name} on measured time needs an explicit delay d (None takes it from the simulated network)')


def counts_measured(config: ml_collections.ConfigDict) -> bool:
  """Whether the run's micro-batch counts come from measured speeds (measured nonblocking)."""
  return is_measured(config) and config.algorithm.name == 'nonblocking'


def reports(config: ml_collections.ConfigDict) -> dict[str, str]:
  """What a measured run adds to the metrics window (name -> reduction), besides the rule's own."""
  return {'compute_s': 'mean', **{f'microbatches_w{i}': 'mean' for i in range(config.workers)}}


def finish_row(row: dict[str, Any], workers: int) -> dict[str, Any]:
  """A metrics row of a measured run: the per-worker counts as one list, `microbatches_done`."""
  counts = [row.pop(f'microbatches_w{i}') for i in range(workers) if f'microbatches_w{i}' in row]
  return {**row, **({'microbatches_done': counts} if counts else {})}


class MeasuredClock:
  """The clock of a measured run: the rule's synchronous schedules, nonblocking's measured counts, real time.

  The training loop calls `next_block(n)` before a block (schedules), then `record(block, compute_s,
  seconds)` once its measurements are on the host: the block with its measured times, the speeds updated.
  `measured_time`: the measured training seconds so far; each recorded block's `sim_time` holds them too (the
  `cluster.clock.Block` field the loop reads for any clock).
  """

  uses_feedback = False

  def __init__(self, config: ml_collections.ConfigDict, rule, model_bytes: float, devices: int):
    validate(config)
    self.schedules = cluster_factory.make_clock(config, rule, model_bytes)  # every worker equally fast
    self.workers, self.devices = config.workers, devices
    self.local = config.workers // devices
    self.microbatches = config.microbatches
    self.counted = config.algorithm.name == 'nonblocking'
    a = config.algorithm
    self.deadline_s = float(a.deadline_s) if self.counted and a.trigger == 'deadline' else None
    self.measured_time = 0.0
    self._fresh_speeds()

  def _fresh_speeds(self) -> None:
    m = self.microbatches
    self.speeds = measured_speeds.MeasuredSpeeds(
        self.devices, m, deadline_s=self.deadline_s, probe=(m, 1) if self.counted and m > 1 else ())
    self._unfed = 1  # the first measured iteration of this process (the program's first execution): not fed

  def counts(self) -> np.ndarray:
    """int32 (P,): each worker's micro-batches next iteration (its device's `MeasuredSpeeds.counts()`)."""
    if not self.counted:
      return np.full(self.workers, self.microbatches, np.int32)
    return np.repeat(self.speeds.counts(), self.local).astype(np.int32)

  @property
  def probing(self) -> bool:
    """Whether the speeds still need single measurements: the first, not fed, then the probe's sizes."""
    return self.counted and self._unfed + len(self.speeds.probe) > self.speeds.observations

  def next_block(self, n: int):
    """The next iterations' schedules (`cluster.clock.Block`; its times are filled by `record`): n of them,
    or 1 while `probing` (each probe size is one measured iteration; the loop runs the block it gets)."""
    n = 1 if self.probing else n
    block = self.schedules.next_block(n)
    if self.counted:
      done = np.broadcast_to(self.counts(), (n, self.workers))
      # The rule's reports describe its own (equal-speed) schedule: these are the counts that run. Nothing is
      # abandoned: a device never starts a micro-batch it will not finish.
      reported = {'microbatches_mean': done.mean(axis=1), 'microbatches_min': done.min(axis=1).astype(np.float64),
                  'abandoned_share': np.zeros(n)}
      block = dataclasses.replace(block, schedule=nonblocking.round_schedule(done, self.microbatches),
                                  measurements={**block.measurements, **reported})
    return block

  def record(self, block, compute_s: np.ndarray, seconds: float):
    """`block` with its measured times, and the speeds fed with every device's gradient phase.

    Args:
      block: what `next_block` returned.
      compute_s: float (n, P): the seconds of each iteration's gradient phase on each worker's device
        (the step's `compute_s`, the same for the workers of a device).
      seconds: the block's measured training seconds (see the module docstring).
    """
    begin = time.perf_counter()
    done = np.asarray(block.schedule.microbatches_done)
    n = done.shape[0]
    per_device = np.asarray(compute_s, np.float64)[:, ::self.local]
    ran = done[:, ::self.local]
    for k in range(n):
      if self._unfed:
        self._unfed -= 1
      elif np.all(per_device[k] > 0):  # a read that rounds to 0 (no work timed) carries no speed
        self.speeds.observe_calls(ran[k], per_device[k])
    seconds = seconds + (time.perf_counter() - begin)  # the fit is the algorithm's host work
    durations = np.full(n, seconds / n)
    sim_time = self.measured_time + np.cumsum(durations)
    self.measured_time = float(sim_time[-1])
    idle = np.maximum(durations[:, None] - np.asarray(compute_s, np.float64), 0.0)
    measurements = {**block.measurements, 'compute_s': per_device.mean(axis=1),
                    **{f'microbatches_w{i}': done[:, i].astype(np.float64) for i in range(self.workers)}}
    return dataclasses.replace(block, duration=durations, sim_time=sim_time, idle=idle,
                               idle_fraction=idle.sum(axis=1) / (self.workers * durations),
                               measurements=measurements)

  def feedback(self, **measurements: float) -> None:
    del measurements  # no rule allowed here adapts to the loss

  def state_dict(self) -> dict[str, Any]:
    return {'schedules': self.schedules.state_dict(), 'measured_time': self.measured_time}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores the schedule clock and the measured time; the speeds are probed again (module docstring)."""
    self.schedules.load_state_dict(state['schedules'])
    self.measured_time = float(state['measured_time'])
    self._fresh_speeds()

  def summary(self) -> dict[str, Any]:
    """summary.json's fields of a measured run."""
    seconds = self.speeds.seconds
    return {'measured_seconds_per_microbatch': None if seconds is None else [float(s) for s in seconds],
            'measured_overhead_s': [float(c) for c in self.speeds.overhead]}


def block_seconds(prepared_s: float, dispatched: float, ready: float, compiled: bool,
                  started_s: Optional[np.ndarray]) -> float:
  """A block's measured training seconds: its host preparation, then dispatch to results on the host; from the
  program's first read on this process's devices (`started_s`, seconds after `dispatched`) if the call
  compiled."""
  if compiled and started_s is not None and np.size(started_s):
    return prepared_s + max(ready - (dispatched + float(np.min(started_s))), 0.0)
  return prepared_s + (ready - dispatched)


class Stopwatch:
  """The host's clock read inside the block program, around each iteration's gradient phase (measured time).

  One lock-step program cannot time a device from outside: its collectives make every process's call last as long as
  the slowest device's. So the program reads the host clock on each device (a `pure_callback`) right before the
  iteration's gradients and right after them, before the update's collectives: the difference is that device's own
  compute time, its wait at the collectives excluded. Each read is tied into the dataflow both ways, by data
  dependencies the compiler cannot drop: its argument is a scalar that depends on every leaf it guards (the first
  element of each: nothing large is copied to the host), and every leaf that comes out is `where(seconds < 0, 0,
  leaf)` (never true, but the compiler cannot know): the gradients take the parameters that come out of the first
  read, so they cannot start before it, and the update's collectives take the gradient sums that come out of the
  second, so the read cannot slip past them (an `optimization_barrier` does not order a read against the all-reduce
  inside the block's scan). The selects cost one elementwise pass over the state and the gradients per iteration.
  Reads are seconds since `start()`, which the caller calls right before each dispatch (so float32 keeps
  microseconds); a second dispatch before the first finished would mix origins (the measured training loop never looks
  ahead). A read needs the host's Python lock: while the host thread compiles or runs Python, a read waits for it (the
  loop waits for the block's results with the lock released).

  Against two calls per iteration (a gradient call timed on the host, then the update call, as `MeasuredStep` does),
  the block program stays one dispatch for n iterations, the simulated run's program plus two host reads per iteration
  and device, and every device is timed on its own.
  """

  def __init__(self):
    self.origin = time.perf_counter()

  def start(self) -> None:
    self.origin = time.perf_counter()

  def _read(self, _) -> np.ndarray:
    return np.float32(time.perf_counter() - self.origin)

  def stamp(self, tree):
    """(tree, seconds since `start`): the read taken once every leaf of `tree` is computed, and every numeric
    leaf of the returned tree computed only after it."""
    numeric = lambda x: x.size and jnp.issubdtype(x.dtype, jnp.number)
    token = sum((x.ravel()[0].astype(jnp.float32) for x in jax.tree.leaves(tree) if numeric(x)),
                jnp.zeros((), jnp.float32))
    seconds = jax.pure_callback(self._read, jax.ShapeDtypeStruct((), jnp.float32), token)
    after = lambda x: jnp.where(seconds < 0, jnp.zeros_like(x), x) if numeric(x) else x
    return jax.tree.map(after, tree), seconds
