"""Gradients computed once: the step takes a gradient only for the workers that finished work in an iteration."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from benchmarks import timing
from waitless.experiments.configs import digits
from waitless.experiments.harness import block_program
from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import inputs as inputs_lib
from waitless.experiments.harness import setup
from waitless.experiments.harness import xla_cpu
from tests import harness


class GradientSlotsTest(parameterized.TestCase):

  def test_no_slots_when_every_worker_works(self):
    self.assertIsNone(block_program.gradient_slots(np.ones((3, 8), np.int32), devices=8))

  @parameterized.named_parameters(
      # (n, P) of microbatches_done, devices, slots: the most busy workers of one device in one iteration,
      # rounded up to a power of two (at most the device's workers).
      ('one_pusher_per_iteration', [[0, 0, 1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]], 8, 1),
      ('nobody', [[0] * 8], 8, 1),
      ('three_on_one_device', [[1, 1, 0, 1, 0, 0, 0, 0]], 1, 4),
      ('two_devices', [[1, 1, 1, 0, 0, 0, 0, 1]], 2, 4),
      ('capped_by_the_device', [[1, 1, 1, 0, 1, 1, 1, 1]], 1, 8))
  def test_the_most_busy_slots_of_a_device(self, done, devices, slots):
    self.assertEqual(block_program.gradient_slots(np.asarray(done), devices), slots)

  def test_replicas_count_together_on_a_device(self):
    done = np.zeros((3, 1, 8), np.int32)  # (R, n, P): one busy worker per replica, all on device 0 of 2
    done[:, 0, 1] = 1
    self.assertEqual(block_program.gradient_slots(done, devices=2), 4)  # 3 busy slots of 12 on device 0

  @parameterized.named_parameters(('async', 'async', 8), ('async_one_device', 'async', 1),
                                  ('kasync', 'kasync,k=4', 8), ('kbatch_async', 'kbatch_async,k=4', 8))
  def test_the_emulator_computes_the_gradients_the_cluster_pushes(self, arg, devices):
    config = digits.get_config(arg)
    config.devices = devices
    self.assertAlmostEqual(timing.gradient_ratio(config, iterations=200), 1.0)

  def test_a_device_without_work_computes_none(self):
    done = np.zeros((2, 8), np.int32)
    done[0, 3] = 1  # iteration 0: one worker on device 3; iteration 1: nobody
    self.assertEqual(block_program.gradients_computed(done, devices=8, microbatches=1, finished_only=False), 1)
    self.assertEqual(block_program.gradients_computed(np.ones((2, 8), np.int32), 8, 1, False), 16)

  def test_a_busy_loop_computes_the_busy_slots_only(self):
    done = np.zeros((3, 1, 8), np.int32)  # (R, n, P): replicas 0 and 1 busy on device 0 of 2, replica 2 on 1
    done[0, 0, 1] = done[1, 0, 2] = 2
    done[2, 0, 5] = 1
    self.assertEqual(block_program.gradient_slots(done, devices=2), 2)
    # Padded: device 0 computes its 2 slots, device 1 pads its 1 busy slot to 2; each scans 2 micro-batches.
    self.assertEqual(block_program.gradients_computed(done, 2, microbatches=2, finished_only=False), 8)
    self.assertEqual(block_program.gradients_computed(done, 2, 2, False, busy_loop=True), 6)
    self.assertEqual(block_program.gradients_computed(done, 2, 2, True, busy_loop=True), 5)  # what each finished

  @parameterized.named_parameters(('kasync', 'kasync,k=4'), ('async', 'async'))
  def test_replicas_in_a_busy_loop_compute_the_gradients_the_cluster_pushes(self, arg):
    config = digits.get_config(arg + ',stragglers=heterogeneous')  # the quickstart's cluster
    run = setup.build(config)
    clock = setup.clock_for(run, 4.0 * 10_000)
    blocks = [clock.next_block(10).schedule.microbatches_done for _ in range(14)]
    done = np.stack(blocks)  # 14 blocks as if 14 replicas: (R, n, P)
    padded = block_program.gradients_computed(done, 8, run.microbatches, run.finished_only)
    looped = block_program.gradients_computed(done, 8, run.microbatches, run.finished_only, busy_loop=True)
    self.assertEqual(looped, int(done.sum()))
    self.assertGreater(padded, looped)  # what the vmapped, padded slots computed on top


class FrozenReplicasTest(absltest.TestCase):

  def test_frozen_replicas_keep_the_dense_program_while_every_live_worker_is_busy(self):
    configs = [harness.synthetic_config('sync', seed=s) for s in range(3)]
    group = setup.build_group(configs)
    blocks = [setup.clock_for(run, 1e4).next_block(4) for run in group.runs]
    positions = [np.zeros(c.workers, np.int64) for c in configs]
    (*_, slots), _ = inputs_lib.stacked_inputs(group, [blocks[0], None, blocks[2]], positions, 0)
    self.assertIsNone(slots)  # replica 1 is frozen: its zero gradients are computed, no second program
    async_configs = [harness.synthetic_config('async', seed=s) for s in range(2)]
    async_group = setup.build_group(async_configs)
    block = setup.clock_for(async_group.runs[0], 1e4).next_block(4)
    (*_, slots), _ = inputs_lib.stacked_inputs(
        async_group, [block, None], [np.zeros(c.workers, np.int64) for c in async_configs], 0)
    self.assertIsNotNone(slots)  # a live replica's idle workers: the busy slots only


class GatheredEqualsDenseTest(parameterized.TestCase):
  """The program with gathered slots gives the same state as the one computing every worker (float64)."""

  @parameterized.named_parameters(
      ('async_vmapped_workers', 'async', 2, False), ('kbatch_async', 'kbatch_async,k=2', 1, False),
      ('kasync_one_per_device', 'kasync,k=2', 4, False), ('async_busy_loop', 'async', 2, True),
      ('kbatch_async_busy_loop', 'kbatch_async,k=2', 1, True), ('kasync_busy_loop', 'kasync,k=2', 4, True))
  def test_same_state(self, arg, devices, busy_loop):
    with jax.enable_x64(True):
      config = harness.synthetic_config(arg, workers=4, devices=devices, microbatches=2, **{
          'model.param_dtype': 'float64', 'model.dtype': 'float64'})
      run = setup.build(config)
      clock = setup.clock_for(run, 1e4)
      block_step = block_step_lib.BlockStep(run, busy_loop=busy_loop)
      inputs, _ = inputs_lib.block_inputs(run, clock.next_block(6), np.zeros(config.workers, np.int64), 0)
      *args, slots = inputs
      self.assertIsNotNone(slots)  # some worker of the block finished nothing: the gathered program runs
      gathered, _ = block_step(setup.init_state(run), *args, slots=slots)
      dense, _ = block_step(setup.init_state(run), *args, slots=None)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-15), gathered, dense)
      self.assertEqual(block_step.per_iteration._cache_size(), 2)  # two programs did run


class ReusedSlotsTest(absltest.TestCase):
  """A block that needs fewer gathered slots than a program already compiled for runs on that program (at most
  twice its slots): no new compile, and the same state to the bit as the program of its own count (float32)."""

  def test_a_compiled_program_with_more_slots_runs_the_block_bit_for_bit(self):
    config = harness.synthetic_config('async', workers=8, devices=1, microbatches=2)
    run = setup.build(config)
    inputs, _ = inputs_lib.block_inputs(run, setup.clock_for(run, 1e4).next_block(6),
                                        np.zeros(config.workers, np.int64), 0)
    *args, slots = inputs
    self.assertEqual(slots, 1)
    reused = block_step_lib.BlockStep(run, busy_loop=False)
    reused(setup.init_state(run), *args, slots=2)  # compiles the program for 2 slots
    state, measured = reused(setup.init_state(run), *args, slots=1)
    self.assertEqual(reused.per_iteration._cache_size(), 1)
    own_state, own_measured = block_step_lib.BlockStep(run, busy_loop=False)(setup.init_state(run), *args, slots=1)
    jax.tree.map(np.testing.assert_array_equal, (state, measured), (own_state, own_measured))
    self.assertEqual(reused.reuse_slots(reused.per_iteration, args[0], args[1], 8), 8)  # every slot: no gather

  def test_a_busy_loop_runs_every_count_on_one_program(self):
    config = harness.synthetic_config('async', workers=8, devices=1, microbatches=2)
    run = setup.build(config)
    step = block_step_lib.BlockStep(run, busy_loop=True)
    self.assertEqual({step.reuse_slots(step.per_iteration, None, None, s) for s in (1, 2, 5, 8)}, {1})
    self.assertIsNone(step.reuse_slots(step.per_iteration, None, None, None))  # every worker busy: dense
    self.assertTrue(xla_cpu.busy_loop_pays_off(run.layout.platform))  # on this CPU


if __name__ == '__main__':
  absltest.main()
