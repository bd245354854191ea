"""MTP on a frozen trunk: freeze_trunk, stop_gradient, self-distillation targets."""
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import load_config, tiny_model_config
from mtp_jax import config_lib
from mtp_jax.config_lib import ConfigError
from mtp_jax.data import tokenizers
from mtp_jax.model import ModelArgs, MTPModel
from mtp_jax.train import flops, train_and_evaluate
from mtp_jax.train import loss as loss_lib

TRAIN = dict(log_every=2, eval_every=0, eval_batches=1, progress=False)


def tiny(data_dir, depth, steps, **mtp):
  c = load_config('tiny')
  c.data.data_dir = data_dir
  c.model.mtp.depth = depth
  c.train.steps = steps
  c.train.checkpoint_every = steps
  c.train.warmup_steps = 1  # every step after the first moves the weights
  for k, v in TRAIN.items():
    c.train[k] = v
  for k, v in mtp.items():
    c.model.mtp[k] = v
  return c


def run(config, workdir, devices, **kw):
  return train_and_evaluate(config, str(workdir), devices=devices[:1], **kw)


def model_tree(workdir, step) -> dict:
  """The model half of a checkpoint's state, read straight from disk."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings(), ocp.PyTreeCheckpointer() as c:
    warnings.simplefilter('ignore')
    return c.restore(os.path.join(str(workdir), 'checkpoints', str(step), 'state'))


def leaves(tree) -> dict:
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ----------------------------------------------------------------------- (a) frozen trunk
@pytest.fixture(scope='module')
def source(devices, stdlib_data_dir, tmp_path_factory):
  """A briefly trained M = 1 run: the 'existing model' that gets MTP drafting."""
  workdir = tmp_path_factory.mktemp('source')
  run(tiny(stdlib_data_dir, depth=1, steps=3), workdir, devices)
  return workdir


def test_frozen_trunk_trains_only_mtp_and_keeps_the_trunk_bit_identical(
    devices, stdlib_data_dir, source, tmp_path, capfd):
  """--init_from a M = 1 run into M = 2 with freeze_trunk + self targets, stopped and resumed:
  trunk / Emb / final norm bit-identical to the source, every MTP parameter moved."""
  config = tiny(stdlib_data_dir, depth=2, steps=4, freeze_trunk=True)
  config.loss.mtp_targets = 'self'
  config.train.checkpoint_every = 2
  workdir = tmp_path / 'frozen'
  run(config, workdir, devices, init_from=str(source), stop_after=0)  # the loaded start
  start = leaves(model_tree(workdir, 0)['0'])
  run(config, workdir, devices, stop_after=2)  # resumes the frozen optimizer state at 0 ...
  out = run(config, workdir, devices)  # ... and at 2 (Adam moments of the MTP params only)
  assert 'Resumed from' in capfd.readouterr().err
  assert np.isfinite(out['train/loss']) and out['train/loss_mtp_2'] > 0

  src = leaves(model_tree(source, 3)['0'])
  state = model_tree(workdir, 4)
  end = leaves(state['0'])
  trunk = [k for k in end if not k.startswith("['mtp']")]
  mtp = [k for k in end if k.startswith("['mtp']")]
  assert len(trunk) == 2 + 2 * 9 and len(mtp) == 2 * 13  # embed, norm, 2 blocks of 9; 2 depths
  for k in trunk:
    assert end[k].tobytes() == src[k].tobytes(), f'{k} changed'
  for k in mtp:
    assert not np.array_equal(end[k], start[k]), f'{k} did not train'
  np.testing.assert_array_equal(start["['mtp']['0']['eh_proj']['kernel']['value']"],
                                src["['mtp']['0']['eh_proj']['kernel']['value']"])
  moments = [k for k, v in leaves(state['1']['opt_state']).items() if v.ndim]  # not counts
  assert moments and all("['mtp']" in k for k in moments), 'frozen params hold optimizer state'

  config.model.mtp.freeze_trunk = False  # unfreezing in place: the optimizer state differs
  with pytest.raises(ConfigError,
                     match=r'model\.mtp\.freeze_trunk: checkpoint True vs config False'):
    run(config, workdir, devices)


def test_switching_freeze_trunk_on_a_workdir_is_a_clear_error(devices, stdlib_data_dir, source):
  frozen = tiny(stdlib_data_dir, depth=1, steps=3, freeze_trunk=True)
  with pytest.raises(ConfigError, match=r'incompatible config.*model\.mtp\.freeze_trunk: '
                                        r'checkpoint False vs config True.*--init_from'):
    run(frozen, source, devices)
  assert sorted(os.listdir(source / 'checkpoints')) == ['3']  # nothing moved aside


def test_freeze_trunk_needs_a_trained_trunk(devices, stdlib_data_dir, tmp_path):
  config = tiny(stdlib_data_dir, depth=1, steps=2, freeze_trunk=True)
  with pytest.raises(ConfigError, match=r'model\.mtp\.freeze_trunk.*--init_from'):
    run(config, tmp_path / 'fresh', devices)
  assert not os.path.exists(tmp_path / 'fresh' / 'checkpoints' / '0')


# ---------------------------------------------------------------- (d) bad combinations
@pytest.mark.parametrize('mutate, words', [
    (lambda c: (setattr(c.model.mtp, 'freeze_trunk', True), setattr(c.model.mtp, 'depth', 0)),
     'model.mtp.freeze_trunk'),
    (lambda c: setattr(c.loss, 'mtp_targets', 'teacher'), 'loss.mtp_targets'),
    (lambda c: (setattr(c.loss, 'mtp_targets', 'self'), setattr(c.model.mtp, 'depth', 0)),
     'loss.mtp_targets'),
    (lambda c: setattr(c.loss, 'mtp_target', 'self'),
     r'unknown config field loss\.mtp_target \(did you mean loss\.mtp_targets\?\)'),
])
def test_bad_combinations_name_their_field(mutate, words):
  c = load_config('tiny')
  mutate(c)
  with pytest.raises(ConfigError, match=words):
    config_lib.validate(c)


def test_mfu_counts_no_trunk_backward_when_frozen():
  c = tiny_model_config(depth=2)
  f = flops.config_flops_per_token(c)
  c.model.mtp.freeze_trunk = True
  got = flops.MFU(c).flops_per_token
  assert got == f.forward + 2 * (f.mtp_eh_proj + f.mtp_block) + f.vocab * 2 / 3 < f.train


# ------------------------------------------------------------------------ in-process model
def packed_batch():
  """Two documents and padding in row 0, one document filling row 1 (T = 16)."""
  rng = np.random.default_rng(0)
  seg = np.array([[1] * 5 + [2] * 7 + [0] * 4, [1] * 16], np.int32)
  pos = np.concatenate([np.r_[0:5, 0:7, 0:4][None], np.arange(16)[None]]).astype(np.int32)
  tokens = np.where(seg > 0, rng.integers(1, 64, seg.shape), 0).astype(np.int32)
  return {'tokens': jnp.asarray(tokens), 'segment_ids': jnp.asarray(seg),
          'positions': jnp.asarray(pos)}


def make_model(depth=2, kind='sequential', tie=True, **mtp):
  c = tiny_model_config(depth=depth, kind=kind, tie_embeddings=tie)
  for k, v in mtp.items():
    c.model.mtp[k] = v
  return MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(c)), rngs=nnx.Rngs(0))


def param_grads(model, batch, weight_sets, mtp_targets='data'):
  """(loss [n], sums, {param: grad [n, ...]}) for the n weight vectors of weight_sets
  [n, M1] (one weight per head), in one compiled program."""
  graph, params, rest = nnx.split(model, nnx.Param, ...)

  def f(p, w):
    m = nnx.merge(graph, p, rest)
    return loss_lib.loss_and_metrics(m, batch, w, mtp_targets=mtp_targets)

  grad = jax.vmap(jax.value_and_grad(f, has_aux=True), in_axes=(None, 0))
  (loss, sums), grads = jax.jit(grad)(params, jnp.asarray(weight_sets, jnp.float32))
  return np.asarray(loss), jax.tree.map(np.asarray, sums), leaves(grads)


# ---------------------------------------------------------------------- (b) stop_gradient
@pytest.mark.parametrize('kind, tie', [('sequential', True), ('parallel', False)])
def test_stop_gradient_keeps_mtp_losses_out_of_the_trunk(kind, tie):
  """Trunk, Emb and OutHead get no gradient from the MTP losses; the forward is unchanged."""
  batch = packed_batch()
  full, main_only, mtp_only = [1.0, 0.15, 0.15], [1.0, 0.0, 0.0], [0.0, 0.15, 0.15]
  loss_p, sums_p, g_plain = param_grads(make_model(kind=kind, tie=tie), batch, [full, main_only])
  loss_s, sums_s, g_stop = param_grads(make_model(kind=kind, tie=tie, stop_gradient=True),
                                       batch, [full, mtp_only])
  # The forward pass is the same up to rounding: with loss_chunk = 0 the plain model runs
  # every depth's vocab projection as one GEMM, while stop_gradient gives depth 0 its own
  # (OutHead is detached for the MTP depths only), so the sums differ in the last bits.
  np.testing.assert_allclose(loss_s[0], loss_p[0], rtol=1e-6)
  for k in sums_p:
    np.testing.assert_allclose(sums_s[k][0], sums_p[k][0], rtol=1e-6)
  trunk = [k for k in g_stop if not k.startswith("['mtp']")]
  assert any("['embed']" in k for k in trunk) and (tie or any("['lm_head']" in k for k in trunk))
  for k in trunk:
    assert not np.any(g_stop[k][1]), f'the MTP loss reaches {k}'
    # atol: the same rounding (grads are O(0.1-1); an MTP leak at weight 0.15 is >> 1e-6)
    np.testing.assert_allclose(g_stop[k][0], g_plain[k][1], rtol=1e-5, atol=1e-6)
  for k in g_stop:
    if k.startswith("['mtp']"):
      np.testing.assert_allclose(g_stop[k][0], g_plain[k][0], rtol=1e-5, atol=1e-6)
      assert np.any(g_stop[k][0]), k
  assert any(np.any(g_plain[k][0] != g_plain[k][1]) for k in trunk)  # without it MTP does reach


# ------------------------------------------------------------ (c) self-distillation targets
def test_self_targets_are_the_main_argmax_shifted_on_valid_positions():
  batch = packed_batch()
  model = make_model(depth=2)
  tokens, seg = np.asarray(batch['tokens']), np.asarray(batch['segment_ids'])
  hiddens = model(batch['tokens'], batch['positions'], batch['segment_ids'])
  logits = [np.asarray(model.logits(h, k)) for k, h in enumerate(hiddens)]
  pred0 = logits[0].argmax(-1)
  b, t = tokens.shape

  want_loss, want_agree, want_correct = [0.0, 0.0], [0, 0], [0, 0]
  for k in (1, 2):
    tgt = np.asarray(loss_lib.self_targets(jnp.asarray(pred0), 2))[k - 1]
    mask = np.asarray(loss_lib.valid_mask(batch['segment_ids'], k))
    logp = np.asarray(jax.nn.log_softmax(logits[k]))
    for r in range(b):
      for i in range(t):
        valid = seg[r, i] != 0 and i + k + 1 < t and seg[r, i + k + 1] == seg[r, i]
        assert mask[r, i] == valid, (k, r, i)
        if valid:  # the verifier's greedy token after the true prefix t_0..t_(i+k)
          assert tgt[r, i] == pred0[r, i + k]
          want_loss[k - 1] += -logp[r, i, pred0[r, i + k]]
          want_agree[k - 1] += logits[k][r, i].argmax() == pred0[r, i + k]
          want_correct[k - 1] += logits[k][r, i].argmax() == tokens[r, i + k + 1]
  assert not mask[0, 3] and not mask[0, 10] and not mask[0, 12]  # boundary, end, padding

  w = jnp.asarray([1.0, 0.5, 0.25])
  loss, sums = loss_lib.loss_and_metrics(model, batch, w, mtp_targets='self')
  np.testing.assert_allclose(sums['loss_sum'][1:], want_loss, rtol=1e-5)
  np.testing.assert_array_equal(sums['agree'][1:], want_agree)
  np.testing.assert_array_equal(sums['correct'][1:], want_correct)  # still vs the data
  _, data_sums = loss_lib.loss_and_metrics(model, batch, w)
  np.testing.assert_array_equal(sums['loss_sum'][0], data_sums['loss_sum'][0])
  count = np.asarray(sums['count'])
  np.testing.assert_allclose(
      loss, sums['loss_sum'][0] / count[0] + 0.5 * want_loss[0] / count[1]
      + 0.25 * want_loss[1] / count[2], rtol=1e-5)

  # targets are constants: the gradient of the 'self' loss w.r.t. the trunk comes only
  # through h^0 into the MTP modules, never through the argmax (stop_gradient cuts that too)
  stopped = make_model(depth=2, stop_gradient=True)
  _, _, g = param_grads(stopped, batch, [[0.0, 0.5, 0.25]], mtp_targets='self')
  assert all(not np.any(v) for k, v in g.items() if not k.startswith("['mtp']"))


# ------------------------------------------------------ (d) soft (distribution) targets
def test_soft_targets_are_the_main_distribution_shifted_without_gradient():
  """'soft': depth k at i is trained towards the main model's softmax at i + k (the law
  speculative sampling verifies its draft against), chunked equal to batched, and the
  teacher gets no gradient (the final norm is used by depth 0's head and the teacher
  only, so with the main weight 0 it must get none)."""
  batch = packed_batch()
  model = make_model(depth=2)
  seg = np.asarray(batch['segment_ids'])
  hiddens = model(batch['tokens'], batch['positions'], batch['segment_ids'])
  logits = [np.asarray(model.logits(h, k), np.float64) for k, h in enumerate(hiddens)]

  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

  b, t = seg.shape
  want = [0.0, 0.0]
  for k in (1, 2):
    p = np.exp(log_softmax(logits[0]))
    logq = log_softmax(logits[k])
    for r in range(b):
      for i in range(t):
        if seg[r, i] != 0 and i + k + 1 < t and seg[r, i + k + 1] == seg[r, i]:
          want[k - 1] += -(p[r, i + k] * logq[r, i]).sum()
  w = jnp.asarray([1.0, 0.5, 0.25])
  _, sums = loss_lib.loss_and_metrics(model, batch, w, mtp_targets='soft')
  np.testing.assert_allclose(sums['loss_sum'][1:], want, rtol=1e-5)
  _, self_sums = loss_lib.loss_and_metrics(model, batch, w, mtp_targets='self')
  assert np.all(np.asarray(sums['loss_sum'][1:]) != np.asarray(self_sums['loss_sum'][1:]))
  for key in ('correct', 'agree', 'count'):  # the statistics do not depend on the targets
    np.testing.assert_array_equal(sums[key], self_sums[key])
  _, chunked = loss_lib.loss_and_metrics(model, batch, w, mtp_targets='soft', chunk=8)
  np.testing.assert_allclose(chunked['loss_sum'], sums['loss_sum'], rtol=1e-5)

  _, _, g = param_grads(model, batch, [[0.0, 0.5, 0.25]], mtp_targets='soft')
  assert not np.any(g["['norm']['scale'].value"]), 'the soft loss reaches the teacher'
  assert np.any(g["['embed']['embedding'].value"])  # (the tied OutHead of the MTP heads does learn)
