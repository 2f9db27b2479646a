"""MATCHA: the gossip against a sequential float64 loop over the same host draws, on several layouts; budget 1
with alpha = 1/3 is D-PSGD, in its math and its time rule; the matchings, the activation probabilities and the
mixing weight against closed forms and brute force; the MatchingGossip time rule; bad input."""

import itertools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import collectives
from waitless.cluster.rules import dpsgd
from waitless.algorithms import matcha
from waitless.cluster.rules import matcha as matcha_rule
from waitless.experiments.harness import validation
from tests import harness
from tests.algorithms import reference
from tests.algorithms import test_nonblocking
from tests.cluster import helpers

X = 0.01
NET = {'kind': 'alpha_beta', 'latency_s': 1e-3, 'bandwidth_gbps': 1.0}


def _f64(arg, **overrides):
  return harness.synthetic_config(arg, **{'model.param_dtype': 'float64', 'model.dtype': 'float64', **overrides})


def ring_matchings(p):
  """The ring's matchings written out by hand: even edges, odd edges, and for odd P the closing edge alone."""
  if p == 1:
    return []
  if p == 2:
    return [[(0, 1)]]
  if p % 2 == 0:
    return [[(i, i + 1) for i in range(0, p, 2)], [(i, (i + 1) % p) for i in range(1, p, 2)]]
  return [[(i, i + 1) for i in range(0, p - 1, 2)], [(i, i + 1) for i in range(1, p - 1, 2)], [(p - 1, 0)]]


def gossip(models, matchings, active, alpha):
  """W_i <- W_i - alpha sum over the active matchings that pair i of (W_i - W_partner), one pair at a time."""
  pull = [[np.zeros_like(x) for x in m] for m in models]
  for j, edges in enumerate(matchings):
    if not (active >> j) & 1:
      continue
    for u, v in edges:
      for k in range(len(models[u])):
        pull[u][k] = pull[u][k] + (models[u][k] - models[v][k])
        pull[v][k] = pull[v][k] + (models[v][k] - models[u][k])
  return [[x - alpha * d for x, d in zip(m, pl)] for m, pl in zip(models, pull)]


class MatchaMathTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('four_on_four', {}),
      ('eight_on_two_momentum_m2_budget_0p3', {'optimizer.momentum': 0.9, 'workers': 8, 'devices': 2,
                                               'microbatches': 2, 'algorithm.budget': 0.3}),
      ('six_on_three_shifted', {'workers': 6, 'devices': 3}),  # not a power of two: ring shifts per offset
      ('eight_on_eight_ppermute', {'workers': 8, 'devices': 8}),  # one axis: one ppermute per matching
      ('five_on_one_odd_ring', {'workers': 5, 'devices': 1, 'algorithm.alpha': 0.3}),
      ('two_workers', {'workers': 2, 'devices': 2, 'algorithm.budget': 0.4}),
      ('one_worker', {'workers': 1, 'devices': 1}),
      # The paper's base graphs (issue 39), seeded: vmapped on several devices, and one worker per device.
      ('erdos_renyi_eight_on_four', {'workers': 8, 'devices': 4, 'algorithm.graph': 'erdos_renyi',
                                     'algorithm.edge_probability': 0.4, 'algorithm.graph_seed': 3}),
      ('geometric_six_on_two', {'workers': 6, 'devices': 2, 'algorithm.graph': 'geometric',
                                'algorithm.radius': 0.6, 'optimizer.momentum': 0.9}),
      ('geometric_eight_on_eight', {'workers': 8, 'devices': 8, 'algorithm.graph': 'geometric',
                                    'algorithm.graph_seed': 1}),
  )
  def test_matches_sequential_gossip_loop(self, overrides):
    iterations, block = 12, 4
    with jax.enable_x64(True):
      config = _f64('matcha', **{'stragglers.kind': 'exponential', **overrides})
      traj = harness.run_iterations(config, iterations, block=block)
    p, m = config.workers, config.microbatches
    graph = matcha.base_graph(config)
    if graph.kind == 'ring':
      matchings = ring_matchings(p)
    else:  # the plan's matchings, as edge lists (the graph itself: GraphTest)
      matchings = [[(i, j) for i, j in enumerate(t) if i < j] for t in matcha.plan(p, 0.5, graph=graph).partners]
    alpha = config.algorithm.alpha or matcha.plan(p, config.algorithm.budget, graph=graph).alpha
    models = [list(reference.unpack(traj.initial_params, i)) for i in range(p)]
    opts = [reference.MomentumSGD(config.optimizer.learning_rate, config.optimizer.momentum) for _ in range(p)]
    seen = set()
    for t in range(iterations):
      grads = []
      for i in range(p):
        per_mb = test_nonblocking._microbatch_gradients(traj.run, i, t * m, m, models[i])
        grads.append([sum(g[k] for g in per_mb) / m for k in range(2)])
      active = int(traj.schedules[t].active)
      seen.add(active)
      models = gossip([opts[i].step(models[i], grads[i]) for i in range(p)], matchings, active, alpha)
      if (t + 1) % block:
        continue
      reference.assert_workers_match(traj.params[t // block], models, f'iteration {t}')
    if matchings:  # the draws switched matchings on and off: the loop above tested both branches
      self.assertGreater(len(seen), 1, seen)
    if p > 2:
      kernel = traj.params[-1]['Dense_0']['kernel']
      self.assertGreater(np.abs(kernel[0] - kernel[1]).max(), 1e-8, 'models never differed')

  @parameterized.named_parameters(
      ('eight_on_four_momentum', 8, 4, 1 / 3),
      ('five_odd_ring', 5, 5, 1 / 3),
      ('two_workers', 2, 2, 1 / 2),
  )
  def test_budget_one_with_dpsgd_weights_is_dpsgd(self, workers, devices, alpha):
    # Every matching always active: W = I - alpha L, which is D-PSGD's mean over {i-1, i, i+1} at alpha = 1/3
    # (1/2 for two workers, whose ring is one edge).
    common = {'workers': workers, 'devices': devices, 'optimizer.momentum': 0.9, 'stragglers.kind': 'exponential'}
    with jax.enable_x64(True):
      ours = harness.run_iterations(_f64(f'matcha,budget=1.0,alpha={alpha!r}', **common), 6, block=3)
      theirs = harness.run_iterations(_f64('dpsgd', **common), 6, block=3)
    for a, b in zip(ours.params, theirs.params):
      jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14), a, b)
    self.assertTrue(all(int(s.active) == 2 ** len(ring_matchings(workers)) - 1 for s in ours.schedules))

  def test_one_worker_is_the_inner_optimizer(self):
    params = {'w': jnp.array([1.0, -2.0])}
    grads = {'w': jnp.array([0.5, 0.25])}
    inner = optax.sgd(0.1, momentum=0.9)
    want, _ = inner.update(grads, inner.init(params), params)
    tx = matcha.matcha(inner)
    got, _ = tx.update(grads, tx.init(params), params, schedule=matcha.MatchaSchedule(np.int32(1), np.int32(0)))
    np.testing.assert_allclose(got['w'], want['w'], rtol=1e-5)

  def test_update_without_schedule_says_what_it_needs(self):
    tx = matcha.matcha(optax.sgd(0.1))
    params = {'w': jnp.ones(2)}
    with self.assertRaisesRegex(ValueError, 'schedule.active'):
      tx.update(params, tx.init(params), params)

  def test_bad_arguments(self):
    for kwargs in ({'budget': 0.0}, {'budget': 1.5}, {'alpha': -0.1}, {'alpha': 0}):
      with self.subTest(**kwargs), self.assertRaisesRegex(ValueError, next(iter(kwargs))):
        matcha.matcha(optax.sgd(0.1), **kwargs)


class MatchingExchangeTest(parameterized.TestCase):
  """The collective on each of its paths against numpy indexing."""

  @parameterized.named_parameters(
      ('one_axis_partial', (6,), (1, 0, 2, 4, 3, 5)),
      ('two_axes_xor', (2, 4), (1, 0, 3, 2, 5, 4, 7, 6)),
      ('two_axes_ring_offsets', (2, 4), (7, 2, 1, 4, 3, 6, 5, 0)),
      ('two_axes_partial_non_power_of_two', (2, 3), (0, 2, 1, 5, 4, 3)),
      ('nobody_matched', (2, 2), (0, 1, 2, 3)),
  )
  def test_receives_the_partner_value(self, shape, partners):
    x = jnp.arange(np.prod(shape) * 2, dtype=jnp.float32).reshape(*shape, 2)
    axes = ('d', 'l')[:len(shape)] if len(shape) == 2 else 'w'
    f = lambda v: collectives.matching_exchange(v, axes, partners)  # noqa: E731
    if len(shape) == 2:
      got = jax.vmap(jax.vmap(f, axis_name='l'), axis_name='d')(x).reshape(-1, 2)
    else:
      got = jax.vmap(f, axis_name='w')(x)
    np.testing.assert_array_equal(got, np.asarray(x).reshape(-1, 2)[list(partners)])

  def test_not_a_matching(self):
    with self.assertRaisesRegex(ValueError, 'partners'):
      jax.vmap(lambda v: collectives.matching_exchange(v, 'w', (1, 2, 0)), axis_name='w')(jnp.zeros(3))


