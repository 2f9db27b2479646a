"""How a Ray run's learners are placed: how many learner processes, which learners each hosts, and the memory
they will hold, planned before any process starts (`plan`); a plan that does not fit is one line with its figures.

A learner process (`worker.LearnerActor`) is Python, JAX and the compiled gradient, about
`PROCESS_RESIDENT_BYTES` whatever it hosts; each learner in it adds its view, its gradient and the reply being
read (`LEARNER_MODEL_COPIES` models). The server is one more process holding one model, not P
(`SERVER_MODEL_COPIES`: W, the inner optimizer's state, the update's gradient total, the reply being sent). So
the memory of a run grows with the processes and with P small copies of the model, and 256 learners of a small
model fit a laptop in a few processes.

`ray.learners_per_process` sets the learners per process; unset, it is planned: one learner per process when
learners reserve GPUs (`ray.worker_gpus` > 0: a device each), otherwise as many processes as the CPUs Ray may
give learners (`ray.worker_cpus` each when set, else the CPUs left by the server), at most P, and at most what
the memory holds, the learners shared among them as evenly as contiguous blocks allow.

Pure arithmetic: no JAX, no Ray (`driver.py` reads the machine's or the cluster's figures and calls `plan`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from waitless import config_errors as errors
from waitless import machine

# About 400 MB resident for a learner process of the digits model (issue 59: 64 one-learner processes on a 2-core
# laptop took about 26 GB); the model copies come on top. A local Ray's own daemons (raylet, GCS, the workers'
# pool) about half a gigabyte.
PROCESS_RESIDENT_BYTES = 400e6
LEARNER_MODEL_COPIES = 4
SERVER_MODEL_COPIES = 4
RAY_DAEMONS_BYTES = 500e6
MEMORY_SHARE = 0.8  # of the memory available: the driver (the evaluation, the checkpoints) needs the rest


@dataclasses.dataclass(frozen=True)
class Plan:
  """Attributes:
    learners: P.
    per_process: learners hosted by each learner process (the last may host fewer).
    processes: learner processes, ceil(P / per_process).
    memory_bytes: what the server's and the learners' processes hold (Ray's daemons not included).
  """
  learners: int
  per_process: int
  processes: int
  memory_bytes: float

  def groups(self) -> list[list[int]]:
    """The learners of each process: contiguous blocks of `per_process`."""
    return [list(range(j * self.per_process, min(self.learners, (j + 1) * self.per_process)))
            for j in range(self.processes)]

  def describe(self) -> str:
    return (f'{self.learners} learners in {self.processes} process{"es" if self.processes > 1 else ""} of '
            f'{self.per_process}')


def memory_bytes(learners: int, processes: int, model_bytes: float) -> float:
  """The server's and the learner processes' memory: processes + 1 processes, P learners' and one server's models."""
  return ((processes + 1) * PROCESS_RESIDENT_BYTES + learners * LEARNER_MODEL_COPIES * model_bytes
          + SERVER_MODEL_COPIES * model_bytes)


def _fits(processes: int, learners: int, model_bytes: float, budget: Optional[float]) -> bool:
  return budget is None or memory_bytes(learners, processes, model_bytes) <= budget


def plan(config, model_bytes: float, cpus: float, available_bytes: Optional[float] = None,
         daemons_bytes: float = 0.0, where: str = 'this machine') -> Plan:
  """The placement of `config.workers` learners on `cpus` CPUs and `available_bytes` of memory (None: unknown).

  Raises:
    errors.ConfigError: one line naming the field (`ray.learners_per_process` when it was set, else `workers`)
      with the figures (processes, memory needed and available, CPUs), when the plan does not fit.
  """
  p, r = config.workers, config.ray
  budget = None if available_bytes is None else MEMORY_SHARE * available_bytes - daemons_bytes
  per_process = r.get('learners_per_process')
  field, value = ('ray.learners_per_process', per_process) if per_process is not None else ('workers', p)
  if per_process is None:
    if r.worker_gpus > 0:
      processes = p
    else:
      free = max(cpus - r.server_cpus, 1.0)
      processes = int(free // r.worker_cpus) if r.worker_cpus is not None else int(math.floor(free))
      processes = max(1, min(p, processes))
      while processes > 1 and not _fits(processes, p, model_bytes, budget):
        processes -= 1
    per_process = math.ceil(p / processes)
  processes = math.ceil(p / per_process)
  result = Plan(p, per_process, processes, memory_bytes(p, processes, model_bytes))
  if budget is not None:
    errors.require(result.memory_bytes <= budget, field, value,
                   f'{result.describe()} and the server are {processes + 1} processes of about '
                   f'{machine.gigabytes(PROCESS_RESIDENT_BYTES)} each and {p + 1} models\' copies, '
                   f'{machine.gigabytes(result.memory_bytes + daemons_bytes)} in all, more than {where} has '
                   f'({machine.gigabytes(available_bytes)} available, {cpus:g} CPUs): use fewer workers, more '
                   'learners per process (ray.learners_per_process), or a Ray cluster (--ray_address)')
  if r.worker_cpus is not None:
    wanted = processes * r.worker_cpus + r.server_cpus
    errors.require(wanted <= cpus + 1e-9, field, value,
                   f'{result.describe()} and the server need {wanted:g} CPUs (ray.worker_cpus={r.worker_cpus:g} '
                   f'per process, ray.server_cpus={r.server_cpus:g}), {where} has {cpus:g}: use more learners per '
                   'process (ray.learners_per_process), or a smaller ray.worker_cpus (fractions share a CPU)')
  return result
