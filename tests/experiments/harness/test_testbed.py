"""The shaped test bed (`experiments/testbed.py`, `harness/testbed/`): hosts, quotas, links, runs and cleanup.

Without root, tc, nsenter or the cgroup v1 cpu controller the bed's tests are skipped with the reason; the spec's
validation and the missing-privilege line are tested everywhere. Where the privileges exist (CI on this machine
kind) they build real beds: a 2-host SPMD run (sync) and a Ray run (kasync: head on host 0, learners on the other
hosts) of a few steps, a quota that really slows a host, the link's shaping counted by tc, and the cleanup after
Ctrl-C, after a failing run and after a kill -9 of the launcher (the next start removes the bed and stops what ran
in it). About 60 s on 2 cores.

Run: python -m pytest -q tests/experiments/harness/test_testbed.py
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from unittest import mock

from absl.testing import absltest

from waitless import config_errors as errors
from waitless.experiments.harness.testbed import bed as bed_lib
from waitless.experiments.harness.testbed import runs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SHORT = 'num_steps=20,eval_every=20,log_every=10,checkpoint_every=20'


def _unavailable() -> str | None:
  try:
    bed_lib.check_privileges()
  except bed_lib.Unavailable as e:
    return str(e)
  return None


UNAVAILABLE = _unavailable()


def _testbed(*args, **kwargs) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, '-m', 'waitless.experiments.testbed', *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def _leftovers(bed_id: str) -> list[str]:
  """Everything of bed `bed_id` that still exists: namespaces, cgroups, its state file."""
  netns = subprocess.run(['ip', 'netns', 'list'], capture_output=True, text=True, check=False).stdout.split()
  names = [n for n in netns if n.startswith(f'{bed_lib.PREFIX}{bed_id}-')]
  names += [n for n in os.listdir(bed_lib.CGROUP_CPU) if n.startswith(f'{bed_lib.PREFIX}{bed_id}-')]
  if os.path.exists(os.path.join(bed_lib.STATE_DIR, f'{bed_id}.json')):
    names.append('state file')
  return names


def _read_until(proc: subprocess.Popen, text: str, timeout_s: float = 30) -> str:
  """The launcher's output up to the first line holding `text`."""
  seen, deadline = [], time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    line = proc.stdout.readline()
    if not line:
      break
    seen.append(line)
    if text in line:
      return ''.join(seen)
  raise AssertionError(f'no line with {text!r} within {timeout_s} s: {"".join(seen)}')


