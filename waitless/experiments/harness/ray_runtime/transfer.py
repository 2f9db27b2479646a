"""A push and its reply through Ray, timed as the Ray runtime's learner pays them: `calibrate --ray_p2p_only`.

A learner of the Ray runtime (`worker.py`) pushes a gradient of M bytes to the server actor and waits for the
reply, a model of M bytes (`server.py`): two transfers through Ray's own transport (an argument or a return value
of more than 100 KB goes through the object store and Ray's object manager), not through gloo, whose
point-to-point figure the rest of the profile holds. `push_reply_rows` times that call: an actor on a node of its
own (the learner) calls a threaded actor on the node that holds `waitless_server` (the server's host on the test
bed, as `driver.py` pins the server) with an array of M bytes and gets one of M bytes back, back to back,
`repeats` calls per size, their median per size (on the bed one learner per host but the server's, pushing at
once: the server's link carries their pushes and replies together, in both directions, as in a run); the
profile's `network.ray_p2p` is the fit of the round trip to t = 2 alpha + 2 M / beta
(`calibration.fit_alpha_beta`), one direction's figures.

`cluster.factory.effective` charges it for the pushes and replies of a `runtime=ray` config; nothing else reads it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

import numpy as np

SERVER_RESOURCE = 'waitless_server'  # driver.py's: the node that holds it runs the server actor


class Echo:
  """The server's side: takes a push of M bytes, replies with a model of M bytes (made once per size)."""

  def __init__(self):
    self._models = {}

  def push(self, gradient: np.ndarray) -> np.ndarray:
    n = gradient.size
    if n not in self._models:
      self._models[n] = np.ones(n, np.float32)
    return self._models[n]


