"""What a synchronous step pays beyond its compute and one all-reduce: the all-reduce's overlap with the backward
pass, and the wait for the slowest of P workers.

These are properties of a step, not of a collective, so they take a collective model (`network.Network`, a
`stacks.Stack`) and the step's compute. The simulator's sync time rule (`rules/sync.py`) charges the overlap
through `after_compute` where the profile's framework gives its `backward_share` (piz_daint, piz_daint_nccl);
it samples every worker's compute, so it needs no closed form for the slowest worker.
`benchmarks/scale_validation.py` charges both in its closed-form step.

Overlap (`exposed`). A framework that all-reduces each gradient as the backward pass produces it (Horovod's
background thread: a tensor is submitted when its gradient op has run and fused with the others ready in the same
cycle, horovod/horovod docs/concepts and docs/tensor-fusion.rst; PyTorch DDP's buckets, launched when a bucket's
gradients are all ready, torch/nn/parallel/distributed.py) runs the all-reduce under the rest of the backward pass.
Of a micro-batch's compute t, the backward pass is the share `BACKWARD_SHARE` (Bk = share x t). The M gradient
bytes are taken to become ready uniformly over Bk (an assumption: a CNN's late layers, ready first, hold most of
its parameters and few of its FLOPs, so for CNNs this is the pessimistic side; a Transformer's layers are alike).
The all-reduce runs on one background thread or stream, one call after another:
  DDP (cycle_s = 0)      k = ceil(M / F) buckets, bucket j (1..k) ready at j Bk / k, each costing s = the per-call
                         cost of M / k bytes as `allreduce` charges it; the last finishes at
                         max_j (j Bk / k + (k - j + 1) s), so the step waits, after its backward pass,
                           exposed = max(s, k s - (k - 1) Bk / k)
  Horovod (cycle_s > 0)  its loop (horovod/common/operations.cc, RunLoopOnce): a cycle starts at least cycle_s after
                         the previous one began, or when the previous one's work ends if later; it negotiates the
                         tensors ready at its start and all-reduces them, fused into buffers of at most F. So
                         `exposed` follows the cycles: at a cycle's start the bytes ready and not yet reduced, R,
                         go in ceil(R / F) calls of R / ceil(R / F) bytes (each the collective, its host staging,
                         the negotiation), with the coordinator's work on their requests (R / M of the step's);
                         the step waits from the end of its backward pass to the end of the cycle that reduces the
                         last bytes. The cycles' phase against the backward pass is unknown: the mean over four
                         phases (1/8, 3/8, 5/8, 7/8 of a cycle) is charged.
With k = 1 (or one cycle after the backward pass) this is the whole all-reduce (no overlap). A stack without a
framework (one flat all-reduce after the step's gradients, or after gradient accumulation) does not overlap:
`exposed` is `allreduce`. With gradient accumulation the all-reduce of the accumulated gradients comes after the
last micro-batch (NVIDIA DeepLearningExamples TensorFlow/LanguageModeling/BERT/optimization.py: with
allreduce_post_accumulation the accumulated variables are all-reduced in the apply step): callers pass
backward_s = 0 then.

A synchronous parameter-server step (`ps_exposed`) overlaps differently: its pushes run under the backward pass
and, where the workers read the variables from the servers every step, its pulls under the forward pass (the
function's docstring). The simulator's parameter-server rules do not use it; `benchmarks/scale_validation.py` does.

The slowest of P (`slowest`). A synchronous step ends when its slowest worker's gradients are in. If each
worker's compute is independent with mean mu and coefficient of variation c, the expected maximum of P such
times is at most about mu (1 + c sqrt(2 ln P)): sqrt(2 ln P) bounds the expected maximum of P standard normals
(2.35 against the exact 1.77 at P = 16, 3.11 against 2.61 at 128), so this is the pessimistic side for normal
variation, and heavier tails than normal would give more.
`STEP_CV` is an estimate with its range: no published per-step variation of a P100 node on Piz Daint was found.
"""

from __future__ import annotations

import dataclasses
import math

