"""Uniform schedule fields and the step number stay unbatched, so conditionals stay conditionals under vmap.

When several workers share a device they are vmapped; a per-worker predicate would turn `lax.cond` into a
select that runs every branch, collectives included (local SGD would all-reduce on every iteration). The
compiled block step is inspected: the averaging all-reduce must sit inside a conditional's branch, with one
and with two workers per device. The same step fed a per-worker counter instead of the step number (what the
harness did before) loses the conditional: the check can fail.
"""


from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import optax

from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import inputs as inputs_lib
from waitless.experiments.harness import setup
from waitless.experiments.harness import xla_cpu
from tests import harness
from tests import hlo


def without_step(tx: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
  """`tx` as called before the core contract: no replicated `step`, so local SGD reads its per-worker count."""
  def update(grads, state, params=None, *, step=None, **extra):
    del step
    return tx.update(grads, state, params, **extra)
  return optax.GradientTransformationExtraArgs(tx.init, update)


def compiled_block_step(arg: str, workers: int, devices: int, drop_step: bool = False, n: int = 4,
                        rounds: bool | None = None) -> hlo.Hlo:
  config = harness.synthetic_config(arg, workers=workers, devices=devices, steps_per_call=n)
  run = setup.build(config)
  if drop_step:
    run.tx = without_step(run.tx)
  state = setup.init_state(run)
  _, nbytes = setup.param_count_and_bytes(state.params)
  block = setup.clock_for(run, nbytes).next_block(n)
  inputs, _ = inputs_lib.block_inputs(run, block, np.zeros(workers, np.int64), 0)
  return hlo.compiled(block_step_lib.BlockStep(run, rounds=rounds), state, *inputs)


class ConditionalCollectivesTest(parameterized.TestCase):

  @parameterized.named_parameters(('one_worker_per_device', 4), ('two_workers_per_device', 2))
  def test_local_sgd_average_is_inside_a_conditional(self, devices):
    program = compiled_block_step('local_sgd,local_steps=8', workers=4, devices=devices)
    self.assertGreaterEqual(program.conditionals, 1)
    self.assertEqual(program.collectives_outside_conditionals(), [])
    inside = program.reachable(b for branch in program.branches for b in branch)
    self.assertIn('all-reduce', [op.removesuffix('-start') for op in program.collectives(inside)])

  def test_a_per_worker_predicate_would_run_the_average_every_iteration(self):
    program = compiled_block_step('local_sgd,local_steps=8', workers=4, devices=2, drop_step=True)
    self.assertEqual(program.conditionals, 0)
    self.assertIn('all-reduce', [op.removesuffix('-start') for op in program.collectives_outside_conditionals()])

  @parameterized.named_parameters(('one_worker_per_device', 4), ('two_workers_per_device', 2))
  def test_a_block_of_whole_rounds_averages_once_per_round_without_a_conditional(self, devices):
    # Two rounds of H = 4: the round body is unrolled with static positions; the average, at position 3 only,
    # needs no conditional, so XLA may schedule it freely (DaSGD overlaps its delayed average this way).
    program = compiled_block_step('local_sgd,local_steps=4', workers=4, devices=devices, n=8, rounds=True)
    self.assertEqual(program.conditionals, 0)
    reduces = [op for op in program.collectives(program.ops) if op.removesuffix('-start') == 'all-reduce']
    self.assertEqual(len(reduces), 1)  # once in the scanned round body

  def test_on_cpu_whole_rounds_run_the_per_iteration_program(self):
    # XLA:CPU overlaps nothing and the unrolled round is slower there: by default the same two rounds run the
    # per-iteration program, its average inside a conditional.
    program = compiled_block_step('local_sgd,local_steps=4', workers=4, devices=2, n=8)
    self.assertGreaterEqual(program.conditionals, 1)
    self.assertEqual(program.collectives_outside_conditionals(), [])

  def test_rounds_pay_off_on_accelerators_only(self):
    self.assertEqual({p: xla_cpu.rounds_pay_off(p) for p in ('cpu', 'gpu', 'tpu')},
                     {'cpu': False, 'gpu': True, 'tpu': True})
    run = setup.build(harness.synthetic_config('local_sgd,local_steps=4', workers=4, devices=2))
    self.assertIsNone(block_step_lib.BlockStep(run).rounds)
    self.assertIsNotNone(block_step_lib.BlockStep(run, rounds=True).rounds)
    self.assertIsNone(block_step_lib.BlockStep(setup.build(harness.synthetic_config('sync')), rounds=True).rounds)

  def test_sync_all_reduces_unconditionally(self):
    program = compiled_block_step('sync', workers=4, devices=2)
    self.assertNotEqual(program.collectives_outside_conditionals(), [])


if __name__ == '__main__':
  absltest.main()
