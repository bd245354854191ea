"""The multi-depth loss (docs/design.md section 3) against an independent numpy computation."""
import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import numpy_reference as ref
from helpers import POS, SEG, loss_batch, loss_grads, randomize, tiny_model_config
from mtp_jax.data import tokenizers
from mtp_jax.model import ModelArgs, MTPModel
from mtp_jax.runtime import sharding
from mtp_jax.train import loss as loss_lib
from mtp_jax.train.steps import loss_args

# Row 0 packs documents of 5, 6 and 3 tokens and 2 padding slots; row 1 is one document.
HAND_COUNTS = [26, 22, 18]


@jax.jit
def _masks(seg):
  return [loss_lib.valid_mask(seg, k) for k in range(3)]


def test_valid_positions_hand_counts():
  masks = _masks(jnp.asarray(SEG))
  assert [int(m.sum()) for m in masks] == HAND_COUNTS
  m2 = np.asarray(masks[2])[0]
  # depth 2 at the last position of doc 1 would read t_7 (doc 2): never valid
  assert not m2[2] and m2[1] and not m2[11:].any()


@pytest.mark.parametrize('kind,chunk', [('sequential', 4), ('parallel', 4), ('sequential', 0)])
def test_loss_matches_numpy(kind, chunk):  # chunk 0: all depths' logits in one product
  config = tiny_model_config(2, kind)
  config.model.mtp.weights = (0.2, 0.05)  # explicit weights override lambda / D
  model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(config)), rngs=nnx.Rngs(0))
  params = randomize(model, seed=2)
  b = loss_batch()
  weights = loss_lib.depth_weights(loss_args(config), 0)
  loss, sums = nnx.jit(lambda m, b: loss_lib.loss_and_metrics(m, b, weights, chunk=chunk))(model, b)
  want, want_sums, want_counts = ref.loss(params, np.asarray(b['tokens']), POS, SEG, 2,
                                          [0.2, 0.05], kind)
  assert list(np.asarray(sums['count'])) == HAND_COUNTS == list(want_counts)
  np.testing.assert_allclose(np.asarray(sums['loss_sum']), want_sums, rtol=1e-4)
  np.testing.assert_allclose(float(loss), want, rtol=1e-4)


def test_lambda_schedule_and_default_weights():
  config = tiny_model_config(3)
  config.model.mtp.lambda_values = (0.3, 0.1)
  config.model.mtp.lambda_boundaries = (100,)
  w0 = np.asarray(loss_lib.depth_weights(loss_args(config), 0))
  w1 = np.asarray(loss_lib.depth_weights(loss_args(config), 100))
  np.testing.assert_allclose(w0, [1, 0.1, 0.1, 0.1], rtol=1e-6)
  np.testing.assert_allclose(w1, [1, 0.1 / 3, 0.1 / 3, 0.1 / 3], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(loss_lib.depth_weights(loss_args(config), 99)), w0)


def test_mtp_loss_present_positive_and_in_gradient():
  config = tiny_model_config(2)
  model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(config)), rngs=nnx.Rngs(0))
  weights = loss_lib.depth_weights(loss_args(config), 0)
  (loss, sums), grads = loss_grads(model, loss_batch(), weights)
  per_depth = np.asarray(sums['loss_sum'] / sums['count'])
  assert np.all(per_depth[1:] > 0)
  main_only = per_depth[0]
  assert float(loss) > main_only + 0.01  # the MTP terms are in the loss
  for path, g in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads['mtp'])):
    assert float(jnp.abs(g).max()) > 0, f'MTP parameter {path} gets no gradient'
  zero = tiny_model_config(0)
  m0 = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(zero)), rngs=nnx.Rngs(0))
  assert not jax.tree.leaves(nnx.state(m0.mtp, nnx.Param))


def test_chunked_equals_unchunked():
  config = tiny_model_config(2)
  model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(config)), rngs=nnx.Rngs(1))
  w = loss_lib.depth_weights(loss_args(config), 0)
  (l1, s1), g1 = loss_grads(model, loss_batch(3), w, chunk=0)
  (l2, s2), g2 = loss_grads(model, loss_batch(3), w, chunk=4)
  np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(s1['correct']), np.asarray(s2['correct']))


