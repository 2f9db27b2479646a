"""Ring shifts, XOR exchanges and XOR group sums over the worker axes, against numpy on the stacked workers.

One jitted function per (P, D) computes every offset / mask at once (a dict of results), so each layout
compiles once: P workers on D devices, L = P / D of them vmapped per device as the harness does.
"""

import itertools
import re

from absl.testing import absltest
from absl.testing import parameterized
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from waitless.algorithms import collectives
from waitless.experiments.harness.workers import WorkerLayout

_POW2_LAYOUTS = [(p, d) for p in (1, 2, 4, 8, 16) for d in (1, 2, 4, 8) if d <= p and p % d == 0]
_OTHER_LAYOUTS = [(6, 1), (6, 2), (6, 3), (12, 4)]


def _name(p, d):
  return f'P{p}_D{d}'


def _values(p):
  """Distinct per-worker values: a float leaf with a trailing dimension and an int leaf."""
  return {'a': (np.arange(p * 3, dtype=np.float32).reshape(p, 3) * 1.5 + 1.0),
          'b': (np.arange(p, dtype=np.int32) * 7 - 3)}


def _mapped(layout, fn):
  """fn(per-worker tree, axis_name) over the stacked workers, as `experiments/harness/step.py` runs algorithms."""
  spec = PartitionSpec('workers')
  return jax.jit(layout.shard_map(lambda x: layout.per_worker(lambda v: fn(v, layout.axis_name))(x),
                                  in_specs=spec, out_specs=spec))


def _offsets(p, local):
  return sorted({0, 1, -1, 3, p + 1, local, 2 * local, -local, -7, 5 * p + 3})


def _mask_sets(p):
  g = p.bit_length() - 1
  sets = [(), (1,), (2, 1), (1 << (g - 1),) if g else (), (1, 2, 4)[:g], tuple(1 << k for k in range(g))]
  return sorted({s for s in sets if all(m < p for m in s)})


def _group_matrix(p, masks):
  """A[i, j] = 1 iff j = i XOR (XOR of some subset of masks)."""
  a = np.zeros((p, p), np.int64)
  for i in range(p):
    for chosen in itertools.product((0, 1), repeat=len(masks)):
      j = i
      for c, m in zip(chosen, masks):
        j ^= m * c
      a[i, j] = 1
  return a


def _assert_tree_equal(test, got, want, msg):
  for key in want:
    np.testing.assert_array_equal(np.asarray(got[key]), want[key], err_msg=f'{msg} leaf {key}')
    test.assertEqual(np.asarray(got[key]).dtype, want[key].dtype, msg)


class RingShiftTest(parameterized.TestCase):

  @parameterized.named_parameters((_name(p, d), p, d) for p, d in _POW2_LAYOUTS + _OTHER_LAYOUTS)
  def test_matches_roll_over_the_stacked_workers(self, p, d):
    layout = WorkerLayout.create(p, d)
    offsets = _offsets(p, layout.local)
    run = _mapped(layout, lambda v, ax: {o: collectives.ring_shift(v, ax, o) for o in offsets})
    x = _values(p)
    got = run(x)
    for o in offsets:
      _assert_tree_equal(self, got[o], {k: np.roll(v, o, axis=0) for k, v in x.items()}, f'offset {o}')

  def test_no_axis_is_the_identity(self):
    x = _values(1)
    self.assertIs(collectives.ring_shift(x, None, 5), x)

  def test_three_axes_mixed_radix(self):
    # A general tuple: 2 devices x (3 x 2) nested vmaps, device-major then outer vmap then inner vmap.
    layout = WorkerLayout.create(2, 2)
    offsets = [0, 1, -1, 2, 5, 7, -8, 13]
    axes = ('workers', 'outer', 'inner')

    def block(x):  # x: (1, 3, 2) on a device
      fn = lambda v: {o: collectives.ring_shift(v, axes, o) for o in offsets}
      return jax.vmap(jax.vmap(fn, axis_name='inner'), axis_name='outer')(x[0])

    spec = PartitionSpec('workers')
    run = jax.jit(jax.shard_map(lambda x: jax.tree.map(lambda y: y[None], block(x)), mesh=layout.mesh,
                                in_specs=spec, out_specs=spec, check_vma=False))
    stacked = np.arange(12, dtype=np.float32) * 2 + 1
    got = run(stacked.reshape(2, 3, 2))
    for o in offsets:
      np.testing.assert_array_equal(np.asarray(got[o]).reshape(12), np.roll(stacked, o), err_msg=f'{o}')


