"""The sequential float64 parameter server the family's tests replay schedules through (`replay`).

One model W with its version history, one view per learner, gradients pushed exactly as a schedule says (the
first on the learner's view, later ones of a K-batch learner on the W it fetched in between), one update per
iteration, then fetches. Used by tests/algorithms/test_parameter_server.py (the shard_map emulation) and
tests/experiments/harness/ray_runtime/ (the Ray runtime's event log).
"""

import jax
import numpy as np

from waitless.algorithms import parameter_server as ps
from tests import harness
from tests.algorithms import reference


class ReferenceServer:
  """A sequential parameter server: W, its versions, per-learner views; plain or momentum SGD on W."""

  def __init__(self, w, b, learners, lr, momentum, adaptive_c=0.0, eta_max=0.0):
    self.model = [w.copy(), np.float64(b)]
    self.versions = [self._copy(self.model)]
    self.views = [self._copy(self.model) for _ in range(learners)]
    self.opt = reference.MomentumSGD(lr, momentum)
    self.lr, self.adaptive_c, self.eta_max = lr, adaptive_c, eta_max
    self.pushed = []  # (gradient, learning rate it is applied with) since the last update

  @staticmethod
  def _copy(model):
    return [np.array(model[0], copy=True), np.float64(model[1])]

  def eta(self, view):
    """eta_j = min(C / ||W_j - W_tau(j)||^2, eta_max) (Dutta et al. 2018), or the optimizer's rate."""
    if not self.adaptive_c:
      return self.lr
    d2 = float(np.sum((self.model[0] - view[0]) ** 2) + (self.model[1] - view[1]) ** 2)
    return min(self.adaptive_c / d2, self.eta_max) if d2 > 0 else self.eta_max

  def push(self, gradient, eta):
    self.pushed.append((gradient, eta))

  def update(self):
    """W_{t+1} = W_t + U(1/K sum of the pushed gradients), each scaled by eta / lr."""
    k = len(self.pushed)
    g = [sum(eta / self.lr * grad[j] for grad, eta in self.pushed) / k for j in range(2)]
    self.model = self.opt.step(self.model, g)
    self.versions.append(self._copy(self.model))
    self.pushed = []

  def fetch(self, learner, version=None):
    self.views[learner] = self._copy(self.versions[-1 if version is None else version])


def _job_gradient(run, learner, position, microbatches, model):
  batch = harness.worker_batch(run, learner, position, microbatches)
  x = batch['image'].reshape((-1,) + batch['image'].shape[2:])
  y = batch['label'].reshape(-1)
  gw, gb = reference.gradient(model[0], model[1], x, y)
  return [gw, np.float64(gb)]


def replay(test, traj, config, variant, block, restarts=False):
  """Replays traj's schedules through ReferenceServer, checking views after every block and W at the end.

  `traj.params` empty: no views to check (a run on Ray actors: each view lived in its learner's process), W only.
  `restarts`: learners may fetch the current model in any variant (the Ray runtime's learners that start late or
  restart: the schedule's `discarded`); in the emulator only a Ringmaster discard does.
  """
  a, m = config.algorithm, config.microbatches
  server = ReferenceServer(*reference.unpack(traj.initial_params), config.workers, config.optimizer.learning_rate,
                           config.optimizer.momentum, a.get('adaptive_lr_c', 0.0),
                           a.get('eta_max', 0.0) or config.optimizer.learning_rate)
  for t, (s, positions) in enumerate(zip(traj.schedules, traj.positions)):
    k = int(s.k)
    if variant in ('ksync', 'kasync'):
      pushes = s.contributions
      test.assertEqual(pushes.sum(), k)
    else:
      pushes = s.contributions
      test.assertEqual(pushes.sum(), k)
    np.testing.assert_array_equal(s.microbatches_done, pushes * m)
    for i in np.flatnonzero(s.discarded):  # Ringmaster: a discarded learner restarts on the current W_t
      if not restarts:
        test.assertEqual(variant, 'kbatch_async')
      server.fetch(i)
    etas = {}
    for i in np.flatnonzero(pushes):
      view = server.views[i]
      # The rule's staleness says which server version the learner's (first) gradient was computed on.
      version = server.versions[t - int(s.staleness[i])]
      np.testing.assert_allclose(view[0], version[0], rtol=1e-12, atol=1e-14, err_msg=f'iteration {t} {i}')
      etas[i] = server.eta(view)
      for job in range(pushes[i]):
        if job > 0:
          test.assertIn(variant, ('kbatch_sync', 'kbatch_async'))
          server.fetch(i)  # after a push a K-batch learner continues on the current W_t
        grad = _job_gradient(traj.run, i, int(positions[i]) + job * m, m, server.views[i])
        server.push(grad, etas[i])
    server.update()
    for i in range(config.workers):
      if variant in ('ksync', 'kbatch_sync'):
        server.fetch(i)  # cancelled or finished, every learner starts the next round from W_{t+1}
      elif s.refresh_view[i]:
        server.fetch(i)
      elif (variant == 'kbatch_async' or restarts) and s.fetch_current[i]:
        server.fetch(i, version=t)
      else:
        test.assertEqual(pushes[i], 0)
    if not traj.params or ((t + 1) % block and t + 1 < len(traj.schedules)):
      continue
    reference.assert_workers_match(traj.params[t // block], server.views[:config.workers], f'iteration {t}')
  state = traj.final_state
  if isinstance(state.opt_state, ps.ParameterServerState):  # the emulator: every worker's copy of W
    final = jax.device_get(state.params if state.opt_state.server is None else state.opt_state.server)
    copies = config.workers
  else:  # the Ray runtime's server: the one model
    final, copies = jax.tree.map(lambda x: np.asarray(x)[None], jax.device_get(state.params)), 1
  for i in range(copies):
    got_w, got_b = reference.unpack(final, i)
    np.testing.assert_allclose(got_w, server.model[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got_b, server.model[1], rtol=1e-10, atol=1e-12)
  return server
