"""Fields every workload shares: `base_config()`, the data every config starts from.

Each workload file's `get_config(arg)` calls `base_config()`, overrides its workload's fields, then
`arguments.apply_arg(config, arg)` (the `ALGORITHM[,key=value...]` config argument, `configs/arguments.py`).
Every config has every field below: the packages that read a section (`cluster/factory.py`: stragglers,
network, cluster; `experiments/harness/ray_runtime/ray_config.py`: ray) read its fields directly.

Duration: a config sets exactly one of `num_steps` (iterations) and `num_epochs` (passes over the training split,
at the global batch `workers` x `batch_size`); the other is None. The run resolves `num_epochs` to iterations
once, when the training split's size is known (`experiments/harness/duration.py`).
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict


def base_config() -> ml_collections.ConfigDict:
  """Defaults shared by all workloads; workload files override what differs."""
  c = ml_collections.ConfigDict()
  c.workers = 8                # P: simulated or real workers (a multiple of `devices`)
  c.devices = 8                # D: devices the workers are spread over (CPU: forced host devices)
  c.batch_size = 16            # per worker, per iteration
  c.microbatches = 1           # m: micro-batches per worker batch (batch_size % m == 0)
  c.num_steps = 300            # iterations of the algorithm; or None with num_epochs set (exactly one)
  c.num_epochs = config_dict.placeholder(float)  # passes over the training split (harness/duration.py)
  c.seed = 0                   # model init, data order and cluster clock
  c.eval_every = 50            # steps between evaluations (and at the end)
  c.log_every = 10             # steps between metrics rows (train_loss = mean over the window)
  c.checkpoint_every = 100     # steps between orbax checkpoints (and at the end)
  c.checkpoint_every_s = 120.0  # also one after a block that ends this many wall seconds after the last (0: off)
  c.steps_per_call = 10        # iterations per jitted call (lax.scan over pre-sampled schedules)
  c.eval_batch_size = 512
  c.target_accuracy = 0.9      # summary.json's time_to_target: first sim_time with eval accuracy >= this
  c.progress_every_s = 5.0     # seconds between progress lines

  c.algorithm = ml_collections.ConfigDict({'name': 'sync'})

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = 'sgd'              # sgd | adamw
  c.optimizer.learning_rate = 0.1
  c.optimizer.momentum = 0.9            # sgd only; 0 disables
  c.optimizer.nesterov = False
  c.optimizer.b1 = 0.9                  # adamw only: first-moment decay
  c.optimizer.b2 = 0.999                # adamw only: second-moment decay (Transformer: 0.98)
  c.optimizer.eps = 1e-8                # adamw only (Transformer: 1e-9)
  c.optimizer.weight_decay = 0.0
  c.optimizer.lr_schedule = 'constant'  # learning-rate schedule: constant | cosine | step | rsqrt (inverse square root)
  c.optimizer.warmup_steps = 0          # linear warmup from 0
  c.optimizer.decay_factor = 0.1        # step learning-rate schedule: multiply at each boundary
  c.optimizer.decay_boundaries = (0.5, 0.75)  # step learning-rate schedule: fractions of num_steps

  c.runtime = 'spmd'           # spmd: one lock-step shard_map program; ray: the parameter-server family on Ray actors
  c.ray = ray_config()         # runtime=ray: what each actor reserves (experiments/harness/ray_runtime/)

  c.stragglers = stragglers_config()  # compute-time model (cluster/factory.py)
  c.network = network_config()        # network model (cluster/factory.py)
  c.cluster = cluster_config()        # a named cluster profile, host time (cluster/profiles.py)
  return c


def stragglers_config() -> ml_collections.ConfigDict:
  """`config.stragglers`: the compute-time model of one micro-batch, in seconds (`cluster/factory.py`)."""
  c = ml_collections.ConfigDict()
  c.kind = 'constant'     # cluster.factory.STRAGGLER_KINDS; 'measured': real time, nothing simulated (measured_time.py)
  c.base_s = 0.01         # constant / lognormal (median) / slow_workers / random_delay: seconds per micro-batch
  c.calibrate = False     # replace the scale of the distribution by a measured step (cluster/calibration.py)
  # Per-call overhead (any kind): every micro-batch, one accelerator call, costs overhead_s on top of the
  # distribution, which is then the per-sample part of one micro-batch (batch_size / microbatches samples).
  # Splitting a batch into m micro-batches pays m overheads; calls merged by a rule (LAP-SGD's Q threads on one
  # accelerator) pay one. Slow-worker factors scale it. 0: time does not depend on how a batch is split.
  c.overhead_s = 0.0
  c.rate = 100.0          # exponential / shifted_exponential: 1/mean of the exponential part (1/s)
  c.shift_s = 0.005       # shifted_exponential: minimum time
  c.shape = 2.0           # pareto: tail index alpha (mean finite for > 1)
  c.scale = 0.005         # pareto: minimum time x_m (mean scale * shape / (shape - 1))
  c.sigma = 0.5           # lognormal: std of log time
  c.trace_path = ''       # trace: .npy or .csv table (units, workers) of seconds, replayed by position
  # Persistent heterogeneity (any kind): the first round(slow_fraction * P) workers, or the listed ones,
  # are slower by slow_factor.
  c.slow_fraction = 0.0
  c.slow_workers = ()     # worker ids; takes the place of slow_fraction (set one of the two)
  c.slow_factor = 2.0
  # Arbitrary persistent heterogeneity (any kind): worker i's compute times multiplied by worker_factors[i], a
  # tuple of P numbers > 0 (e.g. sqrt(i + 1), the Ringmaster paper's kind of fixed heterogeneity; the
  # `stragglers=sqrt` preset of the config argument). () = none; when set it takes the place of slow_fraction /
  # slow_workers / slow_factor (setting it together with slow_fraction or slow_workers is refused).
  c.worker_factors = ()
  # Transient delays (any kind): at each job (iteration) index, `delayed_workers` random workers get +delay_s
  # (WAGMA paper: 2 of 64 workers, 0.32 s).
  c.delayed_workers = 0
  c.delay_s = 0.0
  # How the delayed workers are drawn: 'distinct' (exactly `delayed_workers` of them) or 'independent' (that many
  # uniform draws, which may coincide: the WAGMA authors' code, `np.random.randint(size)` twice per step).
  c.delay_draws = 'distinct'
  # The same delay in calls instead of seconds: delay_calls x the mean time of one micro-batch call of the
  # compute model the clock charges (its distribution plus overhead_s, before slow factors; a cluster profile's
  # when the run names one), so that "three calls late" means the same on every cluster. Set delay_s or
  # delay_calls, not both.
  c.delay_calls = 0.0
  # Failure (any kind): worker `fail_worker` (-1: none; from Python also a tuple of ids) is down from
  # fail_at_s until return_at_s (< 0: never returns). A rule that waits for every worker stops the run when it
  # needs a worker that never returns (one line, the simulated time). Typed defaults (not None) so that
  # `--config.stragglers.fail_worker=3` works.
  c.fail_worker = -1
  c.fail_at_s = 0.0
  c.return_at_s = -1.0
  return c


def network_config() -> ml_collections.ConfigDict:
  """`config.network`: the cost of collectives."""
  c = ml_collections.ConfigDict()
  c.kind = 'ideal'            # ideal | alpha_beta
  c.latency_s = 5e-6          # alpha_beta: alpha, seconds per message
  c.bandwidth_gbps = 10.0     # alpha_beta: beta, gigabits per second
  return c


def cluster_config() -> ml_collections.ConfigDict:
  """`config.cluster`: the named cluster the clock is tied to, and the host's time per iteration."""
  c = ml_collections.ConfigDict()
  # '': no profile, the configured stragglers.* and network.* (the ideal network by default: tests, closed
  # forms); a shipped name (cluster.profiles.names()) or the path of a profile JSON (experiments.calibrate).
  c.profile = ''
  c.host_s = 0.0     # seconds of serial host work per iteration, added to every iteration by the clock
  # True: a slow worker (stragglers' worker_factors, slow_factor) is a slower host CPU, so its host work per
  # iteration is host_s x its factor too (the shaped test bed's CPU quotas); False: only its compute is slower
  # (a slower accelerator on an equal host).
  c.slow_hosts = False
  # The fields the user set (flags, the config argument's pairs) that win over the profile's values
  # (cluster.profiles.PROFILE_FIELDS); the programs fill it (configs/arguments.py:mark_explicit), a config file
  # may too.
  c.explicit = ()
  return c


