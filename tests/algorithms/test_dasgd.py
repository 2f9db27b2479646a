"""DaSGD: sequential float64 reference, d = 0 is local SGD, round path = per-iteration path, time rule."""

import re

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import optax

from waitless import config_errors as errors
from waitless.algorithms import dasgd
from waitless.cluster.rules import dasgd as dasgd_rule
from waitless.algorithms import delayed_averaging
from waitless.experiments.harness import block_step as block_step_lib
from waitless.experiments.harness import inputs as inputs_lib
from waitless.experiments.harness import setup
from tests import harness
from tests import hlo
from tests.algorithms import reference
from tests.cluster import helpers

X = 0.01  # seconds per step in the time-rule tests
P = 8


def _f64(arg, **overrides):
  return harness.synthetic_config(arg, **{'model.param_dtype': 'float64', 'model.dtype': 'float64', **overrides})


def _assert_trees_close(a, b, rtol=1e-12, atol=1e-14):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


class DaSGDTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('d1', 3, 1, 'local_progress', 0.9, 4),
      ('d2_mix', 3, 2, 'mix', 0.0, 4),
      ('d_equals_tau', 2, 2, 'local_progress', 0.9, 4),
      ('d0_mix', 3, 0, 'mix', 0.9, 4),
      ('d1_mix_two_workers_per_device', 3, 1, 'mix', 0.9, 2),
      ('d2_two_workers_per_device', 4, 2, 'local_progress', 0.0, 2))
  def test_matches_sequential_reference(self, tau, delay, correction, momentum, devices):
    iterations, p_mix = 13, 0.3
    arg = f'dasgd,local_steps={tau},delay={delay},correction={correction},mix={p_mix}'
    with jax.enable_x64(True):
      config = _f64(arg, **{'optimizer.momentum': momentum, 'devices': devices})
      traj = harness.run_iterations(config, iterations)
    p = config.workers
    models = [list(reference.unpack(traj.initial_params, i)) for i in range(p)]
    snaps = [None] * p
    opts = [reference.MomentumSGD(config.optimizer.learning_rate, momentum) for _ in range(p)]

    def correct(i, mean):
      if correction == 'local_progress':
        return [mean[k] + (models[i][k] - snaps[i][k]) for k in range(2)]
      return [p_mix * models[i][k] + (1 - p_mix) * mean[k] for k in range(2)]

    for t in range(iterations):
      sched = traj.schedules[t]
      # The events the spec fixes: snapshot after every tau-th step, applied d steps later.
      self.assertEqual(bool(sched.snapshot), (t + 1) % tau == 0)
      self.assertEqual(bool(sched.apply_average), t + 1 - delay >= tau and (t + 1 - delay) % tau == 0)
      for i in range(p):
        batch = harness.worker_batch(traj.run, i, int(traj.positions[t][i]), 1)
        gw, gb = reference.gradient(models[i][0], models[i][1], batch['image'][0], batch['label'][0])
        models[i] = opts[i].step(models[i], [gw, np.float64(gb)])
      if sched.apply_average and sched.average_age > 0:
        mean = [np.mean([s[k] for s in snaps], axis=0) for k in range(2)]
        models = [correct(i, mean) for i in range(p)]
      if sched.snapshot:
        snaps = [list(m) for m in models]
      if sched.apply_average and sched.average_age == 0:
        mean = [np.mean([s[k] for s in snaps], axis=0) for k in range(2)]
        models = [correct(i, mean) for i in range(p)]
      for i in range(p):
        got_w, got_b = reference.unpack(traj.params[t], i)
        np.testing.assert_allclose(got_w, models[i][0], rtol=1e-10, atol=1e-12, err_msg=f'step {t} worker {i}')
        np.testing.assert_allclose(got_b, models[i][1], rtol=1e-10, atol=1e-12)
    # The models drifted apart and were pulled together: the test would fail on a no-op average.
    spread = np.abs(traj.params[-1]['Dense_0']['kernel'][0] - traj.params[-1]['Dense_0']['kernel'][1]).max()
    self.assertGreater(spread, 1e-8)

  @parameterized.named_parameters(('per_iteration', 1), ('whole_rounds', 6))
  def test_delay_zero_with_local_progress_is_local_sgd(self, block):
    with jax.enable_x64(True):
      kwargs = {'optimizer.momentum': 0.9, 'devices': 2}
      ours = harness.run_iterations(_f64('dasgd,local_steps=3,delay=0', **kwargs), 12, block=block)
      local = harness.run_iterations(_f64('local_sgd,local_steps=3', **kwargs), 12, block=block)
    for a, b in zip(ours.params, local.params):
      jax.tree.map(np.testing.assert_array_equal, a, b)  # the same operations: bit for bit

  @parameterized.named_parameters(
      ('one_worker_per_device_d1', 4, 1, 'local_progress'),
      ('one_worker_per_device_d3_mix', 4, 3, 'mix'),
      ('two_workers_per_device_d2', 2, 2, 'local_progress'),
      ('two_workers_per_device_d1_mix', 2, 1, 'mix'),
      ('two_workers_per_device_d0_mix', 2, 0, 'mix'))
  def test_whole_round_blocks_equal_the_per_iteration_path(self, devices, delay, correction):
    # tau = 3. block=6: whole rounds (all-reduce issued at position 0, applied at d - 1); block=4: blocks
    # that start or end inside a round take the per-iteration path, mixing both; block=1: per iteration.
    with jax.enable_x64(True):
      config = _f64(f'dasgd,local_steps=3,delay={delay},correction={correction}',
                    **{'optimizer.momentum': 0.9, 'devices': devices})
      runs = {block: harness.run_iterations(config, 12, block=block) for block in (1, 4, 6)}
    self.assertEqual(runs[6].run.round_length, 3)
    self.assertEqual(runs[6].block_step.rounds._cache_size(), 1)
    for block in (4, 6):
      _assert_trees_close(runs[block].params[-1], runs[1].params[-1])
      _assert_trees_close(runs[block].final_state.opt_state.buffer, runs[1].final_state.opt_state.buffer)

  def test_library_loop_without_schedule_matches_the_rule(self):
    # With no schedule the events come from the step; they are what the time rule produces.
    for tau, delay in ((4, 0), (4, 1), (4, 4), (3, 2), (1, 1)):
      block = helpers.clock(dasgd_rule.DelayedAverage(tau, delay), workers=2, base_s=X).next_block(13)
      events = [delayed_averaging.schedule_at(t, tau, delay) for t in range(13)]
      for name in ('snapshot', 'apply_average', 'average_age'):
        np.testing.assert_array_equal([np.asarray(getattr(e, name)) for e in events],
                                      getattr(block.schedule, name), err_msg=f'{name} tau={tau} d={delay}')

  def test_one_worker_local_progress_is_the_inner_optimizer(self):
    params = {'w': jnp.array([1.0, -2.0, 0.5])}
    tx, inner = dasgd.dasgd(optax.sgd(0.1, momentum=0.9), local_steps=2, delay=1), optax.sgd(0.1, momentum=0.9)
    state, inner_state, ours, plain = tx.init(params), inner.init(params), params, params
    for k in range(7):
      grads = {'w': jnp.array([0.3, 0.1, -0.2]) * (k + 1)}
      updates, state = tx.update(grads, state, ours)
      ours = optax.apply_updates(ours, updates)
      updates, inner_state = inner.update(grads, inner_state, plain)
      plain = optax.apply_updates(plain, updates)
    np.testing.assert_allclose(ours['w'], plain['w'], rtol=1e-6)

  def test_one_worker_mix_pulls_towards_the_snapshot(self):
    params = {'w': jnp.zeros(2)}
    tx = dasgd.dasgd(optax.sgd(1.0), local_steps=1, delay=1, correction='mix', mix=0.25)
    state = tx.init(params)
    grads = {'w': jnp.array([-1.0, 2.0])}
    updates, state = tx.update(grads, state, params)  # step 0: W = -g, snapshot s = -g, nothing applied yet
    params = optax.apply_updates(params, updates)
    updates, state = tx.update(grads, state, params)  # step 1: W = -2g, then 0.25 W + 0.75 s = -1.25 g
    params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(params['w'], [1.25, -2.5])

  @parameterized.named_parameters(('d1', 1), ('d2', 2), ('d_equals_tau', 4))
  def test_mix_matches_a_literal_port_of_the_authors_loop(self, delay):
    # A line-by-line port of the authors' loop: github.com/sweetwenwen/fastai-dasgd, train.py,
    # `fit_asynchronous_average_models_one_cycle`, commit 1b1cbddf5535cec188116c7d216f216a7ec6351b. Each
    # dataloader batch is one round of `tao` local steps; after worker i's local step number `delay - 1` of a
    # round, from the second round on (`model_average_tag`), its weights become
    # update_proportion * own + (1 - update_proportion) * new_dict, where new_dict is the mean of the models
    # at the end of the previous round. Their defaults: tao = 4, delay = 1, update_proportion = 8/32.
    p, tao, rounds, lr, update_proportion = 4, 4, 5, 0.1, 8.0 / 32.0
    rng = np.random.default_rng(3)
    centres = rng.normal(size=(rounds * tao, p, 3))  # worker i's quadratic at step t: 0.5 |w - c[t, i]|^2 x scale_i
    scale = np.array([0.5, 1.0, 1.5, 2.0])

    def grad(w, t, i):
      return scale[i] * (w - centres[t, i])

    models, new_dict, model_average_tag = [np.zeros(3) for _ in range(p)], None, False
    for r in range(rounds):
      for local_step in range(tao):
        for i in range(p):
          models[i] = models[i] - lr * grad(models[i], r * tao + local_step, i)
          if local_step == delay - 1 and model_average_tag:
            models[i] = update_proportion * models[i] + (1 - update_proportion) * new_dict
      model_average_tag = True
      new_dict = sum(models) / p

    tx = dasgd.dasgd(optax.sgd(lr), local_steps=tao, delay=delay, correction='mix', mix=update_proportion,
                     axis_name='workers')

    def step(w, state, c, s):
      updates, state = tx.update(s * (w - c), state, w)
      return optax.apply_updates(w, updates), state

    with jax.enable_x64(True):
      w = jnp.zeros((p, 3), jnp.float64)
      state = jax.vmap(tx.init)(w)
      step = jax.jit(jax.vmap(step, axis_name='workers'))
      for t in range(rounds * tao):
        w, state = step(w, state, jnp.asarray(centres[t]), jnp.asarray(scale))
    np.testing.assert_allclose(np.asarray(w), np.stack(models), rtol=1e-13, atol=1e-14)
    self.assertGreater(np.abs(np.stack(models) - new_dict).max(), 1e-3)  # the workers drifted: not a plain mean

  @parameterized.named_parameters(
      ('delay_above_tau', {'local_steps': 2, 'delay': 3}, 'algorithm.delay'),
      ('negative_delay', {'delay': -1}, 'algorithm.delay'),
      ('zero_local_steps', {'local_steps': 0, 'delay': 0}, 'algorithm.local_steps'),
      ('bad_correction', {'correction': 'average'}, 'algorithm.correction'),
      ('mix_above_one', {'mix': 1.5}, 'algorithm.mix'),
      ('negative_mix', {'mix': -0.1}, 'algorithm.mix'))
  def test_bad_values_name_the_field(self, overrides, field):
    config = harness.synthetic_config('dasgd', **{f'algorithm.{k}': v for k, v in overrides.items()})
    with self.assertRaises(errors.ConfigError) as raised:
      dasgd.validate(config)
    self.assertEqual(raised.exception.field, field)
    self.assertNotIn('\n', str(raised.exception))

  def test_defaults_are_valid(self):
    dasgd.validate(harness.synthetic_config('dasgd'))
    self.assertEqual(dasgd.round_length(harness.synthetic_config('dasgd,local_steps=5')), 5)


