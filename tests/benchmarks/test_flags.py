"""The scale benchmarks' command lines: bad flags are one line naming the flag, exit 2, before any work (issue 59:
tracebacks, an unknown positional argument ignored and the 20-minute benchmark started, every cell "refused" with
exit 0); Ctrl-C and SIGTERM are one line and stop the children."""

import os
import signal
import subprocess
import sys
import time

from absl.testing import absltest
from absl.testing import parameterized

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(module, *args, timeout=120):
  return subprocess.run([sys.executable, '-m', f'benchmarks.{module}', *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=ROOT))


class BadFlagsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('clock_zero_workers', 'clock_scale', ('--workers=0',), r'--workers=.0. is not allowed: must be integers >= 1'),
      ('clock_text_workers', 'clock_scale', ('--workers=abc',), r'--workers=.abc. is not allowed: must be integers'),
      ('clock_positional', 'clock_scale', ('typo',), r'arguments=.typo. is not allowed: .*no positional'),
      ('clock_unknown_algorithm', 'clock_scale', ('--algorithms=nosuch',),
       r'--algorithms=.nosuch. is not allowed: unknown: nosuch; known: .*sync'),
      ('clock_zero_draw', 'clock_scale', ('--draw=0',), r'--draw=0 is not allowed'),
      ('training_positional', 'training_scale', ('typo',), r'arguments=.typo. is not allowed'),
      ('training_unknown_workload', 'training_scale', ('--workloads=nosuch',), r'--workloads=.nosuch. is not allowed'),
      ('training_unknown_algorithm', 'training_scale', ('--algorithms=sync;nosuch',),
       r"--algorithms='nosuch' is not allowed: algorithm.name='nosuch'"),
      ('clock_unknown_profile', 'clock_scale', ('--profile=nosuch',), r"--profile='nosuch' is not allowed: unknown"),
      ('training_zero_steps', 'training_scale', ('--steps=0',), r'--steps=0 is not allowed: must be an integer >= 40'),
      ('training_odd_workers', 'training_scale', ('--workers=12',), r'--workers=.12. is not allowed: must be multi'),
      ('paper_zero_seeds', 'paper_scale', ('wagma', '--seeds=0'), r'--seeds=0 is not allowed: must be an integer >= 1'),
      ('paper_negative_seeds', 'paper_scale', ('wagma', '--seeds=-2'), r'--seeds=-2 is not allowed'),
      ('paper_zero_iterations', 'paper_scale', ('--sim_iterations=0',), r'--sim_iterations=0 is not allowed'),
      ('paper_not_whole_periods', 'paper_scale', ('wagma', '--sim_iterations=7'),
       r'--sim_iterations=7 is not allowed: must be a multiple of 10 \(every period of the wagma experiment: 10\)'),
      ('paper_figures_unwritable', 'paper_scale', ('horovod', '--figures=/proc/nope'),
       r'--figures=./proc/nope. is not allowed: cannot be made'),
      ('paper_unknown_experiment', 'paper_scale', ('nosuch',), r'experiment=.nosuch. is not allowed: one of wagma'),
      ('paper_two_positionals', 'paper_scale', ('wagma', 'dasgd'), r'arguments=.wagma dasgd. is not allowed'),
      ('ray_stragglers_out', 'ray_stragglers', ('--out=/nonexistent/x.json',),
       r'--out=./nonexistent/x.json. is not allowed: its directory /nonexistent does not exist'),
      ('run_out', 'run', ('--out=/proc/nope/report.txt',), r'--out=./proc/nope/report.txt. is not allowed: its dir'),
      ('ray_stragglers_rates', 'ray_stragglers', ('--learning_rates=0.1,-1',),
       r'--learning_rates=0.1,-1 is not allowed: must be numbers > 0'),
      ('ray_stragglers_steps', 'ray_stragglers', ('--steps=async=0',), r'--steps=async=0 is not allowed: each must be '
       r'NAME=N'),
      ('ray_scale_model', 'ray_scale', ('--models=nosuch',), r'--models=nosuch is not allowed: nosuch is not one of'),
      ('ray_scale_plans', 'ray_scale', ('--plans=64',), r'--plans=64 is not allowed: each must be P:N'),
      ('ray_scale_workers', 'ray_scale', ('--workers=0',), r'--workers=.0. is not allowed: must be integers >= 1'),
      ('ray_overhead_rounds', 'ray_overhead', ('--rounds=0',), r'--rounds=0 --updates=300 is not allowed'))
  def test_one_line_exit_2(self, module, args, pattern):
    result = _run(module, *args)
    self.assertEqual(result.returncode, 2, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    self.assertLen(lines, 1, result.stderr[-2000:])
    self.assertRegex(lines[0], '^error: ' + pattern)
    self.assertEqual(result.stdout, '')

  @parameterized.parameters('call_overhead', 'failure_table', 'gpu', 'gpu_check', 'harness_overhead', 'ray_overhead',
                            'ray_scale', 'ray_stragglers', 'run', 'simulator_speed', 'stale_tradeoff', 'startup',
                            'vmapped_conditionals')
  def test_every_benchmark_refuses_a_positional_argument(self, module):
    result = _run(module, 'typo')
    self.assertEqual(result.returncode, 2, result.stderr[-2000:])
    self.assertEqual(result.stderr.strip(), "error: arguments='typo' is not allowed: this benchmark takes no "
                     'positional arguments (flags are --name=value)')

  def test_sigterm_is_one_line(self):
    process = subprocess.Popen([sys.executable, '-m', 'benchmarks.clock_scale', '--workers=8',
                                '--worker_iterations=100000000'], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    deadline = time.time() + 60
    while time.time() < deadline and not process.stdout.readline().startswith('algorithm'):
      pass
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    self.assertEqual(process.returncode, 143, stderr[-2000:])
    self.assertEqual([line for line in stderr.splitlines() if line.strip()],
                     ['interrupted (SIGTERM): stopped; nothing more is printed'])

  @parameterized.parameters(('SIGTERM', 143, 'SIGTERM'), ('SIGINT', 130, 'Ctrl-C'))
  def test_a_training_run_stopped_inside_is_one_line(self, signal_name, status, shown):
    # A training run inside a benchmark takes the signals over while it runs and ends in Preempted (the traceback
    # a user saw); the benchmark stops as for its own signal.
    program = ('from benchmarks import cli\n'
               'from waitless.experiments.harness.preemption import Preempted\n'
               'def main(argv):\n'
               f'  raise Preempted(7, "/tmp/run", "{signal_name}")\n'
               'cli.run(main)\n')
    result = subprocess.run([sys.executable, '-c', program], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    self.assertEqual(result.returncode, status, result.stderr[-2000:])
    self.assertEqual([line for line in result.stderr.splitlines() if line.strip()],
                     [f'interrupted ({shown}): stopped; nothing more is printed'])


if __name__ == '__main__':
  absltest.main()
