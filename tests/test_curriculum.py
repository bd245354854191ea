"""Loss schedules: the depth curriculum, interpolated lambda, leap target offsets."""
import json
import math
import os

import jax
import numpy as np
import pytest
from flax import nnx

import numpy_reference as ref
from helpers import (
  POS,
  SEG,
  load_config,
  loss_batch,
  randomize,
  synthetic_batches,
  tiny_model_config,
)
from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import config_lib
from mtp_jax.config_lib import ConfigError
from mtp_jax.data import tokenizers
from mtp_jax.model import ModelArgs, MTPModel
from mtp_jax.train import loss as loss_lib
from mtp_jax.train import steps as steps_lib
from mtp_jax.train import train_and_evaluate


def paper_heads(kind, step, steps, k_max, phase=None):
  """Aynetdinov & Akbik's k(e), with e the step and E the run's steps, in floats."""
  p = steps / k_max if phase is None else phase
  if kind == 'forward':
    return min(k_max, math.floor(step / p) + 1)
  return max(1, k_max - math.floor(step / p))


@pytest.mark.parametrize('kind', ['forward', 'reverse'])
@pytest.mark.parametrize('steps,phase', [(120, 0), (100, 0), (90, 20)])
def test_curriculum_weights_follow_the_formula_at_phase_boundaries(kind, steps, phase):
  c = tiny_model_config(3)
  c.train.steps = steps
  c.model.mtp.curriculum = kind
  c.model.mtp.curriculum_phase_steps = phase
  c.model.mtp.lambda_values = (0.3,)
  p = phase or steps / 4
  probe = sorted({s for b in range(5) for s in (math.ceil(b * p) - 1, math.ceil(b * p))
                  if 0 <= s < steps} | {steps - 1})
  args = steps_lib.loss_args(c)
  fn = jax.jit(lambda s: (loss_lib.active_depths(args, s), loss_lib.depth_weights(args, s)))
  for s in probe:
    want = paper_heads(kind, s, steps, 4, phase or None) - 1
    active, w = fn(s)
    assert int(active) == want, (s, int(active), want)
    np.testing.assert_allclose(np.asarray(w), [1.0] + [0.1 if k <= want else 0.0
                                                      for k in (1, 2, 3)], rtol=1e-6)
  # the first and last phases: next-token only / every depth (forward), the reverse for reverse
  first, last = int(fn(0)[0]), int(fn(steps - 1)[0])
  assert (first, last) == ((0, 3) if kind == 'forward' else (3, 0))


def test_lambda_interpolation():
  c = tiny_model_config(2)
  c.model.mtp.lambda_values, c.model.mtp.lambda_boundaries = (0.3, 0.1), (100, 300)
  for kind, mid in (('linear', 0.2), ('cosine', 0.2)):
    c.model.mtp.lambda_schedule = kind
    config_lib.validate(c)
    args = steps_lib.loss_args(c)
    lam = jax.jit(lambda s: loss_lib.lambda_at(args, s))
    for s, want in ((0, 0.3), (100, 0.3), (200, mid), (300, 0.1), (1000, 0.1)):
      np.testing.assert_allclose(float(lam(s)), want, rtol=1e-6)
    quarter = 0.3 - 0.2 * (0.25 if kind == 'linear' else (1 - math.cos(math.pi / 4)) / 2)
    np.testing.assert_allclose(float(lam(150)), quarter, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(loss_lib.depth_weights(args, 200)), [1, mid / 2, mid / 2],
                               rtol=1e-6)
  c.model.mtp.lambda_schedule = 'step'  # the step form is unchanged
  c.model.mtp.lambda_values, c.model.mtp.lambda_boundaries = (0.3, 0.1), (100,)
  args = steps_lib.loss_args(c)
  assert [round(float(loss_lib.lambda_at(args, s)), 6) for s in (99, 100)] == [0.3, 0.1]