_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(([^)]*)\)')
_LOCAL_STEP_OPS = ('dot', 'convolution')  # unfused on CPU: the count below fails if that changes


def _compiled_text(arg: str, workers: int, devices: int, n: int) -> str:
  """Optimized HLO of the harness's block step for a block of n iterations from step 0."""
  config = harness.synthetic_config(arg, workers=workers, devices=devices, steps_per_call=n)
  run = setup.build(config)
  state = setup.init_state(run)
  _, nbytes = setup.param_count_and_bytes(state.params)
  block = setup.clock_for(run, nbytes).next_block(n)
  inputs, _ = inputs_lib.block_inputs(run, block, np.zeros(workers, np.int64), 0)
  return block_step_lib.BlockStep(run, rounds=True).lower(state, *inputs).compile().as_text()


def _instructions(text: str, computation: str) -> list[tuple[str, str, list[str]]]:
  """(name, opcode, operand names) of one computation's instructions, in the compiled (scheduled) order."""
  out, inside = [], False
  for line in text.splitlines():
    header = hlo._COMPUTATION.match(line)
    if header:
      inside = header.group(1) == computation
      continue
    match = _INSTRUCTION.match(line) if inside else None
    if match:
      out.append((match.group(1), match.group(2), re.findall(r'%([\w.\-]+)', match.group(3))))
  return out


