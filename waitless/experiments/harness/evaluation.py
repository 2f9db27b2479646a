"""Evaluation of the consensus model of a run or a group (`Evaluator`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from waitless.experiments.harness import block_program
from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import setup
from waitless.experiments.harness import step as step_lib
from waitless.experiments.harness import xla_cpu


class Evaluator:
  """evaluate(state) -> {'eval_loss', 'eval_accuracy', 'param_norm', and the task's extra metrics} of the
  algorithm's consensus model; for a group of R > 1, a list of R such dicts, one evaluation program for all of
  them (the evaluation split does not depend on the seed).

  In two halves: `consensus(state)` dispatches the consensus model's computation, a new array (the loop may then
  dispatch the next block, which donates `state`: the runtime lets this read finish first), and `measure` of
  that snapshot evaluates it while the next block runs.
  """

  def __init__(self, consensus, measure):
    self.consensus, self.measure = consensus, measure

  def __call__(self, state):
    return self.measure(self.consensus(state))


def make_evaluator(run_or_group) -> Evaluator:
  """The `Evaluator` of a run or group."""
  group = setup.as_group(run_or_group)
  run = group.lead

  def consensus_and_norm(state):
    params = run.spec.consensus(state.params, state.opt_state)
    model_state = jax.tree.map(lambda x: jnp.mean(x, axis=0).astype(x.dtype), state.model_state)
    return params, model_state, step_lib.tree_l2(params)  # the norm here: no op-by-op compiles on the host

  def sums_fn(params, model_state, batch):
    return run.task.eval_sums(run.model, params, model_state, batch)

  if group.batched:
    one_sums = sums_fn
    consensus_and_norm = jax.vmap(consensus_and_norm)  # means and a norm: no convolution

    def sums_fn(params, model_state, batch):  # every replica on the same batch
      one = lambda p, m: one_sums(p, m, batch)
      vectorized = xla_cpu.vectorize_replicas(run.layout.platform, one, params, model_state)
      return block_program.map_replicas(one, vectorized)(params, model_state)
  consensus = jax.jit(consensus_and_norm, out_shardings=run.layout.replicated())
  sums = jax.jit(sums_fn, out_shardings=run.layout.replicated())
  place = lambda x: jax.device_put(x, run.layout.replicated())
  devices = run.layout.devices

  def spread(batch):
    """The batch split over the devices (each evaluates its share; the sums are all-reduced), padded with
    masked examples to a multiple of the device count: not every device evaluating all of it."""
    pad = -len(batch['mask']) % devices
    if pad:
      batch = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}
    return jax.device_put(batch, run.layout.sharding())

  def measure(snapshot):
    params, model_state, param_norm = snapshot
    total = {'loss_sum': 0.0, 'correct': 0.0, 'count': 0.0}
    for batch in run.dataset.eval_batches(run.config.eval_batch_size):
      for k, v in block_step_lib.to_host(sums(params, model_state, spread(batch))).items():
        total[k] = total[k] + np.asarray(v, np.float64)
    norms = np.asarray(block_step_lib.to_host(param_norm), np.float64)
    per_replica = []
    for r in range(group.size):
      pick = (lambda x: x) if not group.batched else (lambda x, r=r: x[r])
      count = max(float(pick(total['count'])), 1.0)
      metrics = {'eval_loss': float(pick(total['loss_sum'])) / count,
                 'eval_accuracy': float(pick(total['correct'])) / count, 'param_norm': float(pick(norms))}
      if run.task.extra_eval is not None:
        metrics.update(run.task.extra_eval(run.model, jax.tree.map(pick, params), run.dataset,
                                           group.runs[r].config, place))
      per_replica.append(metrics)
    return per_replica if group.batched else per_replica[0]

  return Evaluator(consensus, measure)


