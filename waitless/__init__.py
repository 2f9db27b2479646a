"""waitless: distributed SGD that does not wait for stragglers, in JAX/Flax.

Subpackages, lowest layer first (the imports run one way; `.importlinter` checks it):

  algorithms   the math: one optax transformation per SGD variant, its state, the schedule it reads, collectives
  cluster      simulated time: the clock, one time rule per algorithm, compute, network and fault models
  data         input pipelines (tensorflow-datasets and the embedded workloads)
  models       Flax modules
  experiments  the programs (main, compare, simulate), their configs, the harness and the comparison
"""
