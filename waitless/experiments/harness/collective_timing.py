"""One process of the collectives' measurement (`measure.collective_rows` starts N): times a real CPU mesh's.

  python -m waitless.experiments.harness.collective_timing --coordinator_address=127.0.0.1:PORT \
      --num_processes=N --process_id=I --out=FILE.json    # N of these, started by measure.collective_rows

Every process owns one CPU device and joins `jax.distributed` (gloo over loopback, as
`launch/multiprocess_cpu.sh` runs the harness). For each participant count n in 2..N (the first n processes'
devices; the others wait) and each size, one jitted program runs k collectives back to back inside a
`lax.fori_loop`, each on the previous one's result; its time at k = 1 and k = 1 + `--chain` gives one
collective's seconds as the slope, (t(1 + chain) - t(1)) / chain, free of the program's dispatch (the chain and
the repetitions adapted to what one collective costs, `Adaptive`):
  all-reduce    `lax.psum` over the n devices (gloo's all-reduce: what the harness's worker sum runs)
  point-to-point a ring shift `lax.ppermute` (every device sends its array to the next; n = N only)
Every figure is the median of up to `--repeats` timings (within `--budget_s`), measured in `--rounds` rounds (the
spread of the fits).
Process 0 writes {"allreduce": [[round, n, bytes, seconds], ...], "p2p": [[round, bytes, seconds], ...]}.
"""

from __future__ import annotations

import json
import sys
from typing import NamedTuple

from absl import app
from absl import flags

_COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'HOST:PORT of process 0.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes, N >= 2.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, 0..N-1.')
_OUT = flags.DEFINE_string('out', None, 'JSON file process 0 writes.')
_SIZES = flags.DEFINE_list('sizes', ['1024', '65536', '1048576', '4194304'], 'Bytes per collective (float32).')
_CHAIN = flags.DEFINE_integer('chain', 16, 'The most collectives chained in the longer program.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'The most timed calls per program and figure (the median is kept).')
_BUDGET = flags.DEFINE_float('budget_s', 1.5, 'Seconds of timed calls per figure (chain and calls adapt to it).')
_MAX_CALL = flags.DEFINE_float('max_call_s', 0.5, 'Sizes whose one collective takes longer are not timed.')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Rounds of every measurement (the spread of the fitted figures).')


def _programs(mesh, kind: str, count: int):
  """A jitted program of `count` chained collectives of `kind` over `mesh`'s one axis."""
  import jax
  from jax import lax
  from jax.sharding import PartitionSpec
  n = mesh.size

  def one(x):
    if kind == 'allreduce':
      return lax.psum(x, 'workers') / n
    return lax.ppermute(x, 'workers', [(i, (i + 1) % n) for i in range(n)])

  def body(x):
    return lax.fori_loop(0, count, lambda _, y: one(y), x)

  spec = PartitionSpec('workers')
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def _agree(mesh):
  """A jitted program: the mean over `mesh`'s processes of one float each, the same on all of them (an all-reduce),
  so that choices made from a timing (the chain, the repetitions, the sizes kept) are every process's."""
  import jax
  from jax import lax
  from jax.sharding import PartitionSpec
  n = mesh.size
  spec = PartitionSpec('workers')
  return jax.jit(jax.shard_map(lambda v: lax.psum(v, 'workers') / n, mesh=mesh, in_specs=spec, out_specs=spec,
                               check_vma=False))


class Adaptive(NamedTuple):
  """How much timing each figure gets: every figure about `budget_s`, whatever one collective costs."""
  chain: int           # the most collectives chained in the longer program
  repeats: int         # the most timed calls per program (the median is kept)
  budget_s: float      # the seconds one figure's timed calls may take
  max_call_s: float    # a size whose one collective takes longer is not timed, nor any larger one
  min_repeats: int = 3

  def choose(self, seconds: float) -> tuple[int, int]:
    """(chain, repeats) for a collective of `seconds`: the longer program about a tenth of the budget, the calls
    the budget allows, within the limits."""
    chain = int(min(self.chain, max(1, 0.1 * self.budget_s / max(seconds, 1e-9))))
    repeats = int(min(self.repeats, max(self.min_repeats, self.budget_s / (max(seconds, 1e-9) * (2 + chain)))))
    return chain, repeats


def time_collectives(processes: int, sizes: list[int], adaptive: Adaptive, rounds: int) -> dict:
  """Every process calls it; returns the rows (the same on every process of each mesh).

  Per figure one collective is probed first (after its compilation), its seconds agreed over the mesh, and the
  chain and the repetitions chosen from them (`Adaptive.choose`): a shaped link's megabytes cost as much timing
  as loopback's kilobytes, not a hundred times more. Sizes from the first whose collective exceeds
  `adaptive.max_call_s` on are left out (their bandwidth is the smaller sizes').
  """
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  from waitless.experiments.harness import measure
  devices = sorted(jax.devices(), key=lambda d: d.process_index)
  rows = {'allreduce': [], 'p2p': []}
  for round_ in range(rounds):
    for n in range(2, processes + 1):
      kinds = ('allreduce', 'p2p') if n == processes else ('allreduce',)
      if jax.process_index() >= n:
        continue
      mesh = Mesh(np.array(devices[:n]), ('workers',))
      sharding = NamedSharding(mesh, PartitionSpec('workers'))
      agree = _agree(mesh)
      for kind in kinds:
        short = _programs(mesh, kind, 1)
        for nbytes in sizes:
          local = np.ones((1, max(1, nbytes // 4)), np.float32)
          x = jax.make_array_from_process_local_data(sharding, local, (n, local.shape[1]))
          probe = measure.time_callable(short, x, warmup=1, repeats=1)
          mine = jax.make_array_from_process_local_data(sharding, np.full((1, 1), probe, np.float32), (n, 1))
          probe = float(np.asarray(agree(mine).addressable_shards[0].data).ravel()[0])
          if probe > adaptive.max_call_s:
            break
          chain, repeats = adaptive.choose(probe)
          long = _programs(mesh, kind, 1 + chain)
          t1 = measure.time_callable(short, x, warmup=0, repeats=repeats)
          tk = measure.time_callable(long, x, warmup=1, repeats=repeats)
          seconds = (tk - t1) / chain  # <= 0 when noise exceeds the cost: calibration.fit_network drops it
          rows[kind].append([round_, n, nbytes, seconds] if kind == 'allreduce' else [round_, nbytes, seconds])
  return rows


def main(argv):
  del argv
  from waitless.experiments import shared_flags
  from waitless.experiments.harness import distributed
  shared_flags.force_host_devices(1)
  settings = distributed.settings_from(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  processes = distributed.initialize(settings)
  adaptive = Adaptive(_CHAIN.value, _REPEATS.value, _BUDGET.value, _MAX_CALL.value)
  rows = time_collectives(processes, [int(s) for s in _SIZES.value], adaptive, _ROUNDS.value)
  if distributed.process_index() == 0:
    with open(_OUT.value, 'w') as f:
      json.dump(rows, f)
  sys.stdout.flush()


if __name__ == '__main__':
  app.run(main)
