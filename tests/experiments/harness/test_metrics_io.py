"""metrics_io: TensorBoard event files written without TensorFlow, and readable by TensorBoard."""

import glob
import json
import os
import subprocess
import sys
import textwrap

from absl.testing import absltest
from absl.testing import parameterized
import pytest
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow

from waitless.experiments.harness import metrics_io

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ROWS = [{'step': 10, 'train_loss': 0.5, 'sim_time': 0.125, 'flag': True, 'note': 'text', 'lost': float('nan')},
        {'step': 20, 'train_loss': 0.25, 'sim_time': 0.25, 'bytes_communicated': 3}]
# The scalars TensorBoard must show for ROWS: numbers only (no bool, no text, NaN written as null in the log).
EXPECTED = {('train_loss', 10): 0.5, ('sim_time', 10): 0.125,
            ('train_loss', 20): 0.25, ('sim_time', 20): 0.25, ('bytes_communicated', 20): 3.0}


def _python(code: str, **kwargs) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
  return subprocess.run([sys.executable, '-c', textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                        env=env, **kwargs)


def _event_files(workdir, run=''):
  return sorted(glob.glob(os.path.join(workdir, metrics_io.TENSORBOARD_DIR, run, 'events.out.tfevents.*')))


def _scalars(workdir, run=''):
  """{(tag, step): value} from the event files, parsed with tensorboard's Event message."""
  out = {}
  for path in _event_files(workdir, run):
    for record in metrics_io.read_records(path):
      event = event_pb2.Event.FromString(record)
      for value in event.summary.value:
        out[(value.tag, event.step)] = value.simple_value
  return out


def _write(workdir, rows=ROWS, keep_through_step=None):
  writer = metrics_io.MetricsWriter(workdir, keep_through_step=keep_through_step)
  for row in rows:
    writer.write(row)
  writer.close()


class EventFileTest(absltest.TestCase):

  def test_masked_crc32c_matches_tensorboard_and_the_standard_check_value(self):
    self.assertEqual(metrics_io.crc32c(b'123456789'), 0xE3069283)  # CRC-32C's published check value
    for data in (b'', b'\x00', b'123456789', bytes(range(256)) * 3):
      self.assertEqual(metrics_io.masked_crc32c(data), pywrap_tensorflow.masked_crc32c(data), data[:8])

  def test_event_file_holds_the_version_then_one_event_per_row(self):
    workdir = self.create_tempdir().full_path
    _write(workdir)
    (path,) = _event_files(workdir)
    events = [event_pb2.Event.FromString(r) for r in metrics_io.read_records(path)]
    self.assertEqual(events[0].file_version, 'brain.Event:2')
    self.assertEqual([e.step for e in events[1:]], [10, 20])
    self.assertEqual(_scalars(workdir), EXPECTED)
    self.assertEqual([r['step'] for r in metrics_io.read_rows(workdir)], [10, 20])
    self.assertIsNone(metrics_io.read_rows(workdir)[0]['lost'])

  def test_the_same_scalars_against_simulated_milliseconds_in_a_second_run(self):
    workdir = self.create_tempdir().full_path
    _write(workdir)
    by_sim_time = _scalars(workdir, 'sim_time')
    self.assertEqual(by_sim_time, {(tag, {10: 125, 20: 250}[step]): v for (tag, step), v in EXPECTED.items()})
    _write(workdir, rows=[{'step': 20, 'train_loss': 0.5, 'sim_time': 0.3}], keep_through_step=10)
    resumed = [event_pb2.Event.FromString(r)
               for r in metrics_io.read_records(_event_files(workdir, 'sim_time')[1])]
    self.assertEqual((resumed[1].session_log.status, resumed[1].step), (event_pb2.SessionLog.START, 126))
    self.assertEqual(resumed[2].step, 300)

  def test_a_corrupt_record_is_an_error_and_a_cut_one_is_dropped(self):
    workdir = self.create_tempdir().full_path
    _write(workdir)
    (path,) = _event_files(workdir)
    with open(path, 'rb') as f:
      data = f.read()
    with open(path, 'wb') as f:
      f.write(data[:-3])  # the last record cut by a kill
    self.assertLen(list(metrics_io.read_records(path)), 2)
    with open(path, 'wb') as f:
      f.write(data[:-20] + bytes([data[-20] ^ 1]) + data[-19:])  # one bit flipped in the last Event
    with self.assertRaisesRegex(ValueError, 'corrupt record'):
      list(metrics_io.read_records(path))

  def test_a_resumed_writer_starts_a_new_event_file_and_cuts_the_log(self):
    workdir = self.create_tempdir().full_path
    _write(workdir)
    _write(workdir, rows=[{'step': 20, 'train_loss': 0.5}], keep_through_step=10)
    self.assertLen(_event_files(workdir), 2)
    self.assertEqual([(r['step'], r['train_loss']) for r in metrics_io.read_rows(workdir)], [(10, 0.5), (20, 0.5)])
    events = [event_pb2.Event.FromString(r) for r in metrics_io.read_records(_event_files(workdir)[1])]
    self.assertEqual(events[1].session_log.status, event_pb2.SessionLog.START)  # TensorBoard purges step >= 11
    self.assertEqual(events[1].step, 11)

  def test_rows_reach_the_files_at_flush_and_after_the_flush_period(self):
    workdir = self.create_tempdir().full_path
    writer = metrics_io.MetricsWriter(workdir, keep_through_step=None)
    writer.FLUSH_EVERY_S = 3600.0
    writer.write(ROWS[0])
    self.assertEqual(metrics_io.read_rows(workdir), [])  # buffered: no write per row
    writer.flush()  # what the loop does before each checkpoint
    self.assertEqual([r['step'] for r in metrics_io.read_rows(workdir)], [10])
    self.assertEqual(set(_scalars(workdir)), {k for k in EXPECTED if k[1] == 10})
    writer.FLUSH_EVERY_S = 0.0  # the period has passed: the next row flushes everything written
    writer.write(ROWS[1])
    self.assertEqual([r['step'] for r in metrics_io.read_rows(workdir)], [10, 20])
    self.assertEqual(_scalars(workdir), EXPECTED)
    writer.close()

  def test_writing_events_does_not_import_tensorflow(self):
    workdir = self.create_tempdir().full_path
    result = _python(f"""
        import sys
        from waitless.experiments.harness import metrics_io
        writer = metrics_io.MetricsWriter({workdir!r}, keep_through_step=None)
        writer.write({{'step': 10, 'train_loss': 0.5}})
        writer.close()
        print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'tensorboardX', 'torch')))
        """)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip(), '[]')
    self.assertEqual(_scalars(workdir), {('train_loss', 10): 0.5})

  @pytest.mark.slow
  def test_tensorboard_reads_the_events(self):
    """TensorBoard's own loader (the one `tensorboard --logdir` falls back to; it imports TensorFlow)."""
    workdir = self.create_tempdir().full_path
    _write(workdir, rows=ROWS + [{'step': 30, 'train_loss': 9.0}])  # a killed run got to step 30 ...
    _write(workdir, rows=ROWS[1:], keep_through_step=10)  # ... its checkpoint at 10 resumed: TensorBoard drops 30
    result = _python(f"""
        import json
        from tensorboard.backend.event_processing import event_accumulator
        acc = event_accumulator.EventAccumulator({os.path.join(workdir, metrics_io.TENSORBOARD_DIR)!r})
        acc.Reload()
        print(json.dumps([[tag, e.step, e.value] for tag in acc.Tags()['scalars'] for e in acc.Scalars(tag)]))
        """, timeout=300)
    self.assertEqual(result.returncode, 0, result.stderr)
    read = {(tag, step): value for tag, step, value in json.loads(result.stdout.strip().splitlines()[-1])}
    self.assertEqual(read, EXPECTED)


