"""MATCHA: decentralized SGD whose gossip graph is decomposed into matchings, each used with a probability.

The base graph (`BaseGraph`: the ring of D-PSGD by default; a seeded Erdos-Renyi or random geometric graph, the
kinds of the paper's experiments and of its authors' code) is split into disjoint matchings G_1..G_J with
Laplacians L_j (`decompose`: a proper edge colouring). Iteration k activates matching j with probability p_j,
independently, B_j(k) ~ Bernoulli(p_j), and worker i, U_i its inner optimizer with its local state, does
    W_i <- W_i + U_i(g_i(W_i))                                  (a local step)
    W_i <- W_i - alpha * sum_{j: B_j(k) = 1, i matched in G_j} (W_i - W_{partner_j(i)})
i.e. X <- W(k) (X + U), W(k) = I - alpha sum_j B_j(k) L_j, the paper's x_{k+1} = W(k) (x_k - eta g(x_k)),
in the order of D-PSGD's default `gossip_then_step` (params hold the mixed model).
Activation probabilities (the paper's first problem; `activation_probabilities`): maximise the algebraic connectivity
lambda_2(sum_j p_j L_j) subject to sum_j p_j <= C_b J, 0 <= p_j <= 1, with C_b = `budget` in (0, 1]: the
expected communication is at most C_b of D-PSGD's. Budget 1 activates every matching always (p_j = 1).
Mixing weight (the paper's second problem; `mixing_weight`): alpha minimises rho = ||E[W(k)^T W(k)] - 11^T/P||, with
E[W^T W] = I - 2 alpha E[L] + alpha^2 (E[L]^2 + 2 sum_j p_j (1 - p_j) L_j) (a matching has L_j^2 = 2 L_j);
`alpha` set explicitly replaces it. With p = 1 this is alpha = 2 / (lambda_2 + lambda_P) of the base Laplacian.
Special case (tested): budget 1 and alpha = 1/3 on a ring of P >= 3 workers is `dpsgd` (W = I - L/3 is the
mean of the two neighbours and oneself); alpha = 1/2 for P = 2.

The authors solve both problems with cvxpy (JYWa/MATCHA, graph_manager.py, `MatchaProcessor.getProbability` /
`getAlpha`); here, without that dependency, the first is
Kelley's cutting-plane method (an LP in scipy per cut, lambda_2 being the minimum of the linear functions
x^T L(p) x over unit x orthogonal to 1) and the second a bisection on rho's exact one-sided derivatives (rho is
convex in alpha), to float64 rounding. Both are deterministic.

Activations are drawn on the host by the time rule (`MatchingGossip`) from a stream keyed by (config seed,
iteration), independent of the clock's compute-time stream: the same seed gives MATCHA the straggler trace it
gives D-PSGD, and a resumed run the draws an uninterrupted one saw. They reach `update` as the schedule's
uniform bitmask `active`, so a matching that is off is a real branch not taken: no exchange.
Time per iteration (`MatchingGossip`, `cluster/rules/matcha.py`): worker i waits for the partners of its active
matchings to finish computing, then exchanges with each of them: end_i = max(c_i, max_{active j} c_{partner_j(i)}) +
a_i p2p(M), a_i the number of active matchings that pair i (D-PSGD's rule, of which budget 1 on the ring is the case
a_i = 2).

Off the simulator: the savings are real where the schedule's draws are used (an inactive matching sends
nothing); with one worker per device each active matching is one ppermute over its own edges.

Reference: Wang, Sahu, Yang, Joshi, Kar, "MATCHA: Speeding Up Decentralized SGD via Matching Decomposition
Sampling", Indian Control Conference 2019 (arXiv 1905.09435).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import collectives
from waitless.algorithms import spec

def ring_edges(workers: int) -> tuple[tuple[int, int], ...]:
  """The edges (i, i + 1 mod P) of the ring of D-PSGD, in order: none for P = 1, one for P = 2."""
  if workers < 2:
    return ()
  if workers == 2:
    return ((0, 1),)
  return tuple((i, (i + 1) % workers) for i in range(workers))


GRAPHS = ('ring', 'erdos_renyi', 'geometric')
GRAPH_STREAM = 0x4752  # keys a base graph's draws apart from any other stream of the same seed
MAX_GRAPH_DRAWS = 1000  # draws of a random graph before its parameters are called too sparse to connect P workers


@dataclasses.dataclass(frozen=True)
class BaseGraph:
  """The graph MATCHA decomposes into matchings.

  Attributes:
    kind: 'ring' (D-PSGD's, the default); 'erdos_renyi' (each pair of workers an edge with `edge_probability`);
      'geometric' (workers at uniform points of the unit square, an edge between two within `radius`). The two
      random kinds are the paper's base graphs (Wang et al. 2019, Fig. 1 and A.3; JYWa/MATCHA's `select_graph`
      holds fixed draws of them).
    seed: the random graphs' seed (not the run's: every seed of a comparison gossips over the same graph). The
      first connected draw of numpy's generator seeded by (seed, GRAPH_STREAM) is the graph.
    edge_probability: erdos_renyi's.
    radius: geometric's.
  """
  kind: str = 'ring'
  seed: int = 0
  edge_probability: float = 0.5
  radius: float = 0.5

  def edges(self, workers: int) -> tuple[tuple[int, int], ...]:
    """The edges (u, v), u < v (the ring's in `ring_edges` order), of a connected graph on `workers`.

    Raises:
      ValueError: no connected draw in MAX_GRAPH_DRAWS (the graph's parameter is too small for P workers).
    """
    if self.kind == 'ring':
      return ring_edges(workers)
    rng = np.random.default_rng([self.seed, GRAPH_STREAM])
    pairs = [(u, v) for u in range(workers) for v in range(u + 1, workers)]
    for _ in range(MAX_GRAPH_DRAWS):
      if self.kind == 'erdos_renyi':
        keep = rng.random(len(pairs)) < self.edge_probability
      else:
        points = rng.random((workers, 2))
        keep = np.array([np.hypot(*(points[u] - points[v])) <= self.radius for u, v in pairs], bool)
      edges = tuple(pair for pair, k in zip(pairs, keep) if k)
      if _connected(edges, workers):
        return edges
    what = (f'edge_probability={self.edge_probability}' if self.kind == 'erdos_renyi'
            else f'radius={self.radius}')
    raise ValueError(f'{what} gives no connected {self.kind} graph of {workers} workers in {MAX_GRAPH_DRAWS} draws')


def _connected(edges: Sequence[tuple[int, int]], workers: int) -> bool:
  """Whether the graph reaches every worker from worker 0 (one worker: trivially)."""
  reached, frontier = {0}, [0]
  neighbours = [[] for _ in range(workers)]
  for u, v in edges:
    neighbours[u].append(v)
    neighbours[v].append(u)
  while frontier:
    for w in neighbours[frontier.pop()]:
      if w not in reached:
        reached.add(w)
        frontier.append(w)
  return len(reached) == workers


def decompose(edges: Sequence[tuple[int, int]], workers: int) -> tuple[tuple[int, ...], ...]:
  """Disjoint matchings covering `edges`: a proper edge colouring, greedy in the edges' order.

  Each edge takes the smallest colour free at both ends (at most 2 Delta - 1 colours; on the ring, in
  `ring_edges` order: two perfect matchings, even and odd edges, for even P; three for odd P, the third the
  closing edge (P - 1, 0)). The authors first peel maximum matchings with networkx, then colour the rest
  greedily; on the ring both give the same matchings.

  Args:
    edges: pairs (u, v) of distinct workers in [0, P), each pair at most once.
    workers: P.

  Returns:
    One partner table per matching: partners[i] = worker i's partner, i itself where i is not matched.

  Raises:
    ValueError: a self-loop, a repeated edge or a worker outside [0, P).
  """
  colours: list[list[int]] = []  # colours[j][i] = i's partner in matching j
  used: list[set[int]] = [set() for _ in range(workers)]
  seen = set()
  for u, v in edges:
    if not (0 <= u < workers and 0 <= v < workers) or u == v or frozenset((u, v)) in seen:
      raise ValueError(f'edge ({u}, {v}): edges must join two distinct workers in [0, {workers}), each pair once')
    seen.add(frozenset((u, v)))
    j = next(c for c in range(len(colours) + 1) if c not in used[u] and c not in used[v])
    if j == len(colours):
      colours.append(list(range(workers)))
    colours[j][u], colours[j][v] = v, u
    used[u].add(j)
    used[v].add(j)
  return tuple(tuple(c) for c in colours)


def laplacian(partners: Sequence[int]) -> np.ndarray:
  """L_j of one matching: (P, P) float64, +1 on the diagonal of matched workers, -1 between partners."""
  p = len(partners)
  lap = np.zeros((p, p))
  for i, j in enumerate(partners):
    if i != j:
      lap[i, i], lap[i, j] = 1.0, -1.0
  return lap


def _complement_of_ones(p: int) -> np.ndarray:
  """An orthonormal basis (P, P - 1) of the vectors orthogonal to 1, where every Laplacian's spectrum but
  the 0 of the consensus direction lives."""
  _, vectors = np.linalg.eigh(np.eye(p) - np.full((p, p), 1.0 / p))
  return vectors[:, 1:]  # eigenvalue 0 (the ones direction) first, then P - 1 eigenvalues 1


def activation_probabilities(laplacians: Sequence[np.ndarray], budget: float, tol: float = 1e-10,
                             max_cuts: int = 500) -> np.ndarray:
  """p maximising lambda_2(sum_j p_j L_j) subject to sum_j p_j <= budget * J, 0 <= p_j <= 1 (authors' getProbability).

  lambda_2 is the least eigenvalue on the complement of 1, the minimum over unit x there of the linear
  functions x^T L(p) x: concave in p. Kelley's cutting planes: an LP maximises t subject to t <= x^T L(p) x for
  the eigenvectors x collected so far; each LP solution p adds the eigenvectors of lambda_2(L(p)) (all of them:
  the ring's lambda_2 is double) until the LP's bound is within `tol` of the best lambda_2 found.
  Budget 1: every p_j = 1 (the only choice that never leaves a matching out; it maximises lambda_2, which
  grows with every p_j).

  Args:
    laplacians: the matchings' L_j, (P, P) each.
    budget: C_b in (0, 1].
    tol: absolute gap between the LP's bound and the lambda_2 returned.
    max_cuts: LP solves at most.

  Returns:
    float64 (J,), each in [0, 1].
  """
  from scipy import optimize  # scipy: only when a plan is made
  j = len(laplacians)
  if j == 0 or budget >= 1:
    return np.ones(j)
  q = _complement_of_ones(laplacians[0].shape[0])
  reduced = np.stack([q.T @ lap @ q for lap in laplacians])  # (J, P-1, P-1)
  upper = 2.0 * j  # each L_j has eigenvalues 0 and 2, so lambda_2(L(p)) <= 2 J
  cuts: list[np.ndarray] = []  # rows: (-x^T L_1 x, ..., -x^T L_J x, 1) . (p, t) <= 0
  budget_row = np.concatenate([np.ones(j), [0.0]])
  best_p, best_value = np.full(j, budget), -np.inf
  p = best_p
  for _ in range(max_cuts):
    values, vectors = np.linalg.eigh(np.tensordot(p, reduced, axes=1))
    if values[0] > best_value:
      best_p, best_value = p, values[0]
    for x in vectors[:, values <= values[0] + 1e-9].T:
      cuts.append(np.concatenate([-np.einsum('a,jab,b->j', x, reduced, x), [1.0]]))
    lp = optimize.linprog(c=np.concatenate([np.zeros(j), [-1.0]]), A_ub=np.vstack(cuts + [budget_row]),
                          b_ub=np.concatenate([np.zeros(len(cuts)), [budget * j]]),
                          bounds=[(0.0, 1.0)] * j + [(None, upper)], method='highs',
                          options={'primal_feasibility_tolerance': 1e-10, 'dual_feasibility_tolerance': 1e-10})
    if lp.status != 0:
      raise RuntimeError(f'activation_probabilities: the LP failed ({lp.message})')
    p = np.clip(lp.x[:j], 0.0, 1.0)
    if -lp.fun - best_value <= tol:
      break
  return best_p


def _contraction(laplacians: Sequence[np.ndarray], probabilities, q: np.ndarray):
  """(E[L], S) on the complement of 1 (basis q), with E[W^T W] - 11^T/P = I - 2 alpha E[L] + alpha^2 S there."""
  mean = sum(pj * lap for pj, lap in zip(probabilities, laplacians))
  second = mean @ mean + 2.0 * sum(pj * (1.0 - pj) * lap for pj, lap in zip(probabilities, laplacians))
  return q.T @ mean @ q, q.T @ second @ q


def contraction_factor(laplacians: Sequence[np.ndarray], probabilities, alpha: float) -> float:
  """rho(alpha) = lambda_max(E[W^T W] - 11^T/P), W = I - alpha sum_j B_j L_j, B_j ~ Bernoulli(p_j) (0 for no
  matching); < 1: the gossip contracts to the mean in expectation."""
  if not laplacians:
    return 0.0
  mean, second = _contraction(laplacians, probabilities, _complement_of_ones(laplacians[0].shape[0]))
  return float(np.linalg.eigvalsh(np.eye(len(mean)) - 2.0 * alpha * mean + alpha * alpha * second)[-1])


def _slopes(mean: np.ndarray, second: np.ndarray, alpha: float) -> tuple[float, float]:
  """The left and right derivatives of rho at alpha: the extreme eigenvalues of d/dalpha (-2 alpha E[L] + alpha^2 S)
  = 2 (alpha S - E[L]) restricted to the top eigenspace of E[W^T W] - 11^T/P (one slope where it is simple)."""
  values, vectors = np.linalg.eigh(np.eye(len(mean)) - 2.0 * alpha * mean + alpha * alpha * second)
  top = vectors[:, values >= values[-1] - 1e-12 * max(1.0, abs(values[-1]))]
  slopes = np.linalg.eigvalsh(top.T @ (2.0 * (alpha * second - mean)) @ top)
  return float(slopes[0]), float(slopes[-1])


def mixing_weight(laplacians: Sequence[np.ndarray], probabilities: np.ndarray) -> float:
  """alpha minimising rho(alpha) = lambda_max(E[W^T W] - 11^T/P) (authors' getAlpha; `contraction_factor`).

  On the complement of 1, E[W^T W] - 11^T/P = I - 2 alpha E[L] + alpha^2 S, S = E[L]^2 + 2 sum_j p_j (1 - p_j) L_j
  (a matching has L_j^2 = 2 L_j): a maximum of quadratics in alpha, convex. Along the top eigenvector of E[L]
  (eigenvalue e) it is at least (1 - alpha e)^2, which is >= 1 = rho(0) from alpha = 2 / e on: the minimiser lies
  in [0, 2 / e]. Solved by bisection on the sign of rho's exact one-sided derivatives (`_slopes`: where the top
  eigenvalue is simple, x^T 2 (alpha S - E[L]) x of its eigenvector), to the last bits of float64: a search on
  rho's values stops at about the square root of the rounding (1e-8) where rho is flat around its minimum.

  Args:
    laplacians: the matchings' L_j.
    probabilities: p_j.

  Returns:
    alpha (0 where no matching is ever active).
  """
  if not laplacians:
    return 0.0
  mean, second = _contraction(laplacians, probabilities, _complement_of_ones(laplacians[0].shape[0]))
  top = float(np.linalg.eigvalsh(mean)[-1])
  if top <= 0:
    return 0.0
  low, high = 0.0, 2.0 / top
  while high - low > 4 * np.finfo(float).eps * high:
    middle = 0.5 * (low + high)
    if middle in (low, high):
      break
    left, right = _slopes(mean, second, middle)
    if left > 0:     # rho increases on both sides: the minimiser is below
      high = middle
    elif right < 0:  # rho decreases on both sides: above
      low = middle
    else:            # 0 is a subgradient: the minimiser (a kink, or a flat bottom)
      return middle
  return 0.5 * (low + high)


@dataclasses.dataclass(frozen=True)
class Plan:
  """MATCHA on a graph of P workers: its matchings, their activation probabilities and the mixing weight.

  Attributes:
    partners: one partner table (P,) per matching (`decompose`).
    probabilities: p_j per matching.
    alpha: the mixing weight.
    rho: `contraction_factor` at alpha (< 1: the expected mixing contracts).
  """
  partners: tuple[tuple[int, ...], ...]
  probabilities: tuple[float, ...]
  alpha: float
  rho: float


@functools.lru_cache(maxsize=64)
def matchings(workers: int, budget: float, graph: BaseGraph = BaseGraph()):
  """(partner tables, Laplacians, probabilities) of `graph`: the LP runs once per (P, budget, graph), whatever
  alpha."""
  partners = decompose(graph.edges(workers), workers)
  laps = [laplacian(m) for m in partners]
  return partners, laps, activation_probabilities(laps, budget)


@functools.lru_cache(maxsize=64)
def plan(workers: int, budget: float, alpha: Optional[float] = None, graph: BaseGraph = BaseGraph()) -> Plan:
  """MATCHA's plan on `graph` over `workers` (the paper's alpha unless `alpha` is given)."""
  partners, laps, probs = matchings(workers, budget, graph)
  alpha = mixing_weight(laps, probs) if alpha is None else float(alpha)
  return Plan(partners=partners, probabilities=tuple(float(x) for x in probs), alpha=alpha,
              rho=contraction_factor(laps, probs, alpha))


def ring_plan(workers: int, budget: float, alpha: Optional[float] = None) -> Plan:
  """MATCHA's plan on the ring of `workers` (`plan` with the default graph)."""
  return plan(workers, budget, alpha)


def check_plan(budget, alpha) -> None:
  if not (spec.is_static_number(budget) and 0 < budget <= 1):
    raise ValueError(f'budget={budget!r} must be a number in (0, 1]')
  if alpha is not None and not (spec.is_static_number(alpha) and alpha > 0):
    raise ValueError(f'alpha={alpha!r} must be None (the paper\'s choice) or a number > 0')


class MatchaState(NamedTuple):
  """State of `matcha` on one worker.

  Attributes:
    inner: this worker's own inner optimizer state (never exchanged).
  """
  inner: optax.OptState


def matcha(inner: optax.GradientTransformation, budget: float = 0.5, alpha: Optional[float] = None,
           axis_name: collectives.AxisName = None, graph: BaseGraph = BaseGraph()
           ) -> optax.GradientTransformationExtraArgs:
  """A local step of `inner`, then a gossip over the matchings of `graph` that this iteration activates.

  Args:
    inner: the optimizer U, applied by each worker to its own gradient with its own state.
    budget: C_b in (0, 1], the expected share of the base graph's communication (D-PSGD's on the ring).
    alpha: the mixing weight; None: the paper's. See the module docstring.
    axis_name: the worker axes; None for one worker (then there is no matching and this is `inner`).
    graph: the base graph (`BaseGraph`; default the ring).

  Returns:
    A transformation whose `update(grads, state, params, *, schedule, **extra)` reads `schedule.active`, the
    bitmask of the active matchings (bit j: matching j of `plan(P, budget, graph=graph)`), drawn on the host
    (`MatchingGossip.activations`), and moves each worker's params to its new params.

  Example:
    tx = matcha(optax.sgd(0.1), budget=0.5, axis_name='workers')  # under vmap / shard_map over 'workers'
  """
  check_plan(budget, alpha)
  inner = optax.with_extra_args_support(inner)

  @spec.owns_its_buffers
  def init_fn(params):
    return MatchaState(inner=inner.init(params))

  def update_fn(grads, state, params=None, *, schedule=None, **extra):
    del extra
    if schedule is None:
      raise ValueError('matcha needs schedule.active, the matchings this iteration activates (drawn on the host '
                       'by MatchingGossip.activations)')
    stepped, inner_state = spec.local_step('matcha', inner, grads, state.inner, params)
    chosen = plan(collectives.num_workers(axis_name), float(budget), alpha, graph)
    active = jnp.asarray(schedule.active, jnp.int32)
    pull = None  # sum over active matchings of (W_i - W_partner)
    for j, partners in enumerate(chosen.partners):
      received = lax.cond((active >> j) & 1 == 1,
                          lambda x, partners=partners: collectives.matching_exchange(x, axis_name, partners),
                          lambda x: x, stepped)
      diff = jax.tree.map(jnp.subtract, stepped, received)
      pull = diff if pull is None else jax.tree.map(jnp.add, pull, diff)
    new_params = stepped if pull is None else jax.tree.map(
        lambda w, d: w - jnp.asarray(chosen.alpha, w.dtype) * d, stepped, pull)
    updates = jax.tree.map(lambda new, old: new - old, new_params, params)
    return updates, MatchaState(inner=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class MatchaSchedule(NamedTuple):
  """Schedule of one MATCHA iteration."""
  microbatches_done: np.ndarray  # int32 (P,), = microbatches for every worker
  active: np.ndarray             # int32 (), bit j set: matching j exchanges in this iteration
  UNIFORM = ('active',)


def base_graph(config) -> BaseGraph:
  """The config's `BaseGraph` (`algorithm.graph`, `graph_seed`, `edge_probability`, `radius`)."""
  a = config.algorithm
  return BaseGraph(kind=a.graph, seed=int(a.graph_seed), edge_probability=float(a.edge_probability),
                   radius=float(a.radius))


# The plan (activation probabilities and mixing weight) is solved on dense P x P Laplacians, O(P^3) per
# eigendecomposition: at 1,024 workers it takes seconds, at 4,096 tens of minutes and gigabytes.
MAX_WORKERS = 1024


def validate(config):
  a = config.algorithm
  errors.require(config.workers <= MAX_WORKERS, 'workers', config.workers,
                 f'matcha plans its matchings on dense P x P Laplacians (O(P^3)): at most {MAX_WORKERS} workers')
  errors.require_number(a.budget, 'algorithm.budget', 'must be a number in (0, 1]: the expected share of the '
                        "base graph's matchings active per iteration (1: every one; on the ring, D-PSGD)",
                        lambda b: 0 < b <= 1)
  errors.require(a.graph in GRAPHS, 'algorithm.graph', a.graph, f'must be one of {", ".join(GRAPHS)}')
  errors.require_int(a.graph_seed, 'algorithm.graph_seed', 0)
  errors.require_number(a.edge_probability, 'algorithm.edge_probability', 'must be a number in (0, 1]',
                        lambda v: 0 < v <= 1)
  errors.require_number(a.radius, 'algorithm.radius', 'must be a number in (0, 1.5] (the unit square)',
                        lambda v: 0 < v <= 1.5)
  graph = base_graph(config)
  try:
    graph.edges(config.workers)
  except ValueError as e:
    field = 'algorithm.edge_probability' if a.graph == 'erdos_renyi' else 'algorithm.radius'
    raise errors.ConfigError(field, a[field.split('.')[1]], f'{e}: raise it') from None
  if a.alpha is None:
    return
  errors.require_number(a.alpha, 'algorithm.alpha', "must be None (the paper's mixing weight) or a number > 0",
                        lambda v: v > 0)
  chosen = plan(config.workers, float(a.budget), float(a.alpha), graph)
  errors.require(chosen.rho < 1, 'algorithm.alpha', a.alpha,
                 f'makes the gossip diverge on the {a.graph} graph of {config.workers} workers at budget {a.budget} '
                 f"(rho = {chosen.rho:.3g} >= 1); the paper's alpha is "
                 f'{plan(config.workers, float(a.budget), graph=graph).alpha:.4g}')


SPEC = spec.AlgorithmSpec(
    name='matcha',
    defaults={
        'budget': 0.5,  # C_b in (0, 1]: expected share of the ring's matchings active per iteration (1: D-PSGD)
        'alpha': None,  # mixing weight; None: the paper's, minimising ||E[W^T W] - 11^T/P||
        'graph': 'ring',  # base graph: ring | erdos_renyi | geometric (`BaseGraph`)
        'graph_seed': 0,  # the random graphs' seed (one graph for every seed of a comparison)
        'edge_probability': 0.5,  # erdos_renyi: each pair an edge with this probability
        'radius': 0.5,  # geometric: workers at uniform points of the unit square, an edge within this distance
    },
    build=lambda config, inner, axis_name: matcha(inner, budget=config.algorithm.budget,
                                                  alpha=config.algorithm.alpha, axis_name=axis_name,
                                                  graph=base_graph(config)),
    validate=validate)