@pytest.mark.parametrize('change,match', [
    (dict(curriculum='sideways'), 'model.mtp.curriculum must be'),
    (dict(curriculum_phase_steps=-1), 'curriculum_phase_steps must be'),
    (dict(lambda_schedule='cosine', lambda_values=(0.3, 0.1), lambda_boundaries=(10,)),
     'as many model.mtp.lambda_values'),
    (dict(lambda_schedule='exp'), 'lambda_schedule must be'),
    (dict(target_offsets=(2,)), 'target_offsets has 1 entries'),
    (dict(target_offsets=(3, 3)), 'increasing integers >= 2'),
    (dict(target_offsets=(1, 2)), 'increasing integers >= 2'),
    (dict(target_offsets=(2, 40)), 'below data.seq_len'),
])
def test_bad_schedule_fields(change, match):
  c = tiny_model_config(2)
  for k, v in change.items():
    c.model.mtp[k] = v
  with pytest.raises(ConfigError, match=match):
    config_lib.validate(c)


@pytest.mark.parametrize('kind', ['sequential', 'parallel'])
def test_leap_offset_targets_match_numpy(kind):
  """Offsets (2, 4): depth 2 predicts t_(i+4) and (sequential) reads t_(i+3); the loss, its
  valid positions and the counts against tests/numpy_reference.py."""
  config = tiny_model_config(2, kind)
  config.model.mtp.target_offsets = (2, 4)
  config.model.mtp.weights = (0.2, 0.05)
  config_lib.validate(config)
  model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(config)), rngs=nnx.Rngs(0))
  params = randomize(model, seed=3)
  b = loss_batch(seed=1)
  weights = loss_lib.depth_weights(steps_lib.loss_args(config), 0)
  loss, sums = nnx.jit(lambda m, b: loss_lib.loss_and_metrics(m, b, weights))(model, b)
  want, want_sums, want_counts = ref.loss(params, np.asarray(b['tokens']), POS, SEG, 2,
                                          [0.2, 0.05], kind, offsets=[2, 4])
  # a document of n tokens has max(n - o, 0) valid positions at offset o: 5/6/3 + 16 tokens
  assert list(want_counts) == [26, 22, 1 + 2 + 0 + 12]
  assert list(np.asarray(sums['count'])) == list(want_counts)
  np.testing.assert_allclose(np.asarray(sums['loss_sum']), want_sums, rtol=1e-4)
  np.testing.assert_allclose(float(loss), want, rtol=1e-4)
  tgt = np.asarray(loss_lib.targets(b['tokens'], 2, model.args.target_offsets()))
  np.testing.assert_array_equal(tgt[1, :12], np.asarray(b['tokens'])[1, 4:])


def _params(state):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(state[0]))