class TrainingRunTest(parameterized.TestCase):

  @parameterized.parameters('digits', 'mnist1d')
  def test_embedded_workload_run_does_not_import_tensorflow(self, workload):
    workdir = self.create_tempdir().full_path
    argv = ['waitless.experiments.main', f'--config=experiments/configs/{workload}.py:sync', f'--workdir={workdir}',
            '--config.num_steps=10', '--config.eval_every=10']
    result = _python(f"""
        import runpy, sys
        sys.argv = {argv!r}
        try:
          runpy.run_module('waitless.experiments.main', run_name='__main__', alter_sys=True)
        except SystemExit as e:
          assert not e.code, e.code
        print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'tensorflow_datasets')))
        """, timeout=600)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip().splitlines()[-1], '[]')
    rows = metrics_io.read_rows(workdir)
    self.assertEqual([r['step'] for r in rows], [10])
    scalars = _scalars(workdir)
    for key in ('train_loss', 'eval_accuracy', 'sim_time'):
      self.assertAlmostEqual(scalars[(key, 10)], rows[0][key], places=5)


if __name__ == '__main__':
  absltest.main()


CADENCE = (10, 50, 200)  # log_every, eval_every, num_steps


def _log(workdir, steps):
  with open(os.path.join(workdir, metrics_io.METRICS_FILE), 'w') as f:
    f.writelines(json.dumps({'step': s, 'sim_time': s / 100}) + '\n' for s in steps)