class PlanTest(parameterized.TestCase):

  @parameterized.parameters(2, 3, 4, 5, 8, 9)
  def test_ring_decomposition(self, p):
    got = matcha.decompose(matcha.ring_edges(p), p)
    want = []
    for edges in ring_matchings(p):
      partners = list(range(p))
      for u, v in edges:
        partners[u], partners[v] = v, u
      want.append(tuple(partners))
    self.assertEqual(got, tuple(want))

  def test_general_graph_is_a_proper_edge_colouring(self):
    # The Petersen graph (3-regular, class 2: needs 4 colours) and K5.
    petersen = [(i, (i + 1) % 5) for i in range(5)] + [(i, i + 5) for i in range(5)] + [
        (5 + i, 5 + (i + 2) % 5) for i in range(5)]
    for edges, p in ((petersen, 10), (list(itertools.combinations(range(5), 2)), 5)):
      tables = matcha.decompose(edges, p)
      covered = sorted(tuple(sorted((i, t[i]))) for t in tables for i in range(p) if t[i] > i)
      self.assertEqual(covered, sorted(tuple(sorted(e)) for e in edges))  # each edge in exactly one matching
      for t in tables:
        self.assertTrue(all(t[t[i]] == i for i in range(p)))

  def test_bad_graphs(self):
    for edges in ([(0, 0)], [(0, 1), (1, 0)], [(0, 4)], [(-1, 2)]):
      with self.subTest(edges=edges), self.assertRaisesRegex(ValueError, 'edge'):
        matcha.decompose(edges, 4)

  @parameterized.parameters(4, 8, 16)
  def test_even_ring_splits_the_budget_evenly(self, p):
    # The rotation i -> i + 1 swaps the two matchings and lambda_2 is concave: p_1 = p_2 = C_b is optimal.
    for budget in (0.1, 0.5, 0.9):
      np.testing.assert_allclose(matcha.ring_plan(p, budget).probabilities, [budget, budget], atol=1e-6)

  @parameterized.named_parameters(
      ('odd_ring_5', [(i, (i + 1) % 5) for i in range(5)], 5, 0.4),
      ('ring_with_a_chord', [(i, (i + 1) % 6) for i in range(6)] + [(0, 3)], 6, 0.5),
      ('k4_and_a_tail', list(itertools.combinations(range(4), 2)) + [(3, 4)], 5, 0.3),
  )
  def test_probabilities_beat_every_grid_point(self, edges, p, budget):
    laps = [matcha.laplacian(t) for t in matcha.decompose(edges, p)]
    got = matcha.activation_probabilities(laps, budget)
    self.assertLessEqual(got.sum(), budget * len(laps) + 1e-9)
    self.assertTrue(np.all((got >= 0) & (got <= 1)))

    def lambda2(prob):
      return np.linalg.eigvalsh(np.tensordot(prob, np.stack(laps), axes=1))[..., 1]

    grid = np.stack(np.meshgrid(*[np.linspace(0, 1, 21)] * len(laps), indexing='ij'), -1).reshape(-1, len(laps))
    grid = grid[grid.sum(1) <= budget * len(laps) + 1e-12]
    best_on_grid = lambda2(grid).max()
    self.assertGreaterEqual(lambda2(got), best_on_grid - 1e-9)
    self.assertGreaterEqual(lambda2(got), lambda2(np.full(len(laps), budget)) - 1e-9)

  @parameterized.parameters(2, 3, 8, 9)
  def test_budget_one_alpha_is_the_closed_form(self, p):
    # The authors' FixedProcessor.getAlpha: alpha = 2 / (lambda_2 + lambda_max) of the base Laplacian.
    plan = matcha.ring_plan(p, 1.0)
    self.assertEqual(plan.probabilities, (1.0,) * len(plan.partners))
    eig = np.linalg.eigvalsh(sum(matcha.laplacian(t) for t in plan.partners))
    np.testing.assert_allclose(plan.alpha, 2 / (eig[1] + eig[-1]), rtol=1e-12)  # solved exactly, not to 1e-8
    self.assertLess(plan.rho, 1)

  def test_two_workers_alpha_is_a_half_and_rho_one_minus_p(self):
    # One edge, p = C_b: E[W^T W] - J = 1 - 4 alpha p + 4 alpha^2 p on the difference direction.
    for budget in (0.2, 0.7):
      plan = matcha.ring_plan(2, budget)
      np.testing.assert_allclose(plan.alpha, 0.5, atol=1e-12)
      np.testing.assert_allclose(plan.rho, 1 - budget, atol=1e-12)

  @parameterized.parameters((8, 0.3), (5, 0.6), (16, 0.5), (7, 0.9))
  def test_alpha_is_where_rhos_slopes_change_sign(self, p, budget):
    # The optimality condition, in float64: rho falls to the left of alpha and rises to its right, both by more
    # than rounding 1e-9 away (a search on rho's values stopped about 1e-8 from it).
    plan = matcha.ring_plan(p, budget)
    laps = [matcha.laplacian(t) for t in plan.partners]
    mean, second = matcha._contraction(laps, plan.probabilities, matcha._complement_of_ones(p))
    for step in (1e-9, 1e-6):
      self.assertLess(matcha._slopes(mean, second, plan.alpha - step)[0], 0)
      self.assertGreater(matcha._slopes(mean, second, plan.alpha + step)[1], 0)

  @parameterized.parameters((8, 0.3), (5, 0.6), (16, 0.5))
  def test_alpha_minimises_rho(self, p, budget):
    plan = matcha.ring_plan(p, budget)
    laps = [matcha.laplacian(t) for t in plan.partners]
    grid = [matcha.contraction_factor(laps, plan.probabilities, a) for a in np.linspace(0.0, 1.5, 301)]
    self.assertLessEqual(plan.rho, min(grid) + 1e-12)
    self.assertLess(plan.rho, 1)
    # rho by Monte Carlo over the activations: ||E[W^T W] - J|| with W drawn.
    rng = np.random.default_rng(0)
    j = np.full((p, p), 1 / p)
    mean = np.zeros((p, p))
    draws = 20000
    for _ in range(draws):
      w = np.eye(p) - plan.alpha * sum(lap for lap, pj in zip(laps, plan.probabilities) if rng.random() < pj)
      mean += w.T @ w
    np.testing.assert_allclose(np.linalg.eigvalsh(mean / draws - j)[-1], plan.rho, atol=0.02)