class RoundProgramTest(parameterized.TestCase):
  """The whole-round program: one unconditional all-reduce per round, independent of the round's local steps."""

  @parameterized.named_parameters(('one_worker_per_device', 4), ('two_workers_per_device', 2))
  def test_allreduce_is_issued_before_the_local_steps_it_overlaps(self, devices):
    text = _compiled_text('dasgd,local_steps=4,delay=2', workers=4, devices=devices, n=8)  # two rounds
    program = hlo.parse(text)
    self.assertEqual(program.conditionals, 0)
    reduces = [(name, ops) for name, ops in program.ops.items()
               for op in ops if op.removesuffix('-start') == 'all-reduce']
    self.assertLen(reduces, 1)  # once in the scanned round body
    body = reduces[0][0]
    instructions = _instructions(text, body)
    by_name = {name: (op, operands) for name, op, operands in instructions}

    start = next(name for name, op, _ in instructions if op.removesuffix('-start') == 'all-reduce')
    # Its operands come from the carried state only: no gradient of this round feeds it.
    seen, todo = set(), list(by_name[start][1])
    while todo:
      name = todo.pop()
      if name in by_name and name not in seen:
        seen.add(name)
        todo.extend(by_name[name][1])
    self.assertFalse([n for n in seen if by_name[n][0] in _LOCAL_STEP_OPS], 'the all-reduce waits for a step')
    # Scheduled before the round's first local step: its result is consumed d steps later.
    order = [name for name, _, _ in instructions]
    dots = [name for name, op, _ in instructions if op in _LOCAL_STEP_OPS]
    self.assertGreaterEqual(len(dots), 4 * 2)  # forward and backward of each of the 4 unrolled steps
    self.assertLess(order.index(start), order.index(dots[0]))

  def test_whole_round_blocks_compile_once(self):
    config = harness.synthetic_config('dasgd,local_steps=3,delay=1', steps_per_call=6)
    block_step = harness.run_iterations(config, 24, block=6, rounds=True).block_step
    self.assertEqual(block_step.rounds._cache_size(), 1)
    self.assertEqual(block_step.per_iteration._cache_size(), 0)


