"""Token order prediction (model.mtp.kind 'top'): its targets, loss, gradient, FLOPs and config."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import tiny_model_config
from mtp_jax import config_lib
from mtp_jax.data import tokenizers
from mtp_jax.model import heads, mtp
from mtp_jax.train import flops, loss


def _reference_targets(tokens, seg, window, vocab):
  """Straight from the definition, one position at a time: token v at position i scores
  window - d + 1 for its first occurrence at distance d (1..window) in t_i's document,
  else -inf."""
  b, t = tokens.shape
  out = np.full((b, t, vocab), -np.inf)
  for r in range(b):
    for i in range(t):
      if seg[r, i] == 0:
        continue
      for d in range(1, window + 1):
        j = i + d
        if j >= t or seg[r, j] != seg[r, i]:
          break
        v = tokens[r, j]
        if out[r, i, v] == -np.inf:
          out[r, i, v] = window - d + 1
  return out


def test_targets_match_a_numpy_reference_with_repeats_and_document_ends():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 6, (3, 20)).astype(np.int32)  # 6 tokens: many repeats in a window
  seg = np.ones((3, 20), np.int32)
  seg[1, 9:] = 2  # a second document
  seg[2, 15:] = 0  # padding
  for window in (1, 4, 7):
    got = np.asarray(loss.top_targets(jnp.asarray(tokens), jnp.asarray(seg), window, 6))
    np.testing.assert_array_equal(got, _reference_targets(tokens, seg, window, 6))
  # by hand: tokens 5 3 5 2, window 3, at i = 0: 3 -> 3 (d 1), 5 -> 2 (d 2), 2 -> 1 (d 3)
  got = np.asarray(loss.top_targets(jnp.asarray([[5, 3, 5, 2, 0]]), jnp.ones((1, 5), jnp.int32),
                                    3, 6))
  assert got[0, 0].tolist() == [-np.inf, -np.inf, 1, 3, -np.inf, 2]


def _top_config(window=4):
  c = tiny_model_config(1, 'top')
  c.model.mtp.top_window = window
  return tokenizers.resolve_vocab_size(c)


def test_top_loss_is_finite_positive_and_trains_its_head_and_the_trunk():
  c = _top_config()
  args = mtp.ModelArgs.from_config(c)
  assert args.target_offsets() == (1, 1) and args.drafting_depths() == 0
  model = mtp.MTPModel(args, rngs=nnx.Rngs(0))
  assert type(model.mtp[0]) is heads.TokenOrderHead
  rng = np.random.default_rng(1)
  batch = {'tokens': jnp.asarray(rng.integers(0, args.vocab_size, (2, 16)), jnp.int32),
           'segment_ids': jnp.ones((2, 16), jnp.int32)}
  weights = jnp.asarray([1.0, 0.5])

  def f(model):
    return loss.loss_and_metrics(model, batch, weights)

  (value, sums), grads = nnx.value_and_grad(f, has_aux=True)(model)
  per = np.asarray(sums['loss_sum'] / sums['count'])
  assert np.isfinite(per).all() and per[1] > 0 and np.isfinite(float(value))
  # ListNet against a distribution over at most W tokens, from a near-uniform start: about
  # log V (the cross-entropy of any target against a uniform prediction)
  assert per[1] == pytest.approx(np.log(args.vocab_size), rel=0.05)
  assert float(value) == pytest.approx(per[0] + 0.5 * per[1], rel=1e-5)
  g_head = np.asarray(grads.mtp[0].unembed[...])
  g_trunk = np.asarray(grads.layers[0].mlp.down_proj.kernel[...])
  assert np.abs(g_head).max() > 0 and np.abs(g_trunk).max() > 0

  # the TOP term alone moves the trunk: its gradient differs from the main loss's alone
  def main_only(model):
    return loss.loss_and_metrics(model, batch, jnp.asarray([1.0, 0.0]))[0]
  g_main = np.asarray(nnx.grad(main_only)(model).layers[0].mlp.down_proj.kernel[...])
  assert not np.allclose(g_main, g_trunk)


def test_a_perfect_ranking_scores_lower_than_a_wrong_one():
  """The loss is minimised by scores ordered like the target: logits equal to the target
  (up to a scale) beat logits of reversed order."""
  tokens = jnp.asarray([[1, 2, 3, 1, 2, 3, 1, 2]], jnp.int32)
  seg = jnp.ones_like(tokens)
  target = loss.top_targets(tokens, seg, 3, 5)
  p = jax.nn.softmax(target, axis=-1)
  finite = jnp.where(jnp.isfinite(target), target, -10.0)
  good = jnp.sum(-p * jax.nn.log_softmax(4 * finite), axis=-1)
  bad = jnp.sum(-p * jax.nn.log_softmax(-4 * finite), axis=-1)
  assert bool(jnp.all(good[0, :5] < bad[0, :5]))


def test_flops_count_one_more_unembedding_and_no_block():
  c = _top_config()
  args = mtp.ModelArgs.from_config(c)
  got = flops.flops_per_token(args, 16)
  d0 = flops.flops_per_token(mtp.ModelArgs.from_config(
      tokenizers.resolve_vocab_size(tiny_model_config(0))), 16)
  assert got.mtp_block == 0 and got.mtp_eh_proj == 0
  assert got.vocab == 2 * d0.vocab == 2 * 2 * args.d_model * args.vocab_size
  assert got.forward - d0.forward == 2 * args.d_model * args.vocab_size


@pytest.mark.parametrize('change, match', [
    (lambda c: setattr(c.model.mtp, 'depth', 2), "depth must be 1"),
    (lambda c: setattr(c.model.mtp, 'top_window', 0), 'top_window must be a positive integer'),
    (lambda c: setattr(c.model.mtp, 'target_offsets', (3,)), 'target_offsets do not apply'),
    (lambda c: setattr(c.loss, 'mtp_targets', 'self'), "use 'data'"),
])
def test_bad_top_configs_are_refused(change, match):
  c = tiny_model_config(1, 'top')
  config_lib.validate(c)
  change(c)
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(c)