class GraphTest(parameterized.TestCase):
  """The base graphs: seeded, connected, what their kind says, decomposed into matchings that cover them."""

  @parameterized.parameters(('erdos_renyi', 8), ('erdos_renyi', 16), ('geometric', 8), ('geometric', 16))
  def test_a_random_graph_is_seeded_connected_and_covered_by_its_matchings(self, kind, p):
    graph = matcha.BaseGraph(kind, seed=2, edge_probability=0.4, radius=0.5)
    edges = graph.edges(p)
    self.assertEqual(edges, matcha.BaseGraph(kind, seed=2, edge_probability=0.4, radius=0.5).edges(p))
    self.assertNotEqual(edges, matcha.BaseGraph(kind, seed=3, edge_probability=0.4, radius=0.5).edges(p))
    self.assertTrue(all(0 <= u < v < p for u, v in edges))
    lap = sum(matcha.laplacian(t) for t in matcha.decompose(edges, p))
    self.assertGreater(np.linalg.eigvalsh(lap)[1], 1e-9)  # connected: lambda_2 > 0
    covered = sorted((i, j) for t in matcha.decompose(edges, p) for i, j in enumerate(t) if i < j)
    self.assertEqual(covered, sorted(edges))  # every edge in exactly one matching
    if kind == 'geometric':  # an edge exactly where two of the stream's points are within the radius
      rng = np.random.default_rng([2, matcha.GRAPH_STREAM])
      while True:
        points = rng.random((p, 2))
        near = [(u, v) for u in range(p) for v in range(u + 1, p) if np.hypot(*(points[u] - points[v])) <= 0.5]
        if matcha._connected(near, p):
          break
      self.assertEqual(list(edges), near)

  def test_edge_density_follows_the_probability(self):
    counts = [len(matcha.BaseGraph('erdos_renyi', seed=s, edge_probability=0.3).edges(16)) for s in range(40)]
    self.assertAlmostEqual(np.mean(counts) / 120, 0.3, delta=0.04)  # 120 pairs; connected draws lean denser

  def test_the_ring_is_the_default_and_its_plan_unchanged(self):
    self.assertEqual(matcha.SPEC.defaults['graph'], 'ring')
    self.assertEqual(matcha.plan(8, 0.5), matcha.ring_plan(8, 0.5))
    self.assertEqual(matcha.BaseGraph().edges(8), matcha.ring_edges(8))

  def test_the_time_rule_uses_the_same_matchings(self):
    graph = matcha.BaseGraph('geometric', seed=1)
    rule = matcha_rule.MatchingGossip(budget=0.5, seed=0, graph=graph)
    chosen = matcha.plan(8, 0.5, graph=graph)
    self.assertLen(rule.activations(8, 0), len(chosen.partners))
    draws = np.mean([rule.activations(8, t) for t in range(4000)], axis=0)
    np.testing.assert_allclose(draws, chosen.probabilities, atol=0.03)

  @parameterized.named_parameters(
      ('unknown', 'matcha,graph=torus', 'algorithm.graph', 'must be one of ring, erdos_renyi, geometric'),
      ('too_sparse', 'matcha,graph=erdos_renyi,edge_probability=0.01', 'algorithm.edge_probability',
       'no connected erdos_renyi graph of 8 workers in 1000 draws: raise it'),
      ('radius_too_small', 'matcha,graph=geometric,radius=0.01', 'algorithm.radius', 'no connected geometric'),
      ('bad_seed', 'matcha,graph_seed=-1', 'algorithm.graph_seed', 'integer >= 0'))
  def test_bad_graph_is_one_line(self, arg, field, message):
    with self.assertRaisesRegex(errors.ConfigError, f'^{field}=.* is not allowed: .*{message}'):
      validation.validate(harness.synthetic_config(arg, workers=8, devices=4))