def _running_sleep(pid: int) -> bool:
  """Whether `pid` is a `sleep` that runs (not a zombie waiting for its new parent to reap it)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      stat = f.read()
  except OSError:
    return False
  return '(sleep)' in stat and stat.rsplit(')', 1)[1].split()[0] != 'Z'


class SpecTest(absltest.TestCase):
  """Runs everywhere: the bed's spec and the missing-privilege line."""

  def test_bad_specs_name_the_flag(self):
    for kwargs, flag in ((dict(cpus=(0.8,)), '--cpus'), (dict(cpus=(0.8,) * 5), '--cpus'),
                         (dict(cpus=(0.8, 0.0)), '--cpus'), (dict(cpus=(1, 1), rate_mbit=-1), '--rate_mbit'),
                         (dict(cpus=(1, 1), burst_bytes=1000), '--burst_bytes'), (dict(cpus=(1, 1), mtu=100), '--mtu'),
                         (dict(cpus=(1, 1), cpu_weight=1), '--cpu_weight')):
      with self.subTest(**{k: str(v) for k, v in kwargs.items()}):
        with self.assertRaisesRegex(errors.ConfigError, f'^{flag}='):
          bed_lib.Spec(**kwargs)

  def test_a_quota_above_the_machines_cores_is_refused(self):
    with mock.patch.object(os, 'cpu_count', return_value=2):
      with self.assertRaisesRegex(errors.ConfigError, "^--cpus=.*cannot exceed this machine's 2 cores"):
        bed_lib.Spec(cpus=(3, 1))
      bed_lib.Spec(cpus=(2, 2))  # each within the machine: allowed (check_mode says the sum oversubscribes)

  def test_the_modes_arguments_are_refused_before_any_bed_is_built(self):
    for args in (['exec', '7', 'true'], ['exec', '1']):
      with self.subTest(args=args):
        result = subprocess.run([sys.executable, '-m', 'waitless.experiments.testbed', '--cpus=0.5,0.5', '--', *args],
                                cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertRegex(result.stderr, r"^error: exec='.*' is not allowed: give a host 0\.\.1 and a command\n$")
        self.assertNotIn('[testbed]', result.stdout)  # refused before the bed's line: no bed was built

  def test_burst_holds_two_packets_at_least(self):
    self.assertEqual(bed_lib.Spec(cpus=(1, 1), rate_mbit=10).burst, 18000)
    self.assertEqual(bed_lib.Spec(cpus=(1, 1), rate_mbit=1000).burst, 125000)  # 1 ms at the rate

  def test_without_root_one_line(self):
    with mock.patch.object(os, 'geteuid', return_value=1000):
      with self.assertRaisesRegex(bed_lib.Unavailable, '^the test bed needs root'):
        bed_lib.check_privileges()

  def test_spmd_argv_puts_the_coordinator_on_host_0(self):
    argv = runs.spmd_argv(['--config=c.py:sync'], 3, 2)
    self.assertEqual(argv[-3:], [f'--coordinator_address={bed_lib.address(0)}:{runs.COORDINATOR_PORT}',
                                 '--num_processes=3', '--process_id=2'])


class WatchTest(absltest.TestCase):
  """`runs.watch` on plain processes (runs everywhere)."""

  def _start(self, script: str) -> subprocess.Popen:
    # SIGINT at its default in the child: a non-interactive shell cannot trap a signal it was started with ignored,
    # and the test process may have it ignored (an earlier test in the same pytest process, a background job).
    return subprocess.Popen(['sh', '-c', script], start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

  def test_a_failure_stops_the_others_and_gives_its_status(self):
    procs = [self._start('sleep 30'), self._start('sleep 0.3; exit 3')]
    begin = time.monotonic()
    self.assertEqual(runs.watch(procs, grace_s=2, log=lambda _: None), 3)
    self.assertLess(time.monotonic() - begin, 10)
    self.assertEqual(procs[0].returncode, -signal.SIGTERM)

  def test_stop_sends_sigint_then_130(self):
    stop = runs.Stop()
    with tempfile.TemporaryDirectory() as tmp:
      ready = os.path.join(tmp, 'ready')
      procs = [self._start(f'trap "exit 0" INT; touch {ready}; while true; do sleep 0.1; done')]
      deadline = time.monotonic() + 60
      while not os.path.exists(ready) and time.monotonic() < deadline:  # the shell's trap is set (a loaded
        time.sleep(0.05)                                                  # machine can take seconds to get there)
      self.assertTrue(os.path.exists(ready))
      stop.requested.set()
      # A long grace: the shell runs its trap once its `sleep 0.1` returns, which a loaded machine can delay;
      # the test waits only as long as the shell takes.
      self.assertEqual(runs.watch(procs, stop, grace_s=60, log=lambda _: None), 130)
    self.assertEqual(procs[0].returncode, 0)  # it saw SIGINT (its trap), not SIGKILL

  def test_sigkill_after_grace(self):
    stop = runs.Stop()
    procs = [self._start('trap "" INT TERM; while true; do sleep 0.1; done')]
    time.sleep(0.5)
    stop.requested.set()
    self.assertEqual(runs.watch(procs, stop, grace_s=0.5, log=lambda _: None), 130)
    self.assertEqual(procs[0].returncode, -signal.SIGKILL)

  def test_timeout(self):
    procs = [self._start('sleep 30')]
    self.assertEqual(runs.watch(procs, grace_s=1, timeout_s=0.3, log=lambda _: None), 124)


@absltest.skipIf(UNAVAILABLE is not None, f'no test bed here: {UNAVAILABLE}')
class BedTest(absltest.TestCase):
  """Real beds; every test checks that nothing is left."""

  def test_build_shape_quota_and_remove(self):
    spec = bed_lib.Spec(cpus=(0.3, 1.0), rate_mbit=50, cpu_weight=4096)
    with bed_lib.Bed.create(spec, bed_id=f'{os.getpid()}t') as bed:
      self.assertLen(_leftovers(bed.id), 6)  # 3 namespaces (2 hosts, the switch), 2 cgroups, the state file
      with open(os.path.join(bed.cgroups[0], 'cpu.cfs_quota_us')) as f:
        self.assertEqual(int(f.read()), 3000)  # 0.3 x the 10 ms period
      with open(os.path.join(bed.cgroups[1], 'cpu.shares')) as f:
        self.assertEqual(int(f.read()), 4096)
      # A busy loop of 1 s wall-clock on host 0 gets at most its 0.3 core (plus the scheduler's slack).
      busy = ('import time\nt, s = time.process_time(), time.time()\nwhile time.time() - s < 1: pass\n'
              'print(time.process_time() - t)')
      out = bed.popen(0, [sys.executable, '-c', busy], stdout=subprocess.PIPE, text=True).communicate()[0]
      self.assertLess(float(out), 0.45)
      # 1 MB from host 1 to host 0 through the shaped links: tc counts it, nothing is dropped, it takes >= M / R.
      listen = bed.popen(0, [sys.executable, '-c', 'import socket\ns = socket.create_server(("0.0.0.0", 9100))\n'
                             'c = s.accept()[0]\nn = 0\nwhile (b := c.recv(65536)): n += len(b)\nprint(n)'],
                         stdout=subprocess.PIPE, text=True)
      time.sleep(1.0)
      begin = time.monotonic()
      send = bed.popen(1, [sys.executable, '-c', f'import socket\nc = socket.create_connection(("{bed_lib.address(0)}",'
                           ' 9100))\nc.sendall(bytes(1_000_000))'])
      self.assertEqual(send.wait(30), 0)
      self.assertEqual(int(listen.communicate(timeout=30)[0]), 1_000_000)
      self.assertGreater(time.monotonic() - begin, 0.9 * 8e6 / 50e6)
      stats = bed.qdisc_stats()
      self.assertGreater(stats[1]['sent_bytes'], 1_000_000)
      self.assertGreater(stats[0]['received_bytes'], 1_000_000)
      self.assertEqual(sum(s['dropped'] for s in stats), 0)
    self.assertEqual(_leftovers(bed.id), [])

  def test_namespaces_are_the_beds_only(self):
    with bed_lib.Bed.create(bed_lib.Spec(cpus=(1, 1)), bed_id=f'{os.getpid()}n') as bed:
      netns = subprocess.run(['ip', 'netns', 'list'], capture_output=True, text=True, check=True).stdout
      for name in [bed.switch, *bed.namespaces]:
        self.assertIn(name, netns)
      links = subprocess.run(['ip', '-o', 'link'], capture_output=True, text=True, check=True).stdout
      self.assertNotIn('10.77.', subprocess.run(['ip', '-o', 'addr'], capture_output=True, text=True).stdout)
      self.assertNotIn(' h0', links)  # the bridge's ports live in the switch's namespace, not the machine's

  def test_kill_9_of_the_launcher_then_a_new_start_removes_everything(self):
    launcher = _testbed('--cpus=0.5,0.5', '--', 'exec', '1', 'sleep', '300')
    head = _read_until(launcher, '[testbed]')
    bed_id = head.split('[testbed] ', 1)[1].split(':', 1)[0]
    deadline = time.monotonic() + 20
    bed = bed_lib.Bed(bed_id, bed_lib.Spec(cpus=(0.5, 0.5)))
    while not bed.pids(1) and time.monotonic() < deadline:
      time.sleep(0.1)
    sleeper = bed.pids(1)
    self.assertNotEqual(sleeper, [])
    launcher.kill()
    launcher.wait()
    launcher.stdout.close()
    self.assertLen(_leftovers(bed_id), 6)  # 3 namespaces, 2 cgroups, the state file: kill -9 cleans nothing
    self.assertTrue(_running_sleep(sleeper[0]))
    # The next start (any bed) removes the dead launcher's bed and stops what ran in it.
    self.assertIn(bed_id, bed_lib.remove_stale())
    self.assertEqual(_leftovers(bed_id), [])
    self.assertFalse(_running_sleep(sleeper[0]))

  def test_ctrl_c_removes_the_bed(self):
    launcher = _testbed('--cpus=0.5,0.5', '--', 'exec', '0', 'sleep', '300')
    head = _read_until(launcher, '[testbed]')
    bed_id = head.split('[testbed] ', 1)[1].split(':', 1)[0]
    time.sleep(1.0)
    launcher.send_signal(signal.SIGINT)
    out = launcher.communicate(timeout=30)[0]
    self.assertEqual(launcher.returncode, 130, out)
    self.assertEqual(_leftovers(bed_id), [])

  def test_a_failing_run_removes_the_bed_and_passes_its_status(self):
    launcher = _testbed('--cpus=0.5,0.5', '--', 'exec', '1', 'sh', '-c', 'exit 7')
    out = launcher.communicate(timeout=60)[0]
    self.assertEqual(launcher.returncode, 7, out)
    bed_id = out.split('[testbed] ', 1)[1].split(':', 1)[0]
    self.assertEqual(_leftovers(bed_id), [])

  def test_sync_on_two_hosts(self):
    with tempfile.TemporaryDirectory() as workdir:
      launcher = _testbed('--cpus=0.8,0.8', '--rate_mbit=100', '--timeout_s=120', '--', 'spmd',
                          f'--config=experiments/configs/digits.py:sync,stragglers.kind=measured,workers=2,devices=2,'
                          f'{SHORT}', f'--workdir={workdir}')
      out = launcher.communicate(timeout=180)[0]
      self.assertEqual(launcher.returncode, 0, out[-3000:])
      with open(os.path.join(workdir, 'summary.json')) as f:
        summary = json.load(f)
      self.assertEqual(summary['steps'], 20)
      links = json.loads(out.split('[testbed] links: ', 1)[1].splitlines()[0])
      self.assertTrue(all(link['sent_bytes'] > 20 * 4 * summary['num_params'] / 2 for link in links), links)

  def test_kasync_on_ray_learners_on_the_other_hosts(self):
    if shutil.which('ray', path=os.path.dirname(sys.executable)) is None:
      self.skipTest('no ray in this environment')
    with tempfile.TemporaryDirectory() as workdir:
      launcher = _testbed('--cpus=0.8,0.8,0.8', '--rate_mbit=100', '--timeout_s=150', '--', 'ray',
                          f'--config=experiments/configs/digits.py:kasync,k=1,runtime=ray,workers=2,{SHORT}',
                          f'--workdir={workdir}')
      out = launcher.communicate(timeout=200)[0]
      self.assertEqual(launcher.returncode, 0, out[-3000:])
      with open(os.path.join(workdir, 'summary.json')) as f:
        self.assertEqual(json.load(f)['steps'], 20)
      links = json.loads(out.split('[testbed] links: ', 1)[1].splitlines()[0])
      # The learners on hosts 1 and 2 fetch from and push to the server on host 0: all of it crosses host 0's link.
      self.assertGreater(links[0]['sent_bytes'], 0.8 * (links[1]['received_bytes'] + links[2]['received_bytes']))
      self.assertGreater(links[1]['sent_bytes'], 0)
      self.assertGreater(links[2]['sent_bytes'], 0)


  def test_calibrate_measures_each_hosts_compute_at_its_quota(self):
    # Issue 56: the slow host's factor was the quotas' ratio; calibrate now measures each host at its own quota.
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, 'bed.json')
      shutil.copy(os.path.join(ROOT, 'docs', 'examples', 'testbed_174.json'), path)
      launcher = _testbed('--cpus=0.8,0.4', '--', 'calibrate', '--config=experiments/configs/digits.py:sync',
                          '--host_compute_only', '--rounds=2', f'--out={path}')
      out = launcher.communicate(timeout=180)[0]
      self.assertEqual(launcher.returncode, 0, out[-3000:])
      with open(path) as f:
        per_cpu = json.load(f)['compute']['digits/mlp']['per_cpu']
    self.assertEqual(sorted(per_cpu), ['0.4', '0.8'])
    self.assertLen(per_cpu['0.4']['rounds'], 2)
    self.assertBetween(per_cpu['0.4']['value'] / per_cpu['0.8']['value'], 1.5, 3.0)  # half the CPU: about 2x


if __name__ == '__main__':
  absltest.main()
