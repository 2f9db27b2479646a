"""What a synchronous step pays beyond its compute and one all-reduce: the all-reduce's overlap with the backward
pass, and the wait for the slowest of P workers.

These are properties of a step, not of a collective, so they take a collective model (`network.Network`, a
`stacks.Stack`) and the step's compute. `benchmarks/scale_validation.py` charges them; the simulator's sync time
rule does not yet (it charges compute, then `allreduce`, and samples its own per-worker compute, so it needs no
closed form for the slowest worker).

Overlap (`exposed`). A framework that all-reduces each gradient as the backward pass produces it (Horovod's
background thread: a tensor is submitted when its gradient op has run and fused with the others ready in the same
cycle, horovod/horovod docs/concepts and docs/tensor-fusion.rst; PyTorch DDP's buckets, launched when a bucket's
gradients are all ready, torch/nn/parallel/distributed.py) runs the all-reduce under the rest of the backward pass.
Of a micro-batch's compute t, the backward pass is the share `BACKWARD_SHARE` (Bk = share x t). The M gradient
bytes are taken to become ready uniformly over Bk (an assumption: a CNN's late layers, ready first, hold most of
its parameters and few of its FLOPs, so for CNNs this is the pessimistic side; a Transformer's layers are alike).
The all-reduce goes in k calls, one after another on one background thread or stream:
  Horovod (cycle_s > 0)  k = max(ceil(M / F), ceil(Bk / cycle_s)): each cycle fuses what became ready in it
  DDP (cycle_s = 0)      k = ceil(M / F): one call per bucket
Call j (1..k) is ready at j Bk / k and costs s = the per-call cost of M / k bytes as `allreduce` charges it
without the cycle's wait (the collective, its host staging, the negotiation, a k-th of the coordinator's work
on the requests where the framework charges it); calls run in order, so the last
finishes at max_j (j Bk / k + (k - j + 1) s), and the step waits, after its backward pass,
  exposed = max(s, k s - (k - 1) Bk / k)  [+ cycle_s / 2: the last tensor waits for the next cycle]
With k = 1 this is the whole all-reduce (no overlap). Where the thread is saturated (k s > Bk) Horovod would merge
the waiting tensors into fewer, larger calls, paying fewer latencies than charged here. A stack without a
framework (one flat all-reduce after the step's gradients, or after gradient accumulation) does not overlap:
`exposed` is `allreduce`. With gradient accumulation the all-reduce of the accumulated gradients comes after the
last micro-batch (NVIDIA DeepLearningExamples TensorFlow/LanguageModeling/BERT/optimization.py: with
allreduce_post_accumulation the accumulated variables are all-reduced in the apply step): callers pass
backward_s = 0 then.

The slowest of P (`slowest`). A synchronous step ends when its slowest worker's gradients are in. If each
worker's compute is independent with mean mu and coefficient of variation c, the expected maximum of P such
times is about mu (1 + c sqrt(2 ln P)) (the expected maximum of P standard normals is below sqrt(2 ln P);
Gumbel, Statistics of Extremes, 1958; the bound is tight to within a few percent of mu c for P >= 16).
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


def slowest(mean_s: float, workers: int, cv: float) -> float:
  """Expected seconds of the slowest of `workers` independent computes of mean `mean_s` and variation `cv`."""
  if workers <= 1 or cv <= 0:
    return mean_s
  return mean_s * (1.0 + cv * math.sqrt(2.0 * math.log(workers)))


def calls(stack: stacks.Stack, nbytes: float, backward_s: float) -> int:
  """How many all-reduce calls the framework makes for `nbytes` of gradients ready over `backward_s` seconds."""
  f = stack.framework
  if f is None or f.fusion_bytes <= 0:
    return 1 if f is None else max(int(f.tensors), 1)
  k = math.ceil(nbytes / f.fusion_bytes)
  if f.cycle_s > 0 and backward_s > 0:
    k = max(k, math.ceil(backward_s / f.cycle_s))
  return k


def exposed(stack, nbytes: float, n: int, backward_s: float) -> float:
  """Seconds of the all-reduce of `nbytes` among `n` a step waits for after a backward pass of `backward_s`
  (module docstring); the whole `allreduce` where the stack has no framework that overlaps."""
  if not isinstance(stack, stacks.Stack) or stack.framework is None or backward_s <= 0 or n <= 1 or nbytes <= 0:
    return stack.allreduce(nbytes, n)
  f = stack.framework
  k = calls(stack, nbytes, backward_s)
  # The coordinator's handling of the requests (`stacks.Framework.request_s`) runs on the same thread, between calls.
  per_call = stack.collective(nbytes / k, n) + stack.negotiation(n) + stack.coordination(n) / k
  tail = f.cycle_s / 2 if f.cycle_s > 0 else 0.0
  return max(per_call, k * per_call - (k - 1) * backward_s / k) + tail