class MatchingGossipRuleTest(parameterized.TestCase):

  def _rule(self, p, budget, seed=0, microbatches=1):
    del p  # the rule takes P from the clock
    return matcha_rule.MatchingGossip(budget, seed=seed, microbatches=microbatches)

  @parameterized.parameters(1, 2, 5, 8)
  def test_budget_one_is_ring_gossip(self, p):
    for n in (1, 7):
      ours = helpers.clock(self._rule(p, 1.0), workers=p, network=NET, kind='exponential', rate=100.0)
      theirs = helpers.clock(dpsgd.RingGossip(), workers=p, network=NET, kind='exponential', rate=100.0)
      a, b = ours.next_block(n), theirs.next_block(n)
      np.testing.assert_array_equal(ours.times, theirs.times)
      for field in ('duration', 'idle', 'bytes_communicated', 'idle_fraction'):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
      np.testing.assert_array_equal(a.measurements['active_matchings'], len(ring_matchings(p)))

  def test_blocks_equal_single_iterations_and_keep_the_compute_stream(self):
    # Activations come from their own keyed stream: the clock's generator ends where D-PSGD's does.
    kw = dict(workers=8, network=NET, kind='exponential', rate=100.0, seed=3)
    one = helpers.clock(self._rule(8, 0.4, seed=3, microbatches=2), **kw)
    many = helpers.clock(self._rule(8, 0.4, seed=3, microbatches=2), **kw)
    ring = helpers.clock(dpsgd.RingGossip(2), **kw)
    blocks = [one.next_block(1) for _ in range(40)]
    block = many.next_block(40)
    ring.next_block(40)
    for field in ('duration', 'idle', 'bytes_communicated'):
      np.testing.assert_array_equal(np.concatenate([getattr(b, field) for b in blocks]), getattr(block, field))
    np.testing.assert_array_equal(np.concatenate([b.schedule.active for b in blocks]), block.schedule.active)
    self.assertEqual(one.rng.bit_generator.state, ring.rng.bit_generator.state)
    self.assertEqual(many.rng.bit_generator.state, ring.rng.bit_generator.state)

  def test_activation_frequencies_and_seeds(self):
    rule = matcha_rule.MatchingGossip(0.4)
    probabilities = matcha.ring_plan(5, 0.4).probabilities
    draws = np.stack([rule.activations(5, t) for t in range(4000)])
    np.testing.assert_allclose(draws.mean(0), probabilities, atol=4 * np.sqrt(0.25 / 4000))
    # Independent matchings: the pair frequency is the product.
    np.testing.assert_allclose((draws[:, 0] & draws[:, 1]).mean(), probabilities[0] * probabilities[1], atol=0.03)
    other = matcha_rule.MatchingGossip(0.4, seed=1)
    self.assertFalse(np.array_equal(draws[:50], np.stack([other.activations(5, t) for t in range(50)])))
    np.testing.assert_array_equal(draws[7], rule.activations(5, 7))

  def test_only_active_matchings_are_waited_for_and_charged(self):
    # Worker 0 three times slower. The first seed whose iteration 0 draws matching 0 = {(0,1), (2,3)} alone
    # (matching 1 = {(1,2), (3,0)} off).
    seed = next(s for s in range(100)
                if list(matcha_rule.MatchingGossip(0.5, seed=s).activations(4, 0)) == [True, False])
    clock = helpers.clock(matcha_rule.MatchingGossip(0.5, seed=seed), workers=4, base_s=X, slow_workers=(0,),
                          slow_factor=3.0, network=NET, seed=seed)
    p2p = clock.network.p2p(clock.model_bytes)
    block = clock.next_block(1)
    np.testing.assert_allclose(clock.times, [3 * X + p2p, 3 * X + p2p, X + p2p, X + p2p], rtol=1e-12)
    np.testing.assert_allclose(block.idle[0], [0, 2 * X, 0, 0], atol=1e-15)
    np.testing.assert_allclose(block.bytes_communicated, 4 * clock.model_bytes)
    self.assertEqual(int(block.schedule.active[0]), 1)
    # Both on (budget 1): worker 3 now also waits for worker 0, and everyone makes two exchanges.
    both = helpers.clock(matcha_rule.MatchingGossip(1.0), workers=4, base_s=X, slow_workers=(0,), slow_factor=3.0,
                         network=NET)
    both.next_block(1)
    np.testing.assert_allclose(both.times, [3 * X + 2 * p2p, 3 * X + 2 * p2p, X + 2 * p2p, 3 * X + 2 * p2p])

  def test_a_lower_budget_is_faster_on_a_slow_network(self):
    slow = dict(NET, bandwidth_gbps=0.01)
    times = [helpers.clock(self._rule(8, b), workers=8, network=slow, base_s=X).next_block(200).sim_time[-1]
             for b in (1.0, 0.5, 0.2)]
    self.assertGreater(times[0], times[1])
    self.assertGreater(times[1], times[2])


class MatchaConfigTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('budget_zero', 'matcha,budget=0.0', r"^algorithm.budget=0.0 is not allowed: must be a number in \(0, 1\]"),
      ('budget_above_one', 'matcha,budget=1.5', r'^algorithm.budget=1.5 is not allowed'),
      ('alpha_negative', 'matcha,alpha=-0.5', r'^algorithm.alpha=-0.5 is not allowed: must be None'),
      ('alpha_diverges', 'matcha,alpha=2.0', r"^algorithm.alpha=2.0 is not allowed: makes the gossip diverge .* the "
                                            r"paper's alpha is 0\.\d+$"),
  )
  def test_one_line_naming_the_field(self, arg, pattern):
    with self.assertRaisesRegex(errors.ConfigError, pattern) as caught:
      validation.validate(harness.synthetic_config(arg, workers=8, devices=8))
    self.assertNotIn('\n', str(caught.exception))

  def test_defaults_validate(self):
    validation.validate(harness.synthetic_config('matcha'))

  def test_more_workers_than_its_dense_plan_takes_is_one_line_before_any_plan(self):
    with self.assertRaisesRegex(errors.ConfigError, r'^workers=2048 is not allowed: matcha plans its matchings on '
                                r'dense P x P Laplacians .*: at most 1024 workers$'):
      validation.validate(harness.synthetic_config('matcha', workers=2048, devices=8))


if __name__ == '__main__':
  absltest.main()