from waitless.cluster import stacks


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A figure with its source; an estimate carries its range [low, high]."""
  value: float
  low: float
  high: float
  source: str


BACKWARD_SHARE = Estimate(
    2.0 / 3.0, 0.5, 0.75,
    'estimate: a layer\'s backward pass computes the gradient with respect to its input and to its weights, each '
    'as many multiply-adds as its forward pass, so the backward pass is 2/3 of a training step\'s FLOPs (Kaplan '
    'et al. 2020, Scaling Laws for Neural Language Models, section 2.1: 2N FLOPs per token forward, 4N backward). '
    'Its share of the time is not its share of the FLOPs (kernels differ in efficiency): range 0.5 (backward as '
    'long as forward) to 0.75 (three times as long)')

STEP_CV = Estimate(
    0.01, 0.0, 0.05,
    'estimate: the coefficient of variation of one GPU\'s step time, independent between workers; no published '
    'per-step figure for a Piz Daint P100 node was found (tf_cnn_benchmarks prints a per-run "jitter", the MAD '
    'of its steps\' images/s, but no log of it was found). Range 0 (no variation) to 5%')


def ps_exposed(exchange_s: float, compute_s: float, backward_share: float, pulls_under_forward: bool) -> float:
  """Seconds of a synchronous parameter-server step's exchange left after its compute of `compute_s`, each
  direction of the busiest node's exchange (pushes, then pulls) taking `exchange_s`.

  TensorFlow runs an op once its inputs are ready, and a tensor crosses devices as a Send/Recv pair (Abadi et al.
  2016, TensorFlow: A system for large-scale machine learning, OSDI, sections 3.2-3.3): a gradient's push starts
  when the gradient is computed, so the pushes run under the rest of the backward pass (the share
  `backward_share` of the compute). With tf_cnn_benchmarks' variable_update=parameter_server a worker reads the
  variables from the servers every step; those Recv ops have no inputs, so they start with the step and run under
  the forward pass. With distributed_replicated a worker copies the variables back only after the servers have
  applied every worker's gradients (its --variable_update help), so the pulls wait for the step. Pushes and pulls
  are then separate phases, each `exchange_s` on the busiest node. The bytes are taken to be needed (pulls) and
  ready (pushes) uniformly over their pass, as `exposed` takes them:
    exposed = max(0, exchange - backward) + (max(0, exchange - forward) if the pulls run under the forward pass
                                              else exchange)
  """
  backward = backward_share * compute_s
  forward = compute_s - backward
  pull = max(0.0, exchange_s - forward) if pulls_under_forward else exchange_s
  return max(0.0, exchange_s - backward) + pull


def slowest(mean_s: float, workers: int, cv: float) -> float:
  """Expected seconds of the slowest of `workers` independent computes of mean `mean_s` and variation `cv`."""
  if workers <= 1 or cv <= 0:
    return mean_s
  return mean_s * (1.0 + cv * math.sqrt(2.0 * math.log(workers)))


def calls(stack: stacks.Stack, nbytes: float) -> int:
  """DDP's buckets (or a framework's one call per fusion buffer) for `nbytes` of gradients."""
  f = stack.framework
  if f is None:
    return 1
  return math.ceil(nbytes / f.fusion_bytes) if f.fusion_bytes > 0 else max(int(f.tensors), 1)


def after_compute(net, nbytes: float, n: int, micro_s: float) -> float:
  """Seconds a synchronous step waits for its all-reduce after its slowest worker's compute, whose last micro-batch
  took `micro_s`: `exposed` with the backward pass of the framework's `backward_share`, or the whole `allreduce`
  where the network is not a stack whose framework overlaps."""
  if not isinstance(net, stacks.Stack) or net.framework is None or net.framework.backward_share <= 0:
    return net.allreduce(nbytes, n)
  return exposed(net, nbytes, n, net.framework.backward_share * micro_s)


PHASES = (0.125, 0.375, 0.625, 0.875)


def _cycles(stack: stacks.Stack, nbytes: float, n: int, backward_s: float, phase: float) -> float:
  """Horovod's cycles over a backward pass of `backward_s` (module docstring), the first starting `phase` cycles
  into it: seconds from the end of the backward pass to the end of the last bytes' all-reduce."""
  f = stack.framework
  negotiation, coordination = stack.negotiation(n), stack.coordination(n)
  t, done = phase * f.cycle_s, 0.0
  while True:
    ready = nbytes * min(t / backward_s, 1.0) - done
    if ready > nbytes * 1e-12:
      k = math.ceil(ready / f.fusion_bytes) if f.fusion_bytes > 0 else 1
      work = k * (stack.collective(ready / k, n) + negotiation) + coordination * ready / nbytes
      done += ready
      if done >= nbytes * (1 - 1e-12):
        return t + work - backward_s
      t = max(t + f.cycle_s, t + work)
    else:
      t += f.cycle_s


def exposed(stack, nbytes: float, n: int, backward_s: float) -> float:
  """Seconds of the all-reduce of `nbytes` among `n` a step waits for after a backward pass of `backward_s`
  (module docstring); the whole `allreduce` where the stack has no framework that overlaps."""
  if not isinstance(stack, stacks.Stack) or stack.framework is None or backward_s <= 0 or n <= 1 or nbytes <= 0:
    return stack.allreduce(nbytes, n)
  f = stack.framework
  if f.cycle_s > 0:
    return sum(_cycles(stack, nbytes, n, backward_s, phase) for phase in PHASES) / len(PHASES)
  k = calls(stack, nbytes)
  per_call = stack.collective(nbytes / k, n) + stack.negotiation(n) + stack.coordination(n) / k
  return max(per_call, k * per_call - (k - 1) * backward_s / k)