class HiddenCommunicationTest(parameterized.TestCase):
  """The simulator hides min(1, d x step / allreduce) of each average's all-reduce (no stragglers)."""

  @parameterized.named_parameters(
      ('fully_hidden', 4, 2, 1.5),
      ('exactly_d_steps', 4, 2, 2.0),
      ('partly_hidden', 4, 1, 1.5),
      ('mostly_exposed', 4, 1, 4.0),
      ('d_equals_tau', 4, 4, 6.0),
      ('blocking', 4, 0, 1.5))
  def test_hidden_fraction_matches_closed_form(self, tau, delay, allreduce_steps):
    network = {'kind': 'alpha_beta', 'latency_s': 0.0, 'bandwidth_gbps': 1.0}
    model_bytes = allreduce_steps * X / (2 * (P - 1) / P * 8e-9)
    clock = helpers.clock(dasgd_rule.DelayedAverage(tau, delay), workers=P, base_s=X, network=network,
                          model_bytes=model_bytes)
    allreduce = clock.network.allreduce(model_bytes, P)
    self.assertAlmostEqual(allreduce, allreduce_steps * X)
    block = clock.next_block(10 * tau)
    averages = int(block.schedule.apply_average.sum())
    self.assertGreater(averages, 0)
    # Communication on the critical path: the wait at the apply steps (d = 0: the blocking all-reduce itself).
    exposed = block.sim_time[-1] - 10 * tau * X
    hidden = 1.0 - exposed / (averages * allreduce)
    expected = min(1.0, delay * X / allreduce)
    self.assertAlmostEqual(hidden, expected, places=9)
    if delay:
      np.testing.assert_allclose(block.idle.sum(axis=1).sum() / P, exposed, rtol=1e-9, atol=1e-12)


if __name__ == '__main__':
  absltest.main()