class XorTest(parameterized.TestCase):

  @parameterized.named_parameters((_name(p, d), p, d) for p, d in _POW2_LAYOUTS)
  def test_exchange_and_group_sum_match_numpy(self, p, d):
    layout = WorkerLayout.create(p, d)
    masks = list(range(p))
    mask_sets = _mask_sets(p)

    def fn(v, ax):
      return {'xor': {m: collectives.xor_exchange(v, ax, m) for m in masks},
              'group': {i: collectives.xor_group_sum(v, ax, s) for i, s in enumerate(mask_sets)}}

    x = _values(p)
    got = _mapped(layout, fn)(x)
    for m in masks:
      source = np.arange(p) ^ m
      _assert_tree_equal(self, got['xor'][m], {k: v[source] for k, v in x.items()}, f'mask {m}')
    for i, s in enumerate(mask_sets):
      a = _group_matrix(p, s)
      self.assertTrue((a.sum(axis=1) == 2 ** len(s)).all())
      want = {'a': (a @ x['a'].astype(np.float64)).astype(np.float32), 'b': (a @ x['b']).astype(np.int32)}
      _assert_tree_equal(self, got['group'][i], want, f'masks {s}')

  def test_no_axis(self):
    x = _values(1)
    self.assertIs(collectives.xor_exchange(x, None, 0), x)
    self.assertIs(collectives.xor_group_sum(x, None, []), x)
    with self.assertRaisesRegex(ValueError, r'mask must be in \[0, P=1\)'):
      collectives.xor_exchange(x, None, 1)

  @parameterized.named_parameters(
      ('not_power_of_two', 6, 2, 1, 'power-of-two number of workers, got P=6'),
      ('mask_too_large', 8, 4, 8, r'in \[0, P=8\), got 8'),
      ('negative_mask', 4, 2, -1, r'in \[0, P=4\), got -1'))
  def test_exchange_errors(self, p, d, mask, pattern):
    layout = WorkerLayout.create(p, d)
    with self.assertRaisesRegex(ValueError, pattern):
      _mapped(layout, lambda v, ax: collectives.xor_exchange(v, ax, mask))(_values(p))

  @parameterized.named_parameters(
      ('repeated', 8, 2, [1, 1], 'distinct'),
      ('not_power_of_two', 8, 2, [3], 'powers of two'),
      ('zero', 8, 8, [0], 'powers of two'),
      ('too_large', 8, 4, [1, 8], r'xor_group_sum mask must be in \[0, P=8\)'),
      ('workers_not_power_of_two', 6, 3, [1], 'xor_group_sum needs a power-of-two number of workers'))
  def test_group_sum_errors(self, p, d, masks, pattern):
    layout = WorkerLayout.create(p, d)
    with self.assertRaisesRegex(ValueError, pattern):
      _mapped(layout, lambda v, ax: collectives.xor_group_sum(v, ax, masks))(_values(p))

  def test_device_part_is_one_collective_permute_and_local_part_none(self):
    layout = WorkerLayout.create(16, 8)  # L = 2: mask bit 0 is local, bits 1-3 are the device's
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)  # one leaf: XLA emits one permute per leaf

    def permutes(mask):
      return _collective_permutes(_mapped(layout, lambda v, ax: collectives.xor_exchange(v, ax, mask)), x)

    self.assertEqual(permutes(0b0001), 0)  # the vmapped axis: a local gather
    self.assertEqual(permutes(0b1011), 1)
    self.assertEqual(permutes(0b0100), 1)
    self.assertEqual(permutes(0), 0)