def _lines(workdir):
  with open(os.path.join(workdir, metrics_io.METRICS_FILE)) as f:
    return f.read().splitlines(keepends=True)


class ResumedLogTest(absltest.TestCase):
  """Issue 59: a resume kept only the rows before the first damaged line, and said nothing."""

  def _resume(self, workdir, keep=100):
    writer = metrics_io.MetricsWriter(workdir, keep_through_step=keep, cadence=CADENCE)
    writer.close()
    return writer, [r['step'] for r in metrics_io.read_rows(workdir)]

  def test_a_damaged_line_is_skipped_and_named_the_rows_after_it_kept(self):
    workdir = self.create_tempdir().full_path
    _log(workdir, range(10, 131, 10))
    lines = _lines(workdir)
    lines[2] = lines[2][:7] + '\x00garbage\n'  # line 3, the row of step 30
    with open(os.path.join(workdir, metrics_io.METRICS_FILE), 'w') as f:
      f.writelines(lines)
    writer, steps = self._resume(workdir)
    self.assertEqual(steps, [10, 20, 40, 50, 60, 70, 80, 90, 100])
    self.assertLen(writer.problems, 2)
    self.assertRegex(writer.problems[0], r'metrics.jsonl: line\(s\) 3 are not metrics rows')
    self.assertRegex(writer.problems[1], 'has no rows for steps 30 up to the checkpoint at step 100')
    self.assertEqual(writer.gaps, 'no rows for steps 30')

  def test_a_cut_or_deleted_log_is_named_with_the_rows_it_lacks(self):
    workdir = self.create_tempdir().full_path
    _log(workdir, range(10, 51, 10))  # cut: the rows of 60..100 are gone
    writer, steps = self._resume(workdir)
    self.assertEqual(steps, [10, 20, 30, 40, 50])
    self.assertEqual(writer.gaps, 'no rows for steps 60-100 (5 rows)')
    os.remove(os.path.join(workdir, metrics_io.METRICS_FILE))
    writer, steps = self._resume(workdir)
    self.assertEqual((steps, writer.gaps), ([], 'no rows for steps 10-100 (10 rows)'))

  def test_the_checkpoints_row_cut_mid_line_is_named(self):
    workdir = self.create_tempdir().full_path
    _log(workdir, range(10, 101, 10))
    lines = _lines(workdir)
    with open(os.path.join(workdir, metrics_io.METRICS_FILE), 'w') as f:
      f.writelines(lines[:-1] + [lines[-1][:9]])
    writer, steps = self._resume(workdir)
    self.assertEqual(steps[-1], 90)
    self.assertEqual(writer.gaps, 'no rows for steps 100')

  def test_a_kill_after_the_checkpoint_is_no_news(self):
    workdir = self.create_tempdir().full_path
    _log(workdir, range(10, 121, 10))
    with open(os.path.join(workdir, metrics_io.METRICS_FILE), 'a') as f:
      f.write('{"step": 130, "sim_ti')  # the line a kill cut, after the checkpoint at 100
    writer, steps = self._resume(workdir)
    self.assertEqual((steps, writer.problems, writer.gaps), (list(range(10, 101, 10)), [], None))

  def test_a_row_missing_after_the_resume_is_a_gap(self):
    workdir = self.create_tempdir().full_path
    writer = metrics_io.MetricsWriter(workdir, keep_through_step=None, cadence=CADENCE)
    for step in (10, 20, 40):
      writer.write({'step': step, 'sim_time': 0.1})
    writer.close()
    self.assertEqual(writer.gaps, 'no row for step 30 (the next row is at step 40)')

  def test_logged_steps_and_gaps(self):
    self.assertEqual(list(metrics_io.logged_steps(200, 30, 50, 200)),
                     [30, 50, 60, 90, 100, 120, 150, 180, 200])
    self.assertEqual(list(metrics_io.logged_steps(35, 10, 50, 35)), [10, 20, 30, 35])
    self.assertIsNone(metrics_io.log_gaps([10, 20, 30, 35], 35, 10, 50, 35))
    self.assertEqual(metrics_io.log_gaps([10, 30, 20], 30, 10, 50, 30), 'step 20 follows step 30')
    self.assertEqual(metrics_io.log_gaps([10, 15, 20], 20, 10, 50, 30), 'rows at steps the run does not log (15)')
    self.assertEqual(metrics_io.log_gaps([], 70, 10, 50, 100), 'no rows for steps 10-70 (7 rows)')
    self.assertEqual(metrics_io.log_gaps([20, 40, 60, 80], 80, 10, 50, 100),
                     'no rows for steps 10, 30, 50 and 1 more ranges')