def ray_config() -> ml_collections.ConfigDict:
  """`config.ray`: what each actor of a `runtime=ray` run asks of the Ray cluster."""
  c = ml_collections.ConfigDict()
  c.worker_cpus = config_dict.placeholder(float)  # CPUs each learner process reserves; unset: the CPUs shared (<= 1)
  # Learners each learner process hosts; unset: planned from the CPUs and memory (ray_runtime/plan.py)
  c.learners_per_process = config_dict.placeholder(int)
  c.worker_gpus = 0.0     # GPUs each learner actor reserves (1: one GPU per learner, Ray sets CUDA_VISIBLE_DEVICES)
  c.server_cpus = 0.0     # CPUs the server actor reserves (0: it runs beside the learners)
  c.max_restarts = 3      # times Ray restarts a learner actor that died before the run gives it up
  return c


def use_epochs(config: ml_collections.ConfigDict, epochs: float) -> ml_collections.ConfigDict:
  """Sets the duration in epochs (`num_steps` None, still overridable by `--config.num_steps`)."""
  config.num_epochs = float(epochs)
  config.num_steps = config_dict.placeholder(int)
  return config


def tfds_dataset(name: str, eval_split: str) -> ml_collections.ConfigDict:
  """`config.dataset` fields every tensorflow-datasets workload has; workload files add their own."""
  d = ml_collections.ConfigDict()
  d.name = name
  d.data_dir = None          # None: tfds default ($TFDS_DATA_DIR or ~/tensorflow_datasets)
  d.train_split = 'train'
  d.eval_split = eval_split
  return d