def _collective_permutes(fn, x):
  hlo = fn.lower(x).compile().as_text()
  return len(re.findall(r'\scollective-permute(?:-start)?\(', hlo))


class RingShiftHloTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('multiple_of_local', 2, 1), ('wraps_onto_zero_shift', 1, 1), ('two_device_shifts', 3, 2),
      ('minus_one_borrow_is_a_whole_turn', -1, 1), ('negative', -3, 2), ('whole_ring', 16, 0),
      ('more_than_the_ring', 17, 1))
  def test_device_permutes(self, offset, count):
    # L = 2: a device shift by q for the elements that did not wrap around the local axis, q + 1 for the
    # others; identity shifts (0 mod D: q = 0, or q + 1 = D for offset -1) are skipped.
    layout = WorkerLayout.create(16, 8)
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    fn = _mapped(layout, lambda v, ax: collectives.ring_shift(v, ax, offset))
    self.assertEqual(_collective_permutes(fn, x), count)


class VaryingTypeTest(absltest.TestCase):

  def test_results_mix_with_per_worker_values_in_cond_under_check_vma(self):
    layout = WorkerLayout.create(8, 8)
    self.assertEqual(layout.local, 1)  # check_vma is on

    def device(x, step):
      def fn(v):
        ax = layout.axis_name
        # Collectives inside one branch, the per-worker input from the other, as local_sgd averages.
        exchanged = lax.cond(step % 2 == 0, lambda t: collectives.xor_exchange(t, ax, 3), lambda t: t, v)
        grouped = lax.cond(step % 2 == 0, lambda t: collectives.xor_group_sum(t, ax, [4, 1]), lambda t: t, v)
        shifted = lax.cond(step % 2 == 0, lambda t: collectives.ring_shift(t, ax, -3), lambda t: t, v)
        return {'xor': exchanged, 'group': grouped, 'ring': shifted}
      return layout.per_worker(fn)(x)

    run = jax.jit(layout.shard_map(device, in_specs=(PartitionSpec('workers'), PartitionSpec()),
                                   out_specs=PartitionSpec('workers')))
    x = _values(8)
    for step, active in ((0, True), (1, False)):
      got = run(x, jnp.int32(step))
      a = _group_matrix(8, [4, 1])
      want = {'xor': {k: v[np.arange(8) ^ 3] for k, v in x.items()},
              'group': {'a': (a @ x['a']).astype(np.float32), 'b': (a @ x['b']).astype(np.int32)},
              'ring': {k: np.roll(v, -3, axis=0) for k, v in x.items()}}
      for name in want:
        _assert_tree_equal(self, got[name], want[name] if active else x, f'{name} step {step}')

  def test_vmapped_workers_under_check_vma_name_the_fix(self):
    # Several workers per device inside a checked shard_map: JAX itself fails with a psum axis error or a bare
    # AssertionError; every collective says instead that the user's shard_map needs check_vma=False.
    layout = WorkerLayout.create(8, 4)
    axes = ('workers', 'local')
    calls = {'worker_mean': lambda v: collectives.worker_mean(v, axes),
             'worker_sum': lambda v: collectives.worker_sum(v, axes),
             'ring_shift': lambda v: collectives.ring_shift(v, axes, 1),
             'xor_exchange': lambda v: collectives.xor_exchange(v, axes, 1),
             'xor_group_sum': lambda v: collectives.xor_group_sum(v, axes, [1, 2])}
    spec = PartitionSpec('workers')
    for name, fn in calls.items():
      for check_vma in (True, False):
        run = jax.jit(jax.shard_map(jax.vmap(fn, axis_name='local'), mesh=layout.mesh, in_specs=spec,
                                    out_specs=spec, check_vma=check_vma))
        with self.subTest(name, check_vma=check_vma):
          if check_vma:
            with self.assertRaisesRegex(ValueError, r'check_vma=False'):
              run(_values(8)['a'])
          else:
            self.assertEqual(run(_values(8)['a']).shape, (8, 3))


if __name__ == '__main__':
  absltest.main()
