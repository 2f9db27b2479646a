"""Streaming DiLoCo: DiLoCo whose outer steps go fragment by fragment, overlapped with the inner steps.

The parameters, flattened in leaf order, are split into F contiguous fragments of equal size (+-1 element; a
leaf may be split: LPP-SGD's blocks, `lap_sgd.block_bounds`). Fragment f is synchronised every H steps,
staggered: its sync point is after step t with t mod H == o_f - 1, o_f = (f + 1) H // F (the last fragment at
the end of each round of H, the others evenly before it; F <= H so that at most one fragment syncs per step).
Update rule (H = `local_steps`, d = `delay`, alpha = `mix`, OuterOpt as in `diloco`):
    W_i <- W_i + U_i(g_i)                                (inner step, local inner optimizer state)
    snapshot of fragment f after step t:  s_i,f <- W_i,f; the all-reduce of the snapshots starts
    merge after step t + d:  Delta_f = W_outer,f - mean_j s_j,f
                             W_outer,f <- W_outer,f + OuterOpt_f(Delta_f)   (one outer state per fragment)
                             W_i,f <- alpha W_i,f + (1 - alpha) W_outer,f   (merge with the local progress)
`overlap` places the d overlapped steps around the sync point (`snapshot_table`):
  'merge_late' (default): the snapshot at the sync point, the merge d steps after it. This is the paper's
    convention as its overlapping-communication part describes it (Douillard et al. 2025, arXiv:2501.18512;
    section and algorithm numbers not checked here, only the abstract was at hand): a fragment's outer
    gradient is sent at its sync point while inner steps go on, and is received, applied and mixed tau
    steps later. Any 0 <= d <= H; a merge may fall in the next round.
  'snapshot_early': the snapshot d steps before the sync point, the merge at it: torchft's DiLoCo
    (`torchft/local_sgd.py`, `fragment_sync_delay` = d: `prepare_sync` at local step H/F - d, `perform_sync`
    at H/F). Needs F | H and d < H / F, as torchft does: the next fragment's snapshot comes after this one's
    merge, so one all-reduce is in flight at a time and a round's events stay inside the round.
d = 0: the snapshot is the current fragment, the sync blocking, and the two conventions are the same update.
F = 1, d = 0, alpha = 0 is DiLoCo. With d >= 1 they differ: 'merge_late' merges the mean of the fragments at
the sync point and keeps the d steps after it as local progress; 'snapshot_early' averages fragments d steps
older and keeps the d steps before the sync point. The snapshot, the all-reduce in flight and the merge are
`algorithms.delayed_averaging` (its `mix` form, p = alpha, with the new outer fragment in place of the mean);
the outer step is `diloco.outer_step`.

Overlap on real accelerators: the period is fixed (`round_length` = H). In a block of whole rounds the
positions are static and no collective sits under a conditional: a fragment whose merge falls in the same
round issues its all-reduce right after its snapshot; one whose merge falls in the next round (t mod H + d
>= H, 'merge_late' only) carries its snapshot across the round boundary and issues it at position 0, as
DaSGD. Each all-reduce moves one fragment, so peak bandwidth falls F-fold against DiLoCo. Other blocks (and
library loops) take the per-iteration path, one `lax.switch` over the fragment for the merge and one for the
snapshot, driven by the replicated step; both paths compute the same floating-point operations.

Time (`StreamingAverage`, `cluster/rules/streaming_diloco.py`): workers step without waiting. A snapshot's all-reduce
of M / F bytes starts when every worker has taken it, R_f = max_j (end_j) + allreduce(M / F, P); at the merge step
worker i waits until R_f, or not at all when that is earlier: end_i = max(c_i, R_f). Communication is hidden when
allreduce(M / F) <= d x step time. d = 0: everybody waits for the last worker and the all-reduce (blocking).
The rule is the same for both conventions: in both the all-reduce is issued at the snapshot (torchft's
`prepare_sync` starts it on a side stream) and must have arrived at the merge (`perform_sync` waits on it), d
steps later; only the steps at which these fall differ (`snapshot_table`), and the rule reads them from the
same table as the math. Not charged: torchft's synchronous quorum at `prepare_sync` (its fault-tolerance
protocol, which the paper's algorithm does not have). Reported: `sync_bytes`, the bytes one sync puts on the
network (max over a window: the peak per sync).

Reference: Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a Distributed Free
Lunch", arXiv:2501.18512 (2025) (alpha = 0.5 and an overlap of 1 to 5 steps there; inner AdamW). torchft:
github.com/pytorch/torchft, torchft/local_sgd.py (`DiLoCo`, `_StreamingDiLoCoFragment`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import collectives
from waitless.algorithms import delayed_averaging
from waitless.algorithms import diloco
from waitless.algorithms import lap_sgd
from waitless.algorithms import spec

Piece = tuple[int, int, int]  # (leaf index, start, stop) in that leaf flattened

MERGE_LATE = 'merge_late'          # snapshot at the sync point, merge d steps later (the paper)
SNAPSHOT_EARLY = 'snapshot_early'  # snapshot d steps before the sync point, merge at it (torchft)
OVERLAPS = (MERGE_LATE, SNAPSHOT_EARLY)


# ---- fragments and their sync steps ----

def sync_table(local_steps: int, fragments: int) -> np.ndarray:
  """int32 (H,): the fragment that syncs after a step at each position t mod H, -1 for none."""
  if not 1 <= fragments <= local_steps:
    raise ValueError(f'need 1 <= fragments <= local_steps, got fragments={fragments}, local_steps={local_steps}')
  table = np.full(local_steps, -1, np.int32)
  for f in range(fragments):
    table[(f + 1) * local_steps // fragments - 1] = f
  return table


def check_overlap(local_steps: int, fragments: int, delay: int, overlap: str) -> None:
  """ValueError unless `overlap` is known and, for 'snapshot_early', F | H and d < H / F (torchft's checks)."""
  if overlap not in OVERLAPS:
    raise ValueError(f'overlap must be one of {OVERLAPS}, got {overlap!r}')
  if overlap == SNAPSHOT_EARLY and local_steps % fragments:
    raise ValueError(f'overlap={SNAPSHOT_EARLY!r} needs fragments to divide local_steps, got fragments={fragments},'
                     f' local_steps={local_steps}')
  if overlap == SNAPSHOT_EARLY and delay >= local_steps // fragments:
    raise ValueError(f'overlap={SNAPSHOT_EARLY!r} needs delay < local_steps / fragments, got delay={delay}, '
                     f'local_steps / fragments={local_steps // fragments}')


def snapshot_table(local_steps: int, fragments: int, delay: int, overlap: str = MERGE_LATE) -> np.ndarray:
  """int32 (H,): the fragment snapshotted (its all-reduce issued) after a step at each position t mod H, -1 for
  none; its merge comes `delay` positions later. 'merge_late': the `sync_table`; 'snapshot_early': the sync
  table moved `delay` positions earlier (with d < H / F no snapshot moves into the previous round)."""
  table = sync_table(local_steps, fragments)
  check_overlap(local_steps, fragments, delay, overlap)
  return table if overlap == MERGE_LATE else np.roll(table, -delay)


def fragment_pieces(sizes: Sequence[int], fragments: int) -> list[list[Piece]]:
  """Per fragment, the leaf slices it covers: `lap_sgd.block_bounds` of the leaves flattened in order."""
  bounds = lap_sgd.block_bounds(int(sum(sizes)), fragments)
  if np.any(np.diff(bounds) == 0):
    raise ValueError(f'{fragments} fragments of a model with {sum(sizes)} parameters leave one empty')
  starts = np.concatenate(([0], np.cumsum(sizes)))
  pieces = []
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    pieces.append([(k, int(max(lo, starts[k]) - starts[k]), int(min(hi, starts[k + 1]) - starts[k]))
                   for k in range(len(sizes)) if max(lo, starts[k]) < min(hi, starts[k + 1])])
  return pieces


def gather(leaves: Sequence[jax.Array], pieces: Sequence[Piece]) -> jax.Array:
  """The fragment as one vector."""
  return jnp.concatenate([jnp.ravel(leaves[k])[a:b] for k, a, b in pieces])


def scatter(leaves: Sequence[jax.Array], pieces: Sequence[Piece], vector: jax.Array) -> list[jax.Array]:
  """`leaves` with the fragment replaced by `vector`."""
  leaves, offset = list(leaves), 0
  for k, a, b in pieces:
    x = leaves[k]
    flat = jnp.ravel(x).at[a:b].set(vector[offset:offset + b - a].astype(x.dtype))
    leaves[k], offset = flat.reshape(jnp.shape(x)), offset + b - a
  return leaves


# ---- the math ----

class StreamingDiLoCoState(NamedTuple):
  """State of `streaming_diloco` on one worker.

  Attributes:
    count: int32 (): local steps taken so far (the same on every worker).
    inner: this worker's own inner optimizer state.
    outer_params: F vectors: W_outer,f, the same on every worker.
    outer: F outer optimizer states (momentum of each fragment), the same on every worker.
    buffer: F vectors (d > 0; () for d = 0): the snapshot s_i,f in flight, or its mean once issued inside a round
      (`delayed_averaging`).
  """
  count: jax.Array
  inner: optax.OptState
  outer_params: tuple
  outer: tuple
  buffer: tuple


def streaming_diloco(inner: optax.GradientTransformation, outer: optax.GradientTransformation, local_steps: int,
                     fragments: int = 2, delay: int = 1, mix: float = 0.5,
                     axis_name: collectives.AxisName = None,
                     overlap: str = MERGE_LATE) -> optax.GradientTransformationExtraArgs:
  """DiLoCo over F staggered fragments, each merged d steps after its snapshot (see the module docstring).

  Args:
    inner: the inner optimizer U, applied by each worker to its own gradient.
    outer: OuterOpt (`diloco.outer_optimizer`), one state per fragment.
    local_steps: H >= 1, steps between two syncs of the same fragment.
    fragments: F in 1..H.
    delay: d in 0..H, steps between a fragment's snapshot and its merge.
    mix: alpha in [0, 1], the share of the local fragment kept at the merge.
    axis_name: the worker axes; None for one worker.
    overlap: where the d overlapped steps go: 'merge_late' (snapshot at the sync point, merge d steps later;
      the paper) or 'snapshot_early' (snapshot d steps before the sync point, merge at it; torchft; needs
      F | H and d < H / F).

  Returns:
    A transformation whose `update(grads, state, params, *, step=None, round_position=None)` moves each
    worker's params. `step`: the replicated iteration number (None: the state's counter). `round_position`:
    static step mod H, for a caller that runs whole rounds.
  """
  if not 0 <= delay <= local_steps:
    raise ValueError(f'need 0 <= delay <= local_steps, got delay={delay}, local_steps={local_steps}')
  table = snapshot_table(local_steps, fragments, delay, overlap)
  if spec.is_static_number(mix) and not 0.0 <= mix <= 1.0:  # a traced mix was validated in its config
    raise ValueError(f'mix must be in [0, 1], got {mix}')
  inner = optax.with_extra_args_support(inner)
  positions = [int(np.flatnonzero(table == f)[0]) for f in range(fragments)]  # snapshot position of each

  def pieces_of(leaves):
    return fragment_pieces([int(np.prod(np.shape(x), dtype=np.int64)) for x in leaves], fragments)

  @spec.owns_its_buffers
  def init_fn(params):
    leaves = jax.tree.leaves(params)
    outer_params = tuple(gather(leaves, p) for p in pieces_of(leaves))
    buffer = tuple(delayed_averaging.init(x) for x in outer_params) if delay else ()
    return StreamingDiLoCoState(count=jnp.zeros((), jnp.int32), inner=inner.init(params),
                                outer_params=outer_params, outer=tuple(outer.init(x) for x in outer_params),
                                buffer=buffer)

  def update_fn(grads, state, params=None, *, step: Optional[jax.Array] = None,
                round_position: Optional[int] = None, **extra):
    del extra
    stepped, inner_state = spec.local_step('streaming_diloco', inner, grads, state.inner, params)
    leaves, treedef = jax.tree.flatten(stepped)
    pieces = pieces_of(leaves)
    t = state.count if step is None else step

    def merge(f: int, carry, mean, where=None):
      """Outer step of fragment f from the mean of its snapshots, then W_i,f <- alpha W_i,f + (1-alpha) W_outer,f."""
      leaves, outer_params, outer_state, buffer = carry
      new_outer, new_state = diloco.outer_step(outer, outer_params[f], outer_state[f], mean)
      local = gather(leaves, pieces[f])
      merged = delayed_averaging.apply(local, new_outer, delayed_averaging.MIX, mix)
      if where is not None:  # first round: nothing in flight yet, keep everything as it was
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(where, n, o), new, old)
        new_outer, new_state, merged = (keep(new_outer, outer_params[f]), keep(new_state, outer_state[f]),
                                        keep(merged, local))
      return (scatter(leaves, pieces[f], merged), _put(outer_params, f, new_outer),
              _put(outer_state, f, new_state), buffer)

    def blocking(f: int, carry):
      return merge(f, carry, collectives.worker_mean(gather(carry[0], pieces[f]), axis_name))

    def delayed(f: int, carry):
      return merge(f, carry, delayed_averaging.issue(carry[3][f], axis_name, delayed_averaging.MIX))

    def snapshot(f: int, carry):
      leaves, outer_params, outer_state, buffer = carry
      return leaves, outer_params, outer_state, _put(buffer, f, gather(leaves, pieces[f]))

    def switch(index, branch, carry):  # index -1: no fragment
      branches = [lambda c: c] + [lambda c, f=f: branch(f, c) for f in range(fragments)]
      return lax.switch(index + 1, branches, carry)

    carry = (leaves, state.outer_params, state.outer, state.buffer)
    if round_position is not None:  # static position: no conditional around any collective
      r = round_position
      synced = int(table[r])
      if delay == 0:
        if synced >= 0:
          carry = blocking(synced, carry)
      else:
        wrapped = [f for f in range(fragments) if positions[f] + delay >= local_steps]
        if r == 0:  # issue the all-reduces of the snapshots carried over from the previous round
          buffer = list(carry[3])
          for f in wrapped:
            buffer[f] = delayed_averaging.issue(buffer[f], axis_name, delayed_averaging.MIX)
          carry = carry[:3] + (tuple(buffer),)
        applied = int(table[(r - delay) % local_steps])
        if applied >= 0:
          in_flight = (t >= local_steps) if applied in wrapped else None
          carry = merge(applied, carry, carry[3][applied], where=in_flight)
        if synced >= 0:
          carry = snapshot(synced, carry)
          if synced not in wrapped:  # merged in this round: issue now, consumed `delay` positions later
            buffer = _put(carry[3], synced, delayed_averaging.issue(carry[3][synced], axis_name,
                                                                  delayed_averaging.MIX))
            carry = carry[:3] + (buffer,)
    else:
      table_j = jnp.asarray(table)
      position = jnp.asarray(t, jnp.int32) % local_steps
      if delay == 0:
        carry = switch(table_j[position], blocking, carry)
      else:
        applied = jnp.where(t >= delay, table_j[(position - delay) % local_steps], -1)
        carry = switch(applied, delayed, carry)
        carry = switch(table_j[position], snapshot, carry)
    leaves, outer_params, outer_state, buffer = carry
    new_params = jax.tree.unflatten(treedef, leaves)
    updates = jax.tree.map(lambda new, old: new - old, new_params, params)
    return updates, StreamingDiLoCoState(count=optax.safe_increment(state.count), inner=inner_state,
                                         outer_params=outer_params, outer=outer_state, buffer=buffer)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _put(values: tuple, index: int, value: Any) -> tuple:
  return values[:index] + (value,) + values[index + 1:]


