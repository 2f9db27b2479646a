"""Corrupted checkpoints and unusable workdirs: detected, reported in one line, nothing else lost."""

import json
import logging
import os
import shutil
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from waitless.experiments.harness import checkpointing
from waitless.experiments.harness import metrics_io
from waitless.experiments.harness import preemption
from waitless.experiments.harness import train
from tests import harness
from tests.experiments.harness import test_preemption
from tests.experiments import test_train


def _config():
  return harness.synthetic_config('kasync,k=2', num_steps=30, checkpoint_every=10, log_every=5,
                                  eval_every=10, steps_per_call=5)


def _truncate_state(step_dir):
  """Cuts every data file of the state item in half (a crash or disk error while the file was written)."""
  for root, _, files in os.walk(os.path.join(step_dir, 'state')):
    for name in files:
      path = os.path.join(root, name)
      size = os.path.getsize(path)
      if size > 8 and 'commit_success' not in name:
        with open(path, 'r+b') as f:
          f.truncate(size // 2)


def _flip_bytes(step_dir):
  """XORs 64 bytes in the middle of the state's largest data file (bit rot: orbax may read it back as other
  numbers)."""
  files = [os.path.join(root, name) for root, _, names in os.walk(os.path.join(step_dir, 'state')) for name in names]
  largest = max(files, key=os.path.getsize)
  middle = os.path.getsize(largest) // 2
  with open(largest, 'r+b') as f:
    f.seek(middle)
    data = f.read(64)
    f.seek(middle)
    f.write(bytes(b ^ 0x5A for b in data))


def _edit_meta(step_dir):
  """Changes a value of the meta item and keeps it valid JSON."""
  path = os.path.join(step_dir, 'meta', 'metadata')
  with open(path) as f:
    meta = json.load(f)
  meta['train_loss'] = float(meta['train_loss']) + 1.0
  with open(path, 'w') as f:
    json.dump(meta, f)


def _garble_meta(step_dir):
  with open(os.path.join(step_dir, 'meta', 'metadata'), 'w') as f:
    f.write('{"step": 3')


class CheckpointIntegrityTest(parameterized.TestCase):

  @parameterized.named_parameters(('truncated_state', _truncate_state), ('garbled_meta', _garble_meta),
                                  ('flipped_bytes', _flip_bytes), ('edited_meta', _edit_meta))
  def test_a_corrupt_latest_checkpoint_is_set_aside_and_the_previous_one_resumes(self, corrupt):
    config = _config()
    full = self.create_tempdir().full_path
    train.train_and_evaluate(config, full)
    crashed = self.create_tempdir().full_path
    with self.assertRaises(preemption.Preempted):  # stops after the block [15, 20): checkpoints 10 and 20
      train.train_and_evaluate(config, crashed, stop_requests=test_preemption.StopAt(15))
    corrupt(os.path.join(crashed, 'checkpoints', '20'))
    with self.assertLogs('waitless', level='WARNING') as logs:
      train.train_and_evaluate(config, crashed)
    warnings = [r.getMessage() for r in logs.records if r.levelname == 'WARNING']
    self.assertLen(warnings, 1)
    self.assertRegex(warnings[0], r'^checkpoint at step 20 is unreadable \(.*\); trying the previous one$')
    self.assertNotIn('\n', warnings[0])
    self.assertTrue(os.path.isdir(os.path.join(crashed, 'corrupt_checkpoints', '20')))
    self.assertEqual(test_train._summary_without_wall(crashed), test_train._summary_without_wall(full))
    self.assertEqual(test_train._strip_wall(metrics_io.read_rows(crashed)),
                     test_train._strip_wall(metrics_io.read_rows(full)))

  def test_every_checkpoint_corrupt_is_said_before_the_run_trains_again_from_step_0(self):
    # Issue 59: "trying the previous one" twice, then a silent retraining from step 0.
    config = _config()
    crashed = self.create_tempdir().full_path
    with self.assertRaises(preemption.Preempted):  # checkpoints 10 and 20
      train.train_and_evaluate(config, crashed, stop_requests=test_preemption.StopAt(15))
    for step in ('10', '20'):
      _garble_meta(os.path.join(crashed, 'checkpoints', step))
    with self.assertLogs('waitless', level='WARNING') as logs:
      train.train_and_evaluate(config, crashed)
    warnings = [r.getMessage() for r in logs.records if r.levelname == 'WARNING']
    self.assertLen(warnings, 3)
    self.assertRegex(warnings[2], f'^{crashed}: no readable checkpoint is left \\(unreadable: step\\(s\\) 10, 20, '
                     'moved to corrupt_checkpoints/\\): the run trains again from step 0$')
    self.assertEqual(sorted(os.listdir(os.path.join(crashed, 'corrupt_checkpoints'))), ['10', '20'])

  def test_flipped_bytes_in_incompressible_data_are_caught_by_the_checksum(self):
    # Orbax stores incompressible floats raw and checks only its index: flipped data bytes read back as other
    # numbers (issue 39: a run restored them, and diverged two steps later).
    directory = self.create_tempdir().full_path
    state = {'w': np.random.default_rng(0).normal(size=(50000,)).astype(np.float32)}
    checkpointer = checkpointing.Checkpointer(directory)
    checkpointer.save(1, state, {'step': 1})
    checkpointer.close()
    _flip_bytes(os.path.join(directory, '1'))
    moved = []
    with self.assertLogs('waitless', level='WARNING') as logs:
      restored = checkpointing.Checkpointer(directory).restore_step(1, state, moved.append)
    self.assertIsNone(restored)
    self.assertEqual(moved, [1])
    self.assertIn('CorruptCheckpoint: its state does not match the checksum', logs.output[0])

  def test_the_checksum_sees_every_bit_of_every_dtype(self):
    tree = {'f32': np.arange(6, dtype=np.float32), 'bf16': np.ones(3, jnp.bfloat16), 'f64': np.arange(2.0),
            'i8': np.arange(4, dtype=np.int8), 'b': np.array([True, False]), 'key': jax.random.key(0)}
    reference = checkpointing.state_checksum(tree)
    self.assertEqual(checkpointing.state_checksum(dict(tree)), reference)
    for name in ('f32', 'bf16', 'i8', 'b'):
      changed = dict(tree)
      flat = np.array(tree[name]).copy()
      flat.view(np.uint8)[0] ^= 1
      changed[name] = flat
      self.assertNotEqual(checkpointing.state_checksum(changed), reference, name)
    swapped = dict(tree, f32=tree['f32'][::-1].copy())
    self.assertNotEqual(checkpointing.state_checksum(swapped), reference)

  def test_the_host_checksum_of_cpu_arrays_is_the_devices(self):
    # CPU arrays are summed with numpy, others (and a multi-process run's) by a jitted program: the same words.
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ('w',)),
                                          jax.sharding.PartitionSpec('w'))
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
      tree = {'f32': rng.normal(size=(8, 1001)).astype(np.float32), 'f64': rng.normal(size=(8, 3)),
              'bf16': rng.normal(size=(8, 5)).astype(jnp.bfloat16), 'u8': rng.integers(0, 255, (8, 7), np.uint8),
              'i64': rng.integers(-2**62, 2**62, (8, 2)), 'b': rng.integers(0, 2, (8, 3)).astype(bool)}
      tree = {k: jax.device_put(v, sharding) for k, v in tree.items()}
      tree['key'] = jax.random.split(jax.random.key(1), 8)
      leaves = jax.tree.leaves(tree)
      self.assertTrue(checkpointing._on_host(leaves))
      device = np.asarray(checkpointing._jitted_leaf_sums('cpu')(tree))
      np.testing.assert_array_equal(checkpointing._host_leaf_sums(leaves), device)

  def test_the_saved_meta_is_the_loops_state_at_the_save_not_later(self):
    # The save serialises meta in the background: the loop's metrics window, mutated by the next block, once
    # leaked into a checkpoint (a resumed run then logged that block's losses twice).
    checkpointer = checkpointing.Checkpointer(self.create_tempdir().full_path)
    window = {'train_loss': 1.0, 'iterations': 5.0}
    passed = []
    with mock.patch.object(checkpointing.ocp.args, 'JsonSave', side_effect=lambda m: passed.append(m)):
      with mock.patch.object(checkpointing.ocp.args, 'Composite', side_effect=lambda **kw: kw):
        with mock.patch.object(checkpointer, '_manager'):
          checkpointer.save(10, {'w': np.zeros(2)}, {'step': 10, 'window': window})
    window['train_loss'] += 2.0  # the next block's sums
    without_checksums = [{k: v for k, v in m.items() if not k.endswith('_checksum')} for m in passed]
    self.assertEqual(without_checksums, [{'step': 10, 'window': {'train_loss': 1.0, 'iterations': 5.0}}])

  def test_each_workdir_has_its_own_barrier_keys_and_the_heartbeat_bounds_them(self):
    # The replicas of a group save one step at once; orbax keys its barriers by step only.
    root = self.create_tempdir().full_path
    keys = {checkpointing.barrier_prefix(os.path.join(root, f'seed{i}', 'checkpoints')) for i in range(8)}
    self.assertLen(keys, 8)
    self.assertEqual(checkpointing.barrier_prefix(f'{root}/seed0/checkpoints'),
                     checkpointing.barrier_prefix(f'{root}//seed0/./checkpoints/'))
    options = checkpointing.Checkpointer(os.path.join(root, 'seed0', 'checkpoints'))._manager._options
    self.assertEqual(options.multiprocessing_options.barrier_sync_key_prefix,
                     checkpointing.barrier_prefix(os.path.join(root, 'seed0', 'checkpoints')))
    with mock.patch.object(checkpointing.distributed, '_heartbeat_timeout_s', 7):
      options = checkpointing.Checkpointer(os.path.join(root, 'seed1', 'checkpoints'))._manager._options
    self.assertEqual(options.async_options.timeout_secs, 7)

  def test_a_failed_background_save_is_not_logged_twice(self):
    # Orbax logs a failed save's traceback from its thread; the same error reaches the next save or wait, where a
    # multi-process run reports it in one line (main.py installs this filter on absl's logger).
    failed = logging.LogRecord('absl', logging.ERROR, 'x.py', 1, '[process=0][thread=async_save] Failed to run 2 '
                               'Handler Commit operations or the Commit callback in background save thread, '
                               'directory: /w/checkpoints/20', None, None)
    other = logging.LogRecord('absl', logging.ERROR, 'x.py', 1, 'something else failed', None, None)
    self.assertFalse(checkpointing.background_error_filter(failed))
    self.assertTrue(checkpointing.background_error_filter(other))

  def test_a_read_only_workdir_fails_before_training_in_one_line(self):
    with self.assertRaisesRegex(checkpointing.UnusableWorkdir, r'^workdir /proc/waitless_run is not writable'):
      train.train_and_evaluate(_config(), '/proc/waitless_run')  # read-only even for root

  def test_a_full_disk_fails_before_training_in_one_line(self):
    workdir = self.create_tempdir().full_path
    full_disk = shutil._ntuple_diskusage(total=10**9, used=10**9 - 1000, free=1000)
    with mock.patch.object(checkpointing.shutil, 'disk_usage', return_value=full_disk):
      with self.assertRaisesRegex(checkpointing.UnusableWorkdir, r'has 0\.0 MB free but two checkpoints'):
        train.train_and_evaluate(_config(), workdir)
    self.assertFalse(os.path.exists(os.path.join(workdir, 'checkpoints', '5')))

  def test_a_disk_with_room_for_one_run_but_not_for_the_group_fails_before_training(self):
    # Issue 39: the check was per replica, so 4 replicas on a disk with room for one passed it and then died
    # writing their checkpoints.
    root = self.create_tempdir().full_path
    configs = [_config() for _ in range(4)]
    for seed, config in enumerate(configs):
      config.seed = seed
    workdirs = [os.path.join(root, f'seed{seed}') for seed in range(4)]
    state_bytes = train.setup.state_bytes_of(train.setup.build_group(configs[:1]).lead)
    room_for_one = shutil._ntuple_diskusage(total=10**9, used=0, free=int(1.5 * (2 * state_bytes + (1 << 20))))
    with mock.patch.object(checkpointing.shutil, 'disk_usage', return_value=room_for_one):
      checkpointing.check_writable(workdirs[:1], state_bytes)  # one run fits
      with self.assertRaisesRegex(checkpointing.UnusableWorkdir,
                                  r'^workdir .*/seed0 has [\d.]+ MB free but two checkpoints of each of the 4 runs '
                                  r'of this group written there need about [\d.]+ MB: .*--max_replicas'):
        train.train_group(configs, workdirs)
    for workdir in workdirs:
      self.assertFalse(os.path.exists(os.path.join(workdir, 'checkpoints')))

  def test_the_main_prints_one_line_and_exits_2(self):
    result = test_train._main(['--config=experiments/configs/synthetic.py:sync', '--workdir=/proc/waitless_run'],
                              timeout=300)
    self.assertEqual(result.returncode, 2)
    self.assertRegex(result.stderr.strip().splitlines()[-1], r'^error: workdir /proc/waitless_run is not writable')


if __name__ == '__main__':
  absltest.main()
