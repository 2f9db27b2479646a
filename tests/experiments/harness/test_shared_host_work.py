"""The loop's host work shared across replicas (`loop.share_clocks`, one read per shared clock and seed, the
measurements reduced for all replicas at once) against the same loop with one clock per replica and each
replica's measurements reduced on their own, as it ran before: the same blocks, inputs and metrics rows."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from waitless.experiments.harness import loop as loop_lib
from waitless.experiments.harness import setup
from waitless.experiments.harness import window as window_lib
from tests import harness

RULES = ('async', 'kasync', 'ksync', 'wagma', 'dpsgd', 'local_sgd', 'adasync')


def _configs(name):
  """Two seeds x two step sizes: each seed's two replicas can share a clock."""
  return [harness.synthetic_config(name, workers=4, devices=2, microbatches=2, seed=seed, **{
      'stragglers.kind': 'exponential', 'optimizer.learning_rate': lr}) for seed in (3, 4) for lr in (0.05, 0.02)]


def _loop(group, model_bytes, shared: bool) -> loop_lib.Loop:
  members = [loop_lib.Replica.start(run, setup.clock_for(run, model_bytes)) for run in group.runs]
  loop = loop_lib.Loop(group, members, block_step=None)
  if not shared:  # one clock per replica, as before the clocks were shared
    for r, run in zip(loop.replicas, group.runs):
      r.clock = setup.clock_for(run, model_bytes)
  return loop


def _old_accept(r: loop_lib.Replica, window: window_lib.Window, block, mine):
  """What `Loop.accept` did per replica before its reductions were batched: the losses, the window's row and the
  clock's feedback."""
  contributed = block.schedule.microbatches_done > 0
  losses = np.where(contributed, mine['loss'], 0.0).sum(1) / np.maximum(contributed.sum(1), 1)
  window.add(block, train_loss=losses, l2_grads=mine['l2_grads'].mean(1), l2_params=mine['l2_params'].mean())
  r.clock.feedback(train_loss=float(losses.mean()))
  return losses


def _assert_blocks_equal(x, y):
  jax.tree.map(np.testing.assert_array_equal, x.schedule, y.schedule)
  for field in ('duration', 'sim_time', 'idle_fraction', 'mean_staleness', 'bytes_communicated', 'idle'):
    np.testing.assert_array_equal(getattr(x, field), getattr(y, field))
  jax.tree.map(np.testing.assert_array_equal, dict(x.measurements), dict(y.measurements))


class SharedHostWorkTest(parameterized.TestCase):

  @parameterized.parameters(*RULES)
  def test_shared_host_work_equals_each_replica_on_its_own(self, name):
    group = setup.build_group(_configs(name))
    _, model_bytes = setup.param_count_and_bytes(setup.init_state(group).params)
    shared, separate = _loop(group, model_bytes, True), _loop(group, model_bytes, False)
    clocks = {id(r.clock) for r in shared.replicas}
    self.assertLen(clocks, 4 if group.lead.rule.uses_feedback else 2)  # AdaSync: each replica's own feedback
    windows = [window_lib.Window(loop_lib.reports(run)) for run in group.runs]
    rng = np.random.default_rng(0)
    step = 0
    for n in (3, 5, 2):
      a, b = shared.reader.prepare(step, n), separate.reader.prepare(step, n)
      for x, y in zip(a.blocks, b.blocks):
        _assert_blocks_equal(x, y)
      jax.tree.map(np.testing.assert_array_equal, jax.device_get(a.inputs[0]), jax.device_get(b.inputs[0]))
      self.assertEqual(a.inputs[1], b.inputs[1])  # packing
      np.testing.assert_array_equal(a.inputs[2], b.inputs[2])  # steps
      self.assertEqual(a.inputs[3], b.inputs[3])  # gradient slots
      for r, s in zip(shared.replicas, separate.replicas):
        np.testing.assert_array_equal(r.positions, s.positions)
      shape = (len(group.runs), n, group.lead.config.workers)
      host = {'loss': rng.normal(size=shape).astype(np.float32),
              'l2_grads': rng.random(shape).astype(np.float32),
              'l2_params': rng.random(shape[::2]).astype(np.float32)}
      reduced = shared.reduce_measurements(a.blocks, host)
      for i, (r, s) in enumerate(zip(shared.replicas, separate.replicas)):
        self.assertTrue(shared.accept(i, a.blocks[i], host, step, reduced))
        losses = _old_accept(s, windows[i], b.blocks[i], {k: v[i] for k, v in host.items()})
        np.testing.assert_array_equal(reduced['train_loss'][i], losses)
        self.assertEqual(r.recorder.last_train_loss, float(losses[-1]))
        self.assertEqual(r.recorder.time, float(b.blocks[i].sim_time[-1]))
      for r, window in zip(shared.replicas, windows):
        self.assertEqual(list(r.recorder.window.row().items()), list(window.row().items()))
      step += n
    for r, s in zip(shared.replicas, separate.replicas):
      self.assertEqual(r.clock.state_dict(), s.clock.state_dict())

  def test_a_clock_in_another_state_is_not_shared(self):
    group = setup.build_group(_configs('async'))
    members = [loop_lib.Replica.start(run, setup.clock_for(run, 1e3)) for run in group.runs]
    members[1].clock.next_block(2)  # e.g. restored from another step
    loop = loop_lib.Loop(group, members, block_step=None)
    self.assertIsNot(loop.replicas[0].clock, loop.replicas[1].clock)
    self.assertIs(loop.replicas[2].clock, loop.replicas[3].clock)

  def test_one_program_slices_every_replica_for_its_checkpoint(self):
    group = setup.build_group(_configs('async'))
    state = setup.init_state(group)
    slicer = setup._replica_slicer(group.lead.layout.sharding(), group.lead.layout.platform)
    compiled = None
    for i in range(group.size):
      sliced = setup.replica_state(group, state, i)
      jax.tree.map(lambda x, y, i=i: np.testing.assert_array_equal(x, np.asarray(y)[i]), sliced, state)
      self.assertEqual(jax.tree.leaves(sliced)[0].sharding, group.lead.layout.sharding())
      compiled = slicer._cache_size() if compiled is None else compiled
    self.assertEqual(slicer._cache_size(), compiled)  # r is an argument

if __name__ == '__main__':
  absltest.main()