def _changed(a, b, depth):
  la, lb = jax.tree.leaves(a['mtp'][depth - 1]), jax.tree.leaves(b['mtp'][depth - 1])
  return any(not np.array_equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize('kind', ['forward', 'reverse'])
def test_curriculum_compiles_once_and_inactive_depths_stay(devices, kind):
  """6 steps, M = 2, P = 2: one compiled train step across every phase; a(s) per step is
  the formula's; an inactive depth's parameters do not move (no gradient, and no momentum
  or weight decay); an active one's do."""
  c = tiny_model_config(2)
  c.model.vocab_size = 0
  c.train.steps, c.train.warmup_steps = 6, 0
  c.model.mtp.curriculum = kind
  c.mesh.shape = (1, 1, 1)
  ts, state = steps_lib.setup(c, devices[:1])
  before = _params(state)
  history, active = [before], []
  for batch in synthetic_batches(6, c.data.batch_size, c.data.seq_len, seed=4):
    state, m = steps_lib.run_step(ts, state, batch)
    active.append(int(m['active_depths']))
    history.append(_params(state))
  assert ts.train_step._cache_size() == 1  # one trace, one compile for the whole run
  assert active == ([0, 0, 1, 1, 2, 2] if kind == 'forward' else [2, 2, 1, 1, 0, 0])
  for s, a in enumerate(active):  # step s takes history[s] to history[s + 1]
    for depth in (1, 2):
      assert _changed(history[s], history[s + 1], depth) == (depth <= a), (s, depth)


def _losses(workdir):
  rows = [json.loads(line) for line in open(os.path.join(workdir, 'metrics.jsonl'))]
  return ({r['step']: r['train/loss'] for r in rows if 'train/loss' in r},
          {r['step']: r['train/active_depths'] for r in rows if 'train/active_depths' in r})


def test_resumed_curriculum_equals_uninterrupted(devices, stdlib_data_dir, tmp_path):
  """A forward curriculum over 6 steps (M = 2, P = 2), stopped at step 3 (mid-phase) and
  resumed == run straight: same losses, same active depths, same final parameters."""
  def config():
    c = load_config('tiny')
    c.data.data_dir = stdlib_data_dir
    c.model.mtp.depth, c.model.mtp.curriculum = 2, 'forward'
    c.train.progress = False
    for k, v in dict(steps=6, log_every=1, eval_every=0, checkpoint_every=0,
                     eval_batches=1).items():
      c.train[k] = v
    return c
  full, split = str(tmp_path / 'full'), str(tmp_path / 'split')
  train_and_evaluate(config(), full, devices=devices[:1])
  train_and_evaluate(config(), split, devices=devices[:1], stop_after=3)
  train_and_evaluate(config(), split, devices=devices[:1])
  (la, aa), (lb, ab) = _losses(full), _losses(split)
  assert la == lb and sorted(la) == [1, 2, 3, 4, 5, 6]
  # the logged step is the one just taken: steps 1..6 ran at s = 0..5
  assert aa == ab == {1: 0, 2: 0, 3: 1, 4: 1, 5: 2, 6: 2}
  rows = [json.loads(line) for line in open(os.path.join(full, 'metrics.jsonl'))]
  evals = [r for r in rows if 'eval/loss_main' in r]
  assert evals and all(f'eval/loss_mtp_{k}' in evals[-1] for k in (1, 2))  # every depth
  finals = []
  for w in (full, split):
    ts, _ = steps_lib.setup(config(), devices[:1])
    ckpt = ckpt_lib.Checkpointer(os.path.join(w, 'checkpoints'))
    restored, meta = ckpt.restore(ckpt.latest_step(), ts.abstract_state)
    ckpt.close()
    finals.append(_params(restored))
  for x, y in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1])):
    np.testing.assert_array_equal(x, y)


def test_leap_offsets_do_not_export_as_mtp_layers():
  from mtp_jax.interop import layouts
  from mtp_jax.interop.safetensors_io import InteropError
  c = tiny_model_config(2)
  c.model.mtp.target_offsets = (2, 4)
  args = ModelArgs.from_config(c)
  assert args.target_offsets() == (1, 2, 4) and args.drafting_depths() == 1
  with pytest.raises(InteropError, match='leap targets model.mtp.target_offsets'):
    layouts.check_layout(args, 'mimo')
  layouts.check_layout(args, 'llama')  # the trunk alone exports


@pytest.mark.parametrize('curriculum', ['none', 'forward'])
def test_train_step_keeps_the_routing_bias_update(devices, curriculum):
  """The aux-loss-free routing bias is updated by the train step (outside the gradient);
  under a forward curriculum an inactive MoE MTP depth's bias is held with its parameters."""
  from helpers import dsv3_model_config
  c = dsv3_model_config(1, attention='gqa')
  c.model.vocab_size = 0
  c.model.moe.bias_update_rate = 0.1
  c.train.steps, c.train.warmup_steps = 4, 0
  c.model.mtp.curriculum = curriculum
  c.mesh.shape = (1, 1, 1)
  ts, state = steps_lib.setup(c, devices[:1])
  bias = lambda st: jax.tree.map(  # noqa: E731
      np.asarray, nnx.to_pure_dict(nnx.state(nnx.merge(ts.graphdef, st)[0], nnx.Variable)))
  before = _bias_leaves(bias(state))
  state, m = steps_lib.run_step(ts, state, synthetic_batches(1, 8, 16, seed=2)[0])
  after = _bias_leaves(bias(state))
  assert not np.array_equal(before['trunk'], after['trunk'])  # layer 1's routing bias moved
  assert np.array_equal(before['mtp'], after['mtp']) == (curriculum == 'forward')


def _bias_leaves(tree):
  out = {'trunk': [], 'mtp': []}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = [getattr(p, 'key', getattr(p, 'idx', None)) for p in path]
    if 'e_score_correction_bias' in keys:
      out['mtp' if 'mtp' in keys else 'trunk'].append(leaf)
  return {k: np.concatenate(v) for k, v in out.items()}
