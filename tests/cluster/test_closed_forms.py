"""The closed forms of ALGORITHMS.md section 5 (Dutta et al.): mean time per server update, no communication.

X ~ Exp(mu) (or Delta + Exp(mu)), P learners, H_n the n-th harmonic number. In every case below the update
durations are i.i.d. (memorylessness, or fresh rounds), so the standard error of their mean is std / sqrt(n)
and a fixed seed with a tolerance of 5 standard errors is both tight and stable.
"""

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from waitless.cluster.rules import kasync
from waitless.cluster.rules import kbatch_async
from waitless.cluster.rules import kbatch_sync
from waitless.cluster.rules import ksync
from waitless.cluster.rules import sync
from tests.cluster import helpers

P = 8
MU = 2.0
SHIFT = 0.3
ITERATIONS = 10_000


def harmonic(n: int) -> float:
  return sum(1.0 / i for i in range(1, n + 1))


class ClosedFormTest(parameterized.TestCase):

  def _check(self, rule, expected, **stragglers):
    clock = helpers.clock(rule, workers=P, seed=0, **stragglers)
    durations = clock.next_block(ITERATIONS).duration
    standard_error = durations.std() / np.sqrt(ITERATIONS)
    self.assertLess(abs(durations.mean() - expected), 5 * standard_error,
                    f'{type(rule).__name__}: mean {durations.mean():.5f} vs {expected:.5f} '
                    f'(standard error {standard_error:.5f})')
    self.assertLess(standard_error, 0.02 * expected)  # the test is tight: 5 SE is at most 10% of the value

  @parameterized.named_parameters(
      ('fully_sync_barrier', lambda: sync.Barrier(), harmonic(P) / MU),
      ('fully_sync_k_equals_p', lambda: ksync.KSync(k=P), harmonic(P) / MU),
      ('ksync_k1', lambda: ksync.KSync(k=1), (harmonic(P) - harmonic(P - 1)) / MU),
      ('ksync_k4', lambda: ksync.KSync(k=4), (harmonic(P) - harmonic(P - 4)) / MU),
      ('kasync_k4', lambda: kasync.KAsync(k=4), (harmonic(P) - harmonic(P - 4)) / MU),
      ('kasync_k2', lambda: kasync.KAsync(k=2), (harmonic(P) - harmonic(P - 2)) / MU),
      ('kbatch_sync_k4', lambda: kbatch_sync.KBatchSync(k=4), 4 / (P * MU)),
      ('kbatch_sync_k8', lambda: kbatch_sync.KBatchSync(k=8), 8 / (P * MU)),
      ('kbatch_async_k4', lambda: kbatch_async.KBatchAsync(k=4), 4 / (P * MU)),
      ('async', lambda: kbatch_async.KBatchAsync(k=1), 1 / (P * MU)),
      ('async_as_kasync_k1', lambda: kasync.KAsync(k=1), 1 / (P * MU)),
  )
  def test_exponential(self, make_rule, expected):
    self._check(make_rule(), expected, kind='exponential', rate=MU)

  @parameterized.named_parameters(
      ('fully_sync', lambda: sync.Barrier(), SHIFT + harmonic(P) / MU),
      ('ksync_k4', lambda: ksync.KSync(k=4), SHIFT + (harmonic(P) - harmonic(P - 4)) / MU),
      ('ksync_k1', lambda: ksync.KSync(k=1), SHIFT + (harmonic(P) - harmonic(P - 1)) / MU),
  )
  def test_shifted_exponential(self, make_rule, expected):
    self._check(make_rule(), expected, kind='shifted_exponential', shift_s=SHIFT, rate=MU)


if __name__ == '__main__':
  absltest.main()