# ---- config glue ----

def validate(config):
  a = config.algorithm
  errors.require_int(a.local_steps, 'algorithm.local_steps', 1)
  errors.require_int(a.fragments, 'algorithm.fragments', 1, a.local_steps)
  errors.require_int(a.delay, 'algorithm.delay', 0, a.local_steps)
  errors.require_number(a.mix, 'algorithm.mix', 'must be a number in [0, 1]', lambda v: 0.0 <= v <= 1.0)
  errors.require(a.overlap in OVERLAPS, 'algorithm.overlap', a.overlap, f'must be one of {", ".join(OVERLAPS)}')
  if a.overlap == SNAPSHOT_EARLY:  # torchft's DiLoCo checks
    errors.require(a.local_steps % a.fragments == 0, 'algorithm.fragments', a.fragments,
                   f'must divide algorithm.local_steps (= {a.local_steps}) with overlap={SNAPSHOT_EARLY}')
    errors.require(a.delay < a.local_steps // a.fragments, 'algorithm.delay', a.delay,
                   f'must be < local_steps / fragments (= {a.local_steps // a.fragments}) with '
                   f'overlap={SNAPSHOT_EARLY}: the next snapshot must come after this merge')
  diloco.validate_outer(config)


def round_length(config):
  """H: every fragment's snapshot and merge repeat every H steps (the first round masks the carried merges)."""
  return config.algorithm.local_steps


SPEC = spec.AlgorithmSpec(
    name='streaming_diloco',
    defaults={'local_steps': 4, 'fragments': 2, 'delay': 1, 'mix': 0.5, 'overlap': MERGE_LATE,
              **diloco.OUTER_DEFAULTS},
    build=lambda config, inner, axis_name: streaming_diloco(
        inner, diloco.outer_from_config(config), local_steps=config.algorithm.local_steps,
        fragments=config.algorithm.fragments, delay=config.algorithm.delay, mix=config.algorithm.mix,
        axis_name=axis_name, overlap=config.algorithm.overlap),
    validate=validate, round_length=round_length,
    hyperparameters=('mix', *diloco.OUTER_HYPERPARAMETERS))
