"""Streaming DiLoCo: sequential float64 reference, F = 1, d = 0, alpha = 0 is DiLoCo, whole rounds equal the
per-iteration path, fragments, the time rule (one fragment's all-reduce per sync, hidden under d steps), errors;
both overlap conventions, and 'snapshot_early' against a literal float64 port of torchft's DiLoCo.

The reference keeps each worker's model as one float64 vector in leaf order (the linear model's leaves are
`bias` (1,) then `kernel` (16, 1)): fragment f is elements [f * 17 // F, (f + 1) * 17 // F).
"""

import threading

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from waitless import config_errors as errors
from waitless.algorithms import local_sgd
from waitless.cluster.rules import local_sgd as local_sgd_rule
from waitless.algorithms import streaming_diloco as sd
from waitless.cluster.rules import streaming_diloco as sd_rule
from waitless.cluster import network as network_lib
from waitless.experiments.harness import validation
from tests import harness
from tests.algorithms import reference
from tests.algorithms import test_diloco
from tests.cluster import helpers

X = 0.01


def _f64(arg, **overrides):
  return harness.synthetic_config(arg, **{'model.param_dtype': 'float64', 'model.dtype': 'float64', **overrides})


def _flat(params, worker):
  w, b = reference.unpack(params, worker)
  return np.concatenate(([b], w))


class FragmentTest(parameterized.TestCase):

  def test_snapshot_table_moves_the_snapshots_d_steps_before_the_sync_point(self):
    np.testing.assert_array_equal(sd.snapshot_table(4, 2, 1), [-1, 0, -1, 1])  # merge_late: the sync table
    np.testing.assert_array_equal(sd.snapshot_table(4, 2, 1, 'snapshot_early'), [0, -1, 1, -1])
    np.testing.assert_array_equal(sd.snapshot_table(8, 4, 1, 'snapshot_early'), [0, -1, 1, -1, 2, -1, 3, -1])
    np.testing.assert_array_equal(sd.snapshot_table(6, 1, 4, 'snapshot_early'), [-1, 0, -1, -1, -1, -1])
    np.testing.assert_array_equal(sd.snapshot_table(6, 3, 0, 'snapshot_early'), sd.sync_table(6, 3))
    for args, message in (((6, 4, 0), 'divide'), ((8, 4, 2), 'delay < local_steps / fragments'),
                          ((4, 1, 4), 'delay < local_steps / fragments')):
      with self.assertRaisesRegex(ValueError, message):
        sd.snapshot_table(*args, 'snapshot_early')
    with self.assertRaisesRegex(ValueError, "'merge_late', 'snapshot_early'"):
      sd.snapshot_table(4, 2, 1, 'late')
    sd.snapshot_table(6, 4, 6)  # merge_late: any F <= H, d <= H

  def test_sync_table_staggers_the_fragments(self):
    np.testing.assert_array_equal(sd.sync_table(4, 1), [-1, -1, -1, 0])
    np.testing.assert_array_equal(sd.sync_table(4, 2), [-1, 0, -1, 1])
    np.testing.assert_array_equal(sd.sync_table(6, 4), [0, -1, 1, 2, -1, 3])
    np.testing.assert_array_equal(sd.sync_table(3, 3), [0, 1, 2])
    with self.assertRaisesRegex(ValueError, 'fragments'):
      sd.sync_table(2, 3)

  def test_pieces_cover_the_leaves_in_order_in_equal_parts(self):
    sizes = [3, 10, 1, 6]
    for f in range(1, 21):
      pieces = sd.fragment_pieces(sizes, f)
      lengths = [sum(b - a for _, a, b in p) for p in pieces]
      self.assertEqual(sum(lengths), 20)
      self.assertLessEqual(max(lengths) - min(lengths), 1)
      flat = [(k, j) for p in pieces for k, a, b in p for j in range(a, b)]
      self.assertEqual(flat, [(k, j) for k, n in enumerate(sizes) for j in range(n)])
    self.assertEqual(sd.fragment_pieces(sizes, 2), [[(0, 0, 3), (1, 0, 7)], [(1, 7, 10), (2, 0, 1), (3, 0, 6)]])
    with self.assertRaisesRegex(ValueError, 'empty'):
      sd.fragment_pieces(sizes, 21)

  def test_gather_scatter_round_trip(self):
    leaves = [np.arange(3.0), np.arange(10.0).reshape(2, 5) + 10]
    pieces = sd.fragment_pieces([3, 10], 3)[1]  # elements 4..8: leaf 1, flat 1..5
    np.testing.assert_array_equal(sd.gather(leaves, pieces), [11, 12, 13, 14])
    out = sd.scatter(leaves, pieces, -np.arange(4.0))
    np.testing.assert_array_equal(out[1].ravel(), [10, 0, -1, -2, -3, 15, 16, 17, 18, 19])
    np.testing.assert_array_equal(out[0], leaves[0])


class StreamingDiLoCoTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('f2_d1', 4, 2, 1, 0.5, 0.9, 4, 'merge_late'),
      ('f3_d2_two_workers_per_device', 6, 3, 2, 0.3, 0.0, 2, 'merge_late'),
      ('delay_equals_period', 3, 3, 3, 0.5, 0.9, 4, 'merge_late'),
      ('blocking', 4, 2, 0, 0.25, 0.9, 2, 'merge_late'),
      ('one_fragment_delayed', 3, 1, 2, 0.0, 0.5, 4, 'merge_late'),
      ('early_f2_d1', 4, 2, 1, 0.5, 0.9, 4, 'snapshot_early'),
      ('early_f3_d1_two_workers_per_device', 6, 3, 1, 0.3, 0.0, 2, 'snapshot_early'),
      ('early_one_fragment_d2', 3, 1, 2, 0.0, 0.5, 4, 'snapshot_early'))
  def test_matches_sequential_reference(self, local_steps, fragments, delay, mix, momentum, devices, overlap):
    iterations = 14
    arg = (f'streaming_diloco,local_steps={local_steps},fragments={fragments},delay={delay},mix={mix},'
           f'overlap={overlap}')
    with jax.enable_x64(True):
      config = _f64(arg, **{'optimizer.momentum': momentum, 'devices': devices})
      traj = harness.run_iterations(config, iterations)
    a, p = config.algorithm, config.workers
    models = [_flat(traj.initial_params, i) for i in range(p)]
    outer_model = models[0].copy()
    bounds = [(f * 17 // fragments, (f + 1) * 17 // fragments) for f in range(fragments)]
    early = delay if overlap == 'snapshot_early' else 0  # the snapshot `early` steps before the sync point
    snapshots_at = {(f + 1) * local_steps // fragments - 1 - early: f for f in range(fragments)}
    opts = [reference.MomentumSGD(config.optimizer.learning_rate, momentum) for _ in range(p)]
    outer = [test_diloco.OuterSGD(a.outer_learning_rate, a.outer_momentum, a.outer_nesterov)
             for _ in range(fragments)]
    pending = {}  # fragment -> (merge step, mean of the snapshots)

    def merge(f, mean):
      lo, hi = bounds[f]
      outer_model[lo:hi] = outer[f].step([outer_model[lo:hi]], [outer_model[lo:hi] - mean])[0]
      for m in models:
        m[lo:hi] = mix * m[lo:hi] + (1 - mix) * outer_model[lo:hi]

    for t in range(iterations):
      for i in range(p):
        batch = harness.worker_batch(traj.run, i, int(traj.positions[t][i]), 1)
        w, b = models[i][1:], models[i][0]
        gw, gb = reference.gradient(w, b, batch['image'][0], batch['label'][0])
        new_w, new_b = opts[i].step([w, np.float64(b)], [gw, np.float64(gb)])
        models[i] = np.concatenate(([new_b], new_w))
      for f, (due, mean) in list(pending.items()):
        if due == t:
          merge(f, mean)
          del pending[f]
      if t % local_steps in snapshots_at:
        f = snapshots_at[t % local_steps]
        lo, hi = bounds[f]
        mean = np.mean([m[lo:hi] for m in models], axis=0)
        if delay == 0:
          merge(f, mean)
        else:
          pending[f] = (t + delay, mean)
      for i in range(p):
        np.testing.assert_allclose(_flat(traj.params[t], i), models[i], rtol=1e-10, atol=1e-12,
                                   err_msg=f'step {t} worker {i}')

  @parameterized.named_parameters(('one_worker_per_device', 4), ('two_workers_per_device', 2))
  def test_one_fragment_no_delay_no_mix_is_diloco(self, devices):
    overrides = {'optimizer.momentum': 0.9, 'devices': devices}
    with jax.enable_x64(True):
      streaming = _f64('streaming_diloco,local_steps=3,fragments=1,delay=0,mix=0.0', **overrides)
      plain = _f64('diloco,local_steps=3', **overrides)
      runs = {(c.algorithm.name, block): harness.run_iterations(c, 9, block=block)
              for c in (streaming, plain) for block in (1, 3)}
    plain_run = runs['diloco', 1]
    moved = plain_run.params[-1]['Dense_0']['kernel'] - plain_run.initial_params['Dense_0']['kernel']
    self.assertGreater(np.abs(moved).max(), 1e-3)
    for block in (1, 3):
      for a, b in zip(runs['streaming_diloco', block].params, runs['diloco', block].params):
        test_diloco.assert_trees_close(a, b)

  @parameterized.named_parameters(
      ('d1_one_worker_per_device', 1, 4, 'merge_late'), ('d1_two_workers_per_device', 1, 2, 'merge_late'),
      ('d3_wrapping', 3, 4, 'merge_late'), ('d0', 0, 2, 'merge_late'), ('d4', 4, 4, 'merge_late'),
      ('early_d1_two_workers_per_device', 1, 2, 'snapshot_early'))
  def test_whole_round_blocks_equal_the_per_iteration_path(self, delay, devices, overlap):
    # block=8 with H=4: whole rounds (static positions, all-reduces issued outside conditionals, the first
    # round's carried merges masked); block=3: unaligned blocks on the per-iteration path; block=1.
    with jax.enable_x64(True):
      config = _f64(f'streaming_diloco,local_steps=4,fragments=2,delay={delay},overlap={overlap}',
                    **{'optimizer.momentum': 0.9, 'devices': devices})
      runs = {block: harness.run_iterations(config, 16, block=block) for block in (1, 3, 8)}
    self.assertEqual(runs[8].run.round_length, 4)
    self.assertEqual(runs[8].block_step.rounds._cache_size(), 1)
    for block in (3, 8):
      test_diloco.assert_trees_close(runs[block].params[-1], runs[1].params[-1], rtol=1e-12, atol=1e-14)
    self.assertGreater(np.abs(runs[1].params[-1]['Dense_0']['kernel'][0]
                              - runs[1].params[-1]['Dense_0']['kernel'][1]).max(), 1e-6)  # not all averaged

  @parameterized.named_parameters(
      ('fragments_above_period', 'local_steps=2,fragments=3', 'algorithm.fragments'),
      ('zero_fragments', 'fragments=0', 'algorithm.fragments'),
      ('delay_above_period', 'local_steps=2,fragments=1,delay=3', 'algorithm.delay'),
      ('negative_delay', 'delay=-1', 'algorithm.delay'),
      ('mix_above_one', 'mix=1.5', 'algorithm.mix'),
      ('outer_rate', 'outer_learning_rate=-1.0', 'algorithm.outer_learning_rate'),
      ('outer_momentum', 'outer_momentum=1.0', 'algorithm.outer_momentum'),
      ('unknown_overlap', 'overlap=torchft', 'algorithm.overlap'),
      ('early_fragments_not_dividing', 'local_steps=6,fragments=4,delay=0,overlap=snapshot_early',
       'algorithm.fragments'),
      ('early_delay_reaching_the_next_snapshot', 'local_steps=8,fragments=4,delay=2,overlap=snapshot_early',
       'algorithm.delay'))
  def test_bad_config_names_the_field(self, override, field):
    with self.assertRaises(errors.ConfigError) as raised:
      validation.validate(harness.synthetic_config(f'streaming_diloco,{override}'))
    self.assertEqual(raised.exception.field, field)
    self.assertNotIn('\n', str(raised.exception))

  def test_overlap_errors_say_what_is_allowed(self):
    cases = (('overlap=torchft', 'must be one of merge_late, snapshot_early'),
             ('local_steps=6,fragments=4,delay=0,overlap=snapshot_early', 'must divide algorithm.local_steps'),
             ('local_steps=8,fragments=4,delay=2,overlap=snapshot_early', 'must be < local_steps / fragments'))
    for override, allowed in cases:
      with self.assertRaisesRegex(errors.ConfigError, allowed):
        validation.validate(harness.synthetic_config(f'streaming_diloco,{override}'))
    # The same fields are valid with the default convention (what torchft refuses, the paper's allows).
    for override in ('local_steps=6,fragments=4,delay=0', 'local_steps=8,fragments=4,delay=2'):
      validation.validate(harness.synthetic_config(f'streaming_diloco,{override}'))

  def test_no_delay_makes_the_two_conventions_one_update(self):
    # Bit for bit (two workers per device: vmapped); with d >= 1 they differ (`TorchftPortTest`).
    with jax.enable_x64(True):
      runs = [harness.run_iterations(_f64(f'streaming_diloco,local_steps=4,fragments=2,delay=0,overlap={o}',
                                          **{'optimizer.momentum': 0.9, 'devices': 2}), 10)
              for o in sd.OVERLAPS]
    for a, b in zip(*(r.params for r in runs)):
      jax.tree.map(np.testing.assert_array_equal, a, b)


# ---- a literal float64 port of torchft's Streaming DiLoCo ----
# github.com/pytorch/torchft, torchft/local_sgd.py at commit 73dafea422116b2a713542719c8454efe5444c6c: `DiLoCo`
# (`_step_post_hook`, `_current_fragment`, the constructor's checks) and `_StreamingDiLoCoFragment`
# (`prepare_sync`, `perform_sync`, `_save_grads`, `_merge_parameters`, `save_parameters`, `restore_parameters`),
# line for line on numpy arrays (a parameter is a view into its replica's flat model, written in place as
# `p.data` is), without DTensor, CUDA streams, bucketing, quantization or state-dict hooks. The Manager is
# torchft's fault-free behaviour: `allreduce` averages over the replicas (ReduceOp.AVG), `should_commit`
# commits and advances `current_step`. Replicas run on threads, as torchft's run in processes, so an
# all-reduce completes only when every replica has issued it.


class _TorchSGD:
  """torch.optim.SGD(lr, momentum, nesterov), dampening 0, no weight decay (torch/optim/sgd.py, _single_tensor_sgd)."""

  def __init__(self, params: dict, lr: float, momentum: float, nesterov: bool):
    self.params, self.lr, self.momentum, self.nesterov = params, lr, momentum, nesterov
    self.grad = {}
    self.momentum_buffer = {}

  def step(self):
    for name, p in self.params.items():
      grad = self.grad[name]
      if self.momentum != 0:
        buf = self.momentum_buffer.get(name)
        if buf is None:
          buf = grad.copy()                                # torch.clone(grad).detach()
        else:
          buf = buf * self.momentum + grad                 # buf.mul_(momentum).add_(grad, alpha=1 - dampening)
        self.momentum_buffer[name] = buf
        grad = grad + self.momentum * buf if self.nesterov else buf
      p += -self.lr * grad                                 # param.add_(grad, alpha=-lr)

  def zero_grad(self):
    self.grad = {}


def _lerp(start, end, weight):
  """torch.lerp (aten/src/ATen/native/Lerp.h): the branch on |weight| < 0.5 is torch's own."""
  return start + weight * (end - start) if abs(weight) < 0.5 else end - (end - start) * (1 - weight)


class _Work:

  def __init__(self, manager, index, tensor):
    self._manager, self._index, self._tensor = manager, index, tensor

  def wait(self):
    self._manager.barrier.wait()  # every replica has issued this all-reduce (collectives come in one order)
    self._tensor[...] = np.mean(self._manager.sent[self._index], axis=0)


class _Manager:
  """One replica's view of torchft's Manager, fault-free."""

  def __init__(self, shared, rank: int):
    self._shared, self._rank, self._step, self._collectives = shared, rank, 0, 0
    self.barrier, self.sent = shared.barrier, shared.sent

  def current_step(self) -> int:
    return self._step

  def start_quorum(self):
    pass

  def allreduce(self, tensor):
    with self._shared.lock:
      self.sent.setdefault(self._collectives, [None] * self._shared.replicas)[self._rank] = tensor.copy()
    self._collectives += 1
    return _Work(self, self._collectives - 1, tensor)

  def should_commit(self) -> bool:
    self._step += 1
    return True


class _Shared:

  def __init__(self, replicas: int):
    self.replicas, self.lock, self.sent = replicas, threading.Lock(), {}
    self.barrier = threading.Barrier(replicas, timeout=60)


class _Fragment:
  """_StreamingDiLoCoFragment."""

  def __init__(self, manager, params: dict, outer_optimizer, fragment_update_alpha: float):
    self._manager, self._params, self._outer_optimizer = manager, params, outer_optimizer
    self._fragment_update_alpha = fragment_update_alpha
    self._allreduce_work = []
    self._grads = {}
    self.original_parameters = {name: np.empty_like(p) for name, p in params.items()}
    self._local_parameters = {}

  def save_parameters(self):
    for name, p in self._params.items():
      self.original_parameters[name][...] = p

  def restore_parameters(self):
    for name, p in self._params.items():
      p[...] = self.original_parameters[name]

  def prepare_sync(self):
    for name, p in self._params.items():  # _save_grads: the pseudo-gradient
      self._grads[name] = self.original_parameters[name] - p
    assert not self._allreduce_work
    for name in self._params:  # _allreduce_per_param
      self._allreduce_work.append(self._manager.allreduce(self._grads[name]))

  def perform_sync(self) -> bool:
    assert self._allreduce_work
    for work in self._allreduce_work:
      work.wait()
    self._allreduce_work = []
    self._local_parameters = {name: p.copy() for name, p in self._params.items()}  # _save_local_parameters
    self.restore_parameters()
    should_commit = self._manager.should_commit()
    if should_commit:
      self._outer_optimizer.grad = dict(self._grads)  # _set_grads
      self._grads = {}
      self._outer_optimizer.step()
      self.save_parameters()
      for name, p in self._params.items():  # _merge_parameters: p.data.lerp_(local, alpha)
        p[...] = _lerp(p, self._local_parameters[name], self._fragment_update_alpha)
    self._outer_optimizer.zero_grad()
    self._local_parameters = {}
    return should_commit


class _TorchftDiLoCo:
  """DiLoCo: its checks, the fragments and `_step_post_hook`."""

  def __init__(self, manager, model_fragments: list, outer_optimizers: list, sync_every: int,
               fragment_sync_delay: int, fragment_update_alpha: float):
    if sync_every < len(model_fragments):
      raise ValueError('Only 1 fragment can be syncrhonized at a time')
    if sync_every % len(model_fragments) != 0:
      raise ValueError('sync_every must divide the number of fragments')
    self._sync_every = sync_every // len(model_fragments)
    if fragment_sync_delay >= self._sync_every:
      raise ValueError('Fragment must be synced before it is reduced another time')
    self._manager, self._local_step, self._fragment_sync_delay = manager, 0, fragment_sync_delay
    self._fragments = [_Fragment(manager, f, o, fragment_update_alpha)
                       for f, o in zip(model_fragments, outer_optimizers)]
    for fragment in self._fragments:  # _save_parameters
      fragment.save_parameters()

  def _current_fragment(self) -> int:
    return self._manager.current_step() % len(self._fragments)

  def step_post_hook(self):
    self._local_step += 1
    if self._local_step == self._sync_every - self._fragment_sync_delay:
      self._manager.start_quorum()
      self._fragments[self._current_fragment()].prepare_sync()
    if self._local_step < self._sync_every:
      return
    if self._local_step == self._sync_every:
      self._fragments[self._current_fragment()].perform_sync()
      self._local_step = 0
      return
    raise AssertionError(f'{self._local_step=} should never be greater than {self._sync_every=}')


def torchft_trajectory(initial: list, batches, bounds, lr: float, momentum: float, outer_lr: float,
                       outer_momentum: float, outer_nesterov: bool, sync_every: int, fragment_sync_delay: int,
                       alpha: float) -> np.ndarray:
  """(T, P, 17): every replica's flat model after each step under torchft's DiLoCo (inner: momentum SGD).

  `initial`: P flat models; `batches[t][i]`: (x, y) of replica i at step t; `bounds`: each fragment's [lo, hi).
  """
  replicas, steps = len(initial), len(batches)
  shared, out, failures = _Shared(replicas), np.zeros((steps, replicas, len(initial[0]))), []

  def replica(rank):
    try:
      model = np.array(initial[rank], np.float64)
      fragments = [{'p': model[lo:hi]} for lo, hi in bounds]  # views: written in place
      outer = [_TorchSGD(f, outer_lr, outer_momentum, outer_nesterov) for f in fragments]
      diloco = _TorchftDiLoCo(_Manager(shared, rank), fragments, outer, sync_every, fragment_sync_delay, alpha)
      inner = reference.MomentumSGD(lr, momentum)
      for t in range(steps):
        x, y = batches[t][rank]
        gw, gb = reference.gradient(model[1:], model[0], x, y)
        new_w, new_b = inner.step([model[1:], np.float64(model[0])], [gw, np.float64(gb)])
        model[0], model[1:] = new_b, new_w
        diloco.step_post_hook()
        out[t, rank] = model
    except Exception as e:
      failures.append(e)
      shared.barrier.abort()

  threads = [threading.Thread(target=replica, args=(rank,)) for rank in range(replicas)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  if failures:
    raise failures[0]
  return out


class TorchftPortTest(parameterized.TestCase):
  """'snapshot_early' is torchft's DiLoCo; 'merge_late' (the paper's) is the same update only at d = 0."""

  @parameterized.named_parameters(
      ('blocking', 4, 2, 0, 0.5, 4),
      ('f2_d1', 4, 2, 1, 0.5, 4),
      ('f2_d2_two_workers_per_device', 6, 2, 2, 0.3, 2),
      ('f3_d1_no_mix', 6, 3, 1, 0.0, 4),
      ('one_fragment_d2', 3, 1, 2, 0.5, 4))
  def test_snapshot_early_is_torchft(self, local_steps, fragments, delay, mix, devices):
    iterations = 14
    overrides = {'optimizer.momentum': 0.9, 'devices': devices}
    runs = {}
    with jax.enable_x64(True):
      for overlap in sd.OVERLAPS:
        arg = (f'streaming_diloco,local_steps={local_steps},fragments={fragments},delay={delay},mix={mix},'
               f'overlap={overlap}')
        runs[overlap] = harness.run_iterations(_f64(arg, **overrides), iterations)
    early = runs['snapshot_early']
    config, p = early.run.config, early.run.config.workers
    a = config.algorithm
    batches = []
    for t in range(iterations):
      row = []
      for i in range(p):
        batch = harness.worker_batch(early.run, i, int(early.positions[t][i]), 1)
        row.append((batch['image'][0], batch['label'][0]))
      batches.append(row)
    bounds = [(f * 17 // fragments, (f + 1) * 17 // fragments) for f in range(fragments)]
    want = torchft_trajectory([_flat(early.initial_params, i) for i in range(p)], batches, bounds,
                              config.optimizer.learning_rate, 0.9, a.outer_learning_rate, a.outer_momentum,
                              a.outer_nesterov, local_steps, delay, mix)
    gaps = []
    for t in range(iterations):
      for i in range(p):
        np.testing.assert_allclose(_flat(early.params[t], i), want[t, i], rtol=1e-10, atol=1e-12,
                                   err_msg=f'step {t} worker {i}')
        gaps.append(np.abs(_flat(runs['merge_late'].params[t], i) - want[t, i]).max())
    if delay == 0:
      self.assertLess(max(gaps), 1e-12)
    else:  # the paper's convention merges other snapshots at other steps
      self.assertGreater(max(gaps), 1e-6)

  def test_diloco_is_torchft_with_one_fragment(self):
    # DiLoCo itself against the same literal port: torchft's DiLoCo with one fragment, no delay and
    # fragment_update_alpha = 0 (the local model replaced by the new outer one).
    iterations, local_steps = 13, 4
    with jax.enable_x64(True):
      ours = harness.run_iterations(_f64(f'diloco,local_steps={local_steps}', **{'optimizer.momentum': 0.9}),
                                    iterations)
    config, p = ours.run.config, ours.run.config.workers
    a = config.algorithm
    batches = [[tuple(harness.worker_batch(ours.run, i, int(ours.positions[t][i]), 1)[k][0]
                      for k in ('image', 'label')) for i in range(p)] for t in range(iterations)]
    want = torchft_trajectory([_flat(ours.initial_params, i) for i in range(p)], batches, [(0, 17)],
                              config.optimizer.learning_rate, 0.9, a.outer_learning_rate, a.outer_momentum,
                              a.outer_nesterov, local_steps, 0, 0.0)
    for t in range(iterations):
      for i in range(p):
        np.testing.assert_allclose(_flat(ours.params[t], i), want[t, i], rtol=1e-10, atol=1e-12,
                                   err_msg=f'step {t} worker {i}')
    self.assertGreater(np.abs(want[-1, 0] - want[0, 0]).max(), 1e-3)  # it trained: not a trivial agreement

  def test_the_port_refuses_what_torchft_refuses(self):
    fragments = [{'p': np.zeros(2)}, {'p': np.zeros(2)}]
    manager = _Manager(_Shared(1), 0)
    for sync_every, delay in ((1, 0), (3, 0), (4, 2)):
      with self.assertRaises(ValueError):
        _TorchftDiLoCo(manager, fragments, [None, None], sync_every, delay, 0.5)
      # ... and the config refuses it too, naming the field
      with self.assertRaises(errors.ConfigError):
        validation.validate(harness.synthetic_config(
            f'streaming_diloco,local_steps={sync_every},fragments=2,delay={delay},overlap=snapshot_early'))


class StreamingAverageRuleTest(parameterized.TestCase):

  def test_one_fragment_no_delay_is_local_sgd_time(self):
    kwargs = dict(workers=8, kind='exponential', rate=100.0, network=dict(kind='alpha_beta', bandwidth_gbps=0.1))
    block = helpers.clock(sd_rule.StreamingAverage(period=4, fragments=1, delay=0), **kwargs).next_block(20)
    periodic = local_sgd_rule.PeriodicAverage(averages_at=lambda t: bool(local_sgd.averages_at(t, 4)))
    want = helpers.clock(periodic, **kwargs).next_block(20)
    np.testing.assert_allclose(block.sim_time, want.sim_time, rtol=1e-12)
    np.testing.assert_allclose(block.idle, want.idle, rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(block.bytes_communicated, want.bytes_communicated)

  def test_one_fragment_per_sync_and_peak_bytes_fall_f_fold(self):
    m, p = 1e6, 8
    for fragments in (1, 2, 4):
      block = helpers.clock(sd_rule.StreamingAverage(period=4, fragments=fragments, delay=1), workers=p,
                            model_bytes=m, base_s=X).next_block(8)
      want = np.where(np.isin(np.arange(8) % 4, np.flatnonzero(sd.sync_table(4, fragments) >= 0)),
                      network_lib.ring_bytes(m / fragments, p), 0.0)
      np.testing.assert_allclose(block.bytes_communicated, want, rtol=1e-12)
      np.testing.assert_allclose(block.measurements['sync_bytes'], want, rtol=1e-12)
      self.assertAlmostEqual(block.bytes_communicated.sum(), 2 * network_lib.ring_bytes(m, p))  # per round: M

  def test_communication_hidden_under_the_delay_or_exposed(self):
    # Constant compute X; one fragment of M / 2 all-reduced in `cost` seconds; merged d = 1 step later.
    network = dict(kind='alpha_beta', latency_s=0.0, bandwidth_gbps=8e-3)  # 1e6 bytes/s
    p, m = 2, 8e3                         # allreduce(M / 2, 2) = 2 * 1/2 * 4e3 / 1e6 = 4 ms < X: hidden
    rule = sd_rule.StreamingAverage(period=4, fragments=2, delay=1)
    block = helpers.clock(rule, workers=p, model_bytes=m, base_s=X, network=network).next_block(8)
    np.testing.assert_allclose(block.sim_time, X * np.arange(1, 9), rtol=1e-12)
    np.testing.assert_array_equal(block.idle, 0.0)
    slow = helpers.clock(rule, workers=p, model_bytes=10 * m, base_s=X, network=network).next_block(8)
    exposed = 0.04 - X                    # 40 ms all-reduce, one step of it hidden
    np.testing.assert_allclose(slow.sim_time[:3], [X, 2 * X, 3 * X + exposed], rtol=1e-12)
    np.testing.assert_allclose(slow.idle[2], exposed, rtol=1e-9)
    blocking = helpers.clock(sd_rule.StreamingAverage(period=4, fragments=2, delay=0), workers=p, model_bytes=10 * m,
                             base_s=X, network=network).next_block(2)
    np.testing.assert_allclose(blocking.sim_time, [X, 2 * X + 0.04], rtol=1e-12)

  def test_snapshot_early_issues_d_steps_before_the_sync_point_and_waits_at_it(self):
    # Constant compute X; one fragment of M / 2 all-reduced in 40 ms; H = 4, F = 2 (sync points after
    # positions 1 and 3), d = 1. Both conventions issue the all-reduce at the snapshot and wait for it at the
    # merge; torchft's snapshot is one step before the sync point, the paper's at it.
    network = dict(kind='alpha_beta', latency_s=0.0, bandwidth_gbps=8e-3)  # 1e6 bytes/s
    kwargs = dict(workers=2, model_bytes=8e4, base_s=X, network=network)
    cost = 0.04
    early = helpers.clock(sd_rule.StreamingAverage(4, 2, 1, overlap='snapshot_early'), **kwargs).next_block(8)
    late = helpers.clock(sd_rule.StreamingAverage(4, 2, 1), **kwargs).next_block(8)
    issued = network_lib.ring_bytes(4e4, 2)
    np.testing.assert_array_equal(early.bytes_communicated, np.tile([issued, 0, issued, 0], 2))
    np.testing.assert_array_equal(late.bytes_communicated, np.tile([0, issued, 0, issued], 2))
    # snapshot_early: snapshot after step 0 (ready X + cost), merge after step 1 (waits), and again at 2 / 3.
    np.testing.assert_allclose(early.sim_time[:4], [X, X + cost, 2 * X + cost, 2 * X + 2 * cost], rtol=1e-12)
    np.testing.assert_allclose(early.idle[:4, 0], [0, cost - X, 0, cost - X], rtol=1e-9, atol=1e-15)
    # merge_late: snapshot after step 1 (ready 2X + cost), merge after step 2; snapshot 3, merge 4.
    np.testing.assert_allclose(late.sim_time[:5], [X, 2 * X, 2 * X + cost, 3 * X + cost, 3 * X + 2 * cost],
                               rtol=1e-12)
    with self.assertRaisesRegex(ValueError, 'delay < local_steps / fragments'):
      sd_rule.StreamingAverage(8, 4, 2, overlap='snapshot_early')

  def test_vectorised_rule_equals_iterate_with_snapshot_early(self):
    kwargs = dict(workers=8, kind='exponential', rate=100.0, network=dict(kind='alpha_beta', bandwidth_gbps=0.01))
    for make in (lambda: sd_rule.StreamingAverage(8, 4, 1, overlap='snapshot_early'),
                 lambda: sd_rule.StreamingAverage(6, 1, 5, microbatches=2, overlap='snapshot_early')):
      loop, fast = helpers.clock(make(), **kwargs), helpers.clock(make(), **kwargs)
      for n in (13, 1, 30):
        helpers.assert_blocks_equal(self, loop._block(n), fast.next_block(n))
      np.testing.assert_array_equal(loop.rule_state['ready_s'], fast.rule_state['ready_s'])

  def test_state_survives_a_json_round_trip(self):
    rule = sd_rule.StreamingAverage(period=4, fragments=2, delay=3)
    kwargs = dict(workers=4, kind='exponential', rate=100.0, network=dict(kind='alpha_beta', bandwidth_gbps=0.01))
    whole = helpers.clock(rule, **kwargs).next_block(12)
    first = helpers.clock(rule, **kwargs)
    first.next_block(5)
    resumed = helpers.clock(rule, **kwargs)
    resumed.load_state_dict(helpers.json_round_trip(first.state_dict()))
    np.testing.assert_allclose(resumed.next_block(7).sim_time, whole.sim_time[5:], rtol=1e-12)


if __name__ == '__main__':
  absltest.main()