class Pusher:
  """The learner's side: for each size, `warm` calls, then `repeats` timed push-and-reply calls back to back."""

  def run(self, server, sizes: Sequence[int], repeats: int, warm: int = 2) -> list[float]:
    import ray  # only inside a Ray worker process
    medians = []
    for nbytes in sizes:
      gradient = np.full(max(1, int(nbytes) // 4), 0.5, np.float32)
      for _ in range(warm):
        ray.get(server.push.remote(gradient))
      seconds = []
      for _ in range(repeats):
        begin = time.perf_counter()
        ray.get(server.push.remote(gradient))
        seconds.append(time.perf_counter() - begin)
      medians.append(float(np.median(seconds)))
    return medians


def push_reply_rows(sizes: Sequence[int], rounds: int, repeats: int, pushers: int = 1) -> list[list[float]]:
  """Per round, the median seconds of one push-and-reply at each of `sizes` bytes, on the Ray cluster this process
  is connected to (`ray.init` done): the server actor pinned to `SERVER_RESOURCE` if a node has it, `pushers`
  learners of one CPU each pushing at once (on the bed, one per learner host: the server's link carries their
  pushes and replies together, in both directions, as a run's learners make it), the median over them."""
  import ray
  pinned = {'resources': {SERVER_RESOURCE: 1e-3}} if ray.cluster_resources().get(SERVER_RESOURCE) else {}
  server = ray.remote(num_cpus=0, max_concurrency=pushers + 4, **pinned)(Echo).remote()
  actors = [ray.remote(num_cpus=1)(Pusher).remote() for _ in range(pushers)]
  rows = []
  for _ in range(rounds):
    each = ray.get([a.run.remote(server, list(sizes), repeats) for a in actors])
    rows.append(np.median(np.asarray(each, np.float64), axis=0).tolist())
  return rows


def runtime_pairs(arg: str, learners: int, steps: int) -> str:
  """The config argument's pairs of `runtime_update_s`' run: async on Ray with `learners`, the user's pairs of
  `arg` (calibrate's --config after ':') but the keys the run sets itself."""
  own = ['runtime=ray', f'workers={learners}', 'microbatches=1', f'num_steps={steps}', f'eval_every={steps}',
         'log_every=10', f'checkpoint_every={steps}', 'cluster.profile=""']
  keys = {pair.split('=', 1)[0] for pair in own} | {'devices'}
  user = [p for p in arg.split(',')[1:] if p and p.split('=', 1)[0].strip() not in keys]
  return ','.join(['async'] + user + own)


def runtime_update_s(config_arg: str, flags_: Sequence[str], learners: int, steps: int, workdir: str,
                     address: str | None) -> float:
  """Median measured seconds per server update (rows after the first) of the Ray runtime's async SGD with
  `learners` learners on the Ray cluster at `address` (None: a local Ray of the run's own), the driver here (on the
  bed, host 0, where a run's is)."""
  import json
  path, _, arg = config_arg.partition(':')
  argv = [sys.executable, '-m', 'waitless.experiments.main', f'--config={path}:{runtime_pairs(arg, learners, steps)}',
          *flags_, f'--workdir={workdir}', *([f'--ray_address={address}'] if address else [])]
  done = subprocess.run(argv, capture_output=True, text=True, check=False,
                        env=dict(os.environ, RAY_AUTH_MODE='disabled'))
  if done.returncode:
    raise RuntimeError(f'the Ray runtime\'s run failed (status {done.returncode}): {done.stderr[-1500:]}')
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  steps_ = np.array([r['step'] for r in rows], np.float64)
  times = np.array([r['measured_time'] for r in rows], np.float64)
  return float(np.median(np.diff(times) / np.diff(steps_)))


WAIT_S = 120.0


@contextlib.contextmanager
def bed_cluster(bed, popen):
  """Ray's head on host 0 (holding `SERVER_RESOURCE`, no CPU) and a node of one CPU on every other host of the test
  bed, as `experiments.testbed -- ray` starts them, and this process connected to it; everything stopped on exit."""
  import ray
  from waitless.experiments.harness.testbed import bed as bed_lib
  from waitless.experiments.harness.testbed import runs
  env = dict(os.environ, RAY_AUTH_MODE='disabled')
  os.environ['RAY_AUTH_MODE'] = 'disabled'
  procs = []
  with tempfile.TemporaryDirectory(prefix='calibrate_ray_') as tmp:
    try:
      for i in range(bed.spec.hosts):
        procs.append(popen(i, runs.ray_node_argv(bed.spec.hosts, i, 1, os.path.join(tmp, f'h{i}')), env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
      address = f'{bed_lib.address(0)}:{runs.RAY_PORT}'
      deadline = time.monotonic() + WAIT_S
      while True:
        try:
          ray.init(address=address, logging_level='ERROR', log_to_driver=False)
          break
        except (ConnectionError, RuntimeError):
          if time.monotonic() > deadline:
            raise
          time.sleep(1.0)
      while sum(n['Alive'] for n in ray.nodes()) < bed.spec.hosts:
        if time.monotonic() > deadline:
          raise RuntimeError(f'the bed\'s Ray cluster has {sum(n["Alive"] for n in ray.nodes())} of '
                             f'{bed.spec.hosts} nodes')
        time.sleep(0.5)
      yield address
    finally:
      with contextlib.suppress(Exception):
        ray.shutdown()
      for proc in procs:  # `ray start --block` stops the daemons it started on SIGTERM
        _signal_group(proc, signal.SIGTERM)
      for proc in procs:
        try:
          proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
          _signal_group(proc, signal.SIGKILL)
          proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(proc.pid, sig)


@contextlib.contextmanager
def local_cluster():
  """A local Ray of two CPUs with `SERVER_RESOURCE` (off the bed: the transfers cross no link)."""
  import ray
  ray.init(address='local', num_cpus=2, resources={SERVER_RESOURCE: 1}, include_dashboard=False, logging_level='ERROR',
           log_to_driver=False)
  try:
    yield None
  finally:
    ray.shutdown()


def main() -> None:  # a quick look: python -m waitless.experiments.harness.ray_runtime.transfer SIZE...
  sizes = [int(s) for s in sys.argv[1:]] or [4096, 65536, 1048576]
  with local_cluster():
    print(push_reply_rows(sizes, 1, 10))


if __name__ == '__main__':
  main()