def test_empty_mask_is_finite_zero():
  config = tiny_model_config(2)
  model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(config)), rngs=nnx.Rngs(0))
  b = {'tokens': jnp.zeros((2, 16), jnp.int32), 'segment_ids': jnp.zeros((2, 16), jnp.int32),
       'positions': jnp.zeros((2, 16), jnp.int32)}
  (loss, sums), grads = loss_grads(model, b, loss_lib.depth_weights(loss_args(config), 0))
  assert float(loss) == 0.0 and np.all(np.asarray(sums['count']) == 0)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_agreement_counts_match_numpy():
  """agree_k counts i where depth k's argmax at i equals the main argmax at i + k."""
  config = tiny_model_config(2)
  model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(config)), rngs=nnx.Rngs(0))
  params = randomize(model, seed=4)
  b = loss_batch(1)
  w = loss_lib.depth_weights(loss_args(config), 0)
  _, sums = nnx.jit(lambda m, b: loss_lib.loss_and_metrics(m, b, w))(model, b)
  tokens = np.asarray(b['tokens'])
  want = np.zeros(3)
  want_correct = np.zeros(3)
  for r in range(2):
    hs = ref.forward(params, tokens[r], POS[r], SEG[r], 2)
    preds = [ref.head_logits(params, h, k).argmax(-1) for k, h in enumerate(hs)]
    for k in range(3):
      for i in range(16):
        j = i + k + 1
        if SEG[r, i] == 0 or j >= 16 or SEG[r, j] != SEG[r, i]:
          continue
        want_correct[k] += preds[k][i] == tokens[r, j]
        if k > 0:
          want[k] += preds[k][i] == preds[0][i + k]
  np.testing.assert_array_equal(np.asarray(sums['agree']), want)
  np.testing.assert_array_equal(np.asarray(sums['correct']), want_correct)


def test_chunked_head_per_device_equals_global():
  """Under a mesh the chunked head runs per device on its own rows (OutHead gathered once,
  its gradient reduced once): the same loss, statistics and gradients as without a mesh."""
  config = tiny_model_config(2)
  config.mesh.shape = (2, 1, 1)
  model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(config)), rngs=nnx.Rngs(1))
  w = loss_lib.depth_weights(loss_args(config), 0)
  (l1, s1), g1 = loss_grads(model, loss_batch(3), w, chunk=4)
  mesh = sharding.make_mesh(config, jax.devices()[:2])
  with sharding.use_mesh(mesh, sharding.rules_of(config)):
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    jaxpr = jax.make_jaxpr(lambda p: loss_lib.loss_and_metrics(
        nnx.merge(graph, p, rest), loss_batch(3), w, chunk=4))(params)
    (l2, s2), g2 = loss_grads(model, loss_batch(3), w, chunk=4)
  assert 'shard_map' in str(jaxpr)
  np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
  for k in ('loss_sum', 'correct', 'count'):
    np.testing.assert_allclose(np.asarray(s1[k]), np.asarray(s2[k]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_loss_settings_are_read_once_and_older_configs_take_the_defaults():
  """loss_args reads the config once (the loss module never does); a config saved before
  the schedule, curriculum, offset and target fields existed (decoding, --init_from) gets
  their defaults, as the current base config has them."""
  config = tiny_model_config(3)
  config.model.mtp.lambda_values = (0.3, 0.1)
  config.model.mtp.lambda_boundaries = (100,)
  current = loss_args(config)
  assert (current.mtp_depth, current.lambda_boundaries, current.target_offsets()) == (
      3, (100,), (1, 2, 3, 4))
  for key in ('lambda_schedule', 'curriculum', 'curriculum_phase_steps', 'target_offsets'):
    del config.model.mtp[key]
  del config.loss
  assert loss_args(config) == current
  config.model.mtp.target_offsets = (2, 4, 5)
  assert loss_args(config).target_offsets() == (1, 2, 4, 5)
  config.model.mtp.target_offsets = ()
  config.model.mtp.kind = 'top'
  assert loss_args(config).target_offsets() == (1, 1, 1, 1)  # TOP ranks from the next token
  tree = ast.parse(pathlib.Path(loss_lib.__file__).read_text(encoding='utf-8'))
  imported = [ast.dump(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
  names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
  assert not [i for i in imported if 'config_lib' in i] and not names & {'config', 'config_lib'}
