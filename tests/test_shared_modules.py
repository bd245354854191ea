"""One MTP module reused at every depth (model.mtp.share_modules, FastMTP's recursive drafter)
and leap depths that read no skipped token (model.mtp.strict_leaps)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import (
  byte_config,
  loss_batch,
  loss_grads,
  tiny_model_config,
  train_word_model,
  word_prompts,
)
from mtp_jax import config_lib
from mtp_jax.config_lib import ConfigError
from mtp_jax.decode import decoder as decode
from mtp_jax.model import ModelArgs, MTPModel, count_params
from mtp_jax.train import flops
from mtp_jax.train_state.restore import restore_model


def shared_config(depth=3, **mtp):
  c = tiny_model_config(depth)
  c.model.mtp.share_modules = True
  for k, v in mtp.items():
    c.model.mtp[k] = v
  return c


def build(config, seed=0):
  return MTPModel(ModelArgs.from_config(config), rngs=nnx.Rngs(seed))


def test_shared_module_is_one_parameter_set_and_its_gradient_sums_the_depths():
  """M = 3 shared: one module's parameters; its forward equals three separate modules that
  hold copies of it, and its gradient equals the sum of theirs; FLOPs count three depths."""
  shared = build(shared_config(3))
  one = build(tiny_model_config(1))
  three = build(tiny_model_config(3))
  assert len(shared.mtp) == 1
  assert count_params(shared) == count_params(one)
  assert count_params(three)['mtp'] == 3 * count_params(shared)['mtp']
  per_depth = flops.flops_per_token(shared.args, 16)
  assert per_depth.as_dict() == flops.flops_per_token(three.args, 16).as_dict()

  # three separate modules holding the shared module's weights
  for name in ('embed', 'layers', 'norm'):
    nnx.update(getattr(three, name), nnx.state(getattr(shared, name)))
  for module in three.mtp:
    nnx.update(module, nnx.state(shared.mtp[0]))
  b = loss_batch()
  for h_s, h_t in zip(shared(b['tokens'], b['positions'], b['segment_ids']),
                      three(b['tokens'], b['positions'], b['segment_ids'])):
    np.testing.assert_allclose(np.asarray(h_s), np.asarray(h_t), rtol=1e-5, atol=1e-6)

  weights = jnp.asarray([1.0, 0.5, 0.3, 0.2])
  (_, _), g_shared = loss_grads(shared, b, weights)
  (_, _), g_three = loss_grads(three, b, weights)
  summed = jax.tree.map(lambda *xs: sum(xs), *[g_three['mtp'][k] for k in range(3)])
  got = jax.tree.leaves(g_shared['mtp'][0])
  want = jax.tree.leaves(summed)
  assert len(got) == len(want) > 0
  for a, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=2e-4, atol=1e-6)
  # the deeper depths really contribute: depth 1's gradient alone differs
  depth1 = jax.tree.leaves(g_three['mtp'][0])
  assert any(not np.allclose(np.asarray(a), np.asarray(d)) for a, d in zip(got, depth1))


@pytest.mark.parametrize('mutate, words', [
    (lambda c: setattr(c.model.mtp, 'kind', 'parallel'), "needs model.mtp.kind 'sequential'"),
    (lambda c: setattr(c.model.mtp, 'depth', 1), 'needs model.mtp.depth >= 2'),
    (lambda c: setattr(c.model.mtp, 'block_mlp', 'moe'), 'needs a dense MTP block'),
])
def test_bad_combinations_fail_in_one_line(mutate, words):
  c = shared_config(3)
  c.data.seq_len = 16
  mutate(c)
  with pytest.raises(ConfigError) as e:
    config_lib.validate(c)
  assert words in str(e.value) and '\n' not in str(e.value)


def test_strict_leaps_read_no_skipped_token():
  """Offsets (2, 4, 6): strict depths read t_(i+1), t_(i+2), t_(i+2) (the run of predicted
  offsets from 1), so changing t_(i+3) (skipped by depth 2) leaves every depth at position i
  unchanged; the ordinary leap input t_(i+3) of depth 2 sees it."""
  c = tiny_model_config(3)
  c.model.mtp.target_offsets = (2, 4, 6)
  plain = ModelArgs.from_config(c)
  assert plain.input_offsets() == (1, 3, 5)
  c.model.mtp.strict_leaps = True
  strict = build(c)
  assert strict.args.input_offsets() == (1, 2, 2)
  assert ModelArgs.from_config(tiny_model_config(3)).input_offsets() == (1, 2, 3)
  loose = build(_with_offsets((2, 4, 6)))
  nnx.update(loose, nnx.state(strict))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, (1, 16)).astype(np.int32)
  changed = tokens.copy()
  i = 5
  changed[0, i + 3] = (tokens[0, i + 3] + 7) % 64
  for model, leaks in ((strict, False), (loose, True)):
    a, b = model(jnp.asarray(tokens)), model(jnp.asarray(changed))
    same = [np.allclose(np.asarray(x[0, i]), np.asarray(y[0, i])) for x, y in zip(a, b)]
    assert same[:2] == [True, True]  # h^0 and depth 1 never read t_(i+3)
    assert same[2] is (not leaks), (model.args.strict_leaps, same)


def _with_offsets(offsets):
  c = tiny_model_config(len(offsets))
  c.model.mtp.target_offsets = offsets
  return c


@pytest.fixture(scope='module')
def trained_shared(devices, tmp_path_factory):
  """The word-language model with one module shared by its 3 depths, and its workdir."""
  c = byte_config(3)
  c.model.mtp.share_modules = True
  return c, *train_word_model(devices, tmp_path_factory, c)


@pytest.mark.slow
def test_shared_drafter_decodes_losslessly_and_restores(trained_shared):
  """Greedy self-speculative decoding with the shared module at every depth == plain AR,
  with drafts accepted past depth 1; the checkpoint restores the one module bit for bit."""
  config, model, workdir = trained_shared
  dec = decode.Decoder(model)
  prompts = word_prompts(8, seed=2)
  ar = dec.generate(prompts, 24, num_drafts=0, eos_id=None)
  sp = dec.generate(prompts, 24, num_drafts=3, eos_id=None)
  for i, (a, s) in enumerate(zip(ar.tokens, sp.tokens)):
    np.testing.assert_array_equal(s, a, err_msg=f'row {i}')
  assert sp.stats()['mean_accepted_length'] > 2.0, sp.stats()
  assert sp.accepted[:, 2:].sum() > 0  # depths 2 and 3 (the same module again) accepted
  restored = restore_model(config, workdir, config.train.steps)
  assert len(restored.mtp) == 1
  for a, b in zip(jax.tree.leaves(nnx.state(restored, nnx.Param)),
                  jax.tree.leaves(nnx.state(model, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_layouts_with_one_layer_per_depth_refuse_a_shared_module():
  """The MTP layouts hold one layer per depth: a shared module is refused in one line;
  --layout llama (the trunk) is written."""
  from mtp_jax.interop import layouts
  from mtp_jax.interop.safetensors_io import InteropError
  args = ModelArgs.from_config(shared_config(3))
  with pytest.raises(InteropError, match='model.mtp.share_modules') as e:
    layouts.check_layout(args, 'mimo')
  assert '\n' not in str(e.value)
  layouts.check_layout(args, 'llama')
