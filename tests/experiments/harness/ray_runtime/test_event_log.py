"""A Ray run's events.jsonl on resume: every valid line kept, what is lost said (issue 59, as for metrics.jsonl)."""

import json
import os

from absl.testing import absltest

from waitless.experiments.harness.ray_runtime import events


def _write(workdir, steps, damage=None, tail=''):
  lines = [json.dumps({'step': s}) + '\n' for s in steps]
  if damage is not None:
    lines[damage - 1] = '{"step": 3, "ti\x00\n'
  with open(os.path.join(workdir, events.EVENTS_FILE), 'w') as f:
    f.writelines(lines)
    f.write(tail)


class EventLogTest(absltest.TestCase):

  def test_a_damaged_line_is_skipped_the_lines_after_it_kept_and_both_said(self):
    workdir = self.create_tempdir().full_path
    _write(workdir, range(1, 11), damage=3)
    log = events.EventLog(workdir, keep_through_step=8)
    log.close()
    self.assertEqual([line['step'] for line in events.read(workdir)], [1, 2, 4, 5, 6, 7, 8])
    self.assertLen(log.problems, 2)
    self.assertRegex(log.problems[0], r'events.jsonl: line\(s\) 3 are not events')
    self.assertRegex(log.problems[1], r'lacks the updates of steps 3..3 \(1 of them\) up to the checkpoint at step 8')

  def test_a_kill_after_the_checkpoint_is_no_news(self):
    workdir = self.create_tempdir().full_path
    _write(workdir, range(1, 11), tail='{"step": 11, "ti')
    log = events.EventLog(workdir, keep_through_step=8)
    log.close()
    self.assertEqual((len(events.read(workdir)), log.problems), (8, []))


if __name__ == '__main__':
  absltest.main()
