"""Limits before allocation: the worker layout and the memory the simulated clock of a config needs, checked
before anything is built (issue 59: `imagenet.py:sync,workers=1073741824` grew until the machine killed it).

The clock holds per worker a few float64 arrays of its state (times, speeds, the rule's buffers) and, for each
iteration of a block it draws, a dozen more (job times, finish and start times, idle time, the rule's
activation and group times): measured with `experiments.simulate` at P = 16,384 and 1,000 iterations a block,
WAGMA and non-blocking SGD (the largest) hold about 75 bytes per worker and iteration, sync 30.
`CLOCK_BYTES_PER_WORKER_ITERATION` rounds that up; no rule keeps a P x P table (the hop counts of
`rules/activation.py` are O(P) rows).
"""

from __future__ import annotations

from typing import Optional

import ml_collections

from waitless import config_errors as errors
from waitless import machine

CLOCK_BYTES_PER_WORKER = 2048  # the clock's and the rule's own state, per worker
CLOCK_BYTES_PER_WORKER_ITERATION = 12 * 8  # a dozen float64 (P,) planes per iteration of a block
MEMORY_SHARE = 0.8  # of the available memory: the rest is the interpreter's, the data's and other processes'


def clock_bytes(workers: int, block: int) -> float:
  """Bytes the simulated clock of `workers` workers holds while it draws a block of `block` iterations."""
  return float(workers) * (CLOCK_BYTES_PER_WORKER + CLOCK_BYTES_PER_WORKER_ITERATION * max(int(block), 1))


def check_workers(config: ml_collections.ConfigDict, ray: bool = False) -> None:
  """`workers` and `devices` integers >= 1, workers a multiple of devices (not on Ray, where every learner has a
  device of its own). Raises ConfigError naming the field."""
  for field in ('workers', 'devices'):
    errors.require_int(config[field], field, 1)
  errors.require(ray or config.workers % config.devices == 0, 'workers', config.workers,
                 f'must be a multiple of devices={config.devices}')


def check_clock_memory(config: ml_collections.ConfigDict, block: int, block_field: str,
                       available: Optional[int] = None, block_value=None) -> None:
  """Raises ConfigError when the clock of `config` (its `workers`) drawing blocks of `block` iterations needs more
  than `MEMORY_SHARE` of the memory available (`machine.available_memory_bytes()` unless given), before anything
  is allocated: naming `workers` when one iteration a block would not fit either, else `block_field` (the flag or
  field that sets the block, its value `block_value`, default `block`)."""
  available = machine.available_memory_bytes() if available is None else available
  if available is None:
    return
  need = clock_bytes(config.workers, block)
  if need <= MEMORY_SHARE * available:
    return
  field, value = (('workers', config.workers) if clock_bytes(config.workers, 1) > MEMORY_SHARE * available
                  else (block_field, block if block_value is None else block_value))
  raise errors.ConfigError(field, value, f'the simulated clock of {config.workers} workers drawing {block} '
                           f'iterations a block needs about {machine.gigabytes(need)}, more than this machine has '
                           f'for it ({machine.gigabytes(available)} available): use fewer workers'
                           + ('' if field == 'workers' else f' or a smaller {block_field}'))
