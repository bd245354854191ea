"""DeepSeek-V3 / Hugging Face weight layout: names, shapes, round trips both ways."""
import jax
import numpy as np
import pytest
from flax import nnx

from helpers import tiny_model_config
from mtp_jax import convert
from mtp_jax.model import MTPModel, ModelArgs


def _model(tie=True, seed=0, depth=2):
  args = ModelArgs.from_config(tiny_model_config(depth, tie_embeddings=tie))
  return args, MTPModel(args, rngs=nnx.Rngs(seed))


@nnx.jit
def _logits(model, tokens):
  return [model.logits(h, k) for k, h in enumerate(model(tokens))]


def _pure(model):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize('tie', [True, False])
def test_names_shapes_and_round_trip(tie):
  args, model = _model(tie)
  params = _pure(model)
  hf = convert.to_hf(params, args)
  n = args.n_layers  # MTP depth k lives at decoder layer n + k - 1, as in DeepSeek-V3
  d, v = args.d_model, args.vocab_size
  assert hf[f'model.layers.{n}.eh_proj.weight'].shape == (d, 2 * d)
  assert hf[f'model.layers.{n + 1}.shared_head.norm.weight'].shape == (d,)
  assert hf[f'model.layers.{n}.self_attn.q_proj.weight'].shape == (args.n_heads * args.head_dim, d)
  assert hf[f'model.layers.{n}.self_attn.k_proj.weight'].shape == (args.n_kv_heads * args.head_dim, d)
  assert hf[f'model.layers.{n}.mlp.down_proj.weight'].shape == (d, args.mlp_dim)
  assert hf['lm_head.weight'].shape == (v, d)
  assert f'model.layers.{n + 2}.enorm.weight' not in hf
  np.testing.assert_array_equal(hf[f'model.layers.{n}.eh_proj.weight'],
                                params['mtp'][0]['eh_proj']['kernel'].T)
  back = convert.from_hf(hf, args)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_synthetic_hf_tensors_load_and_compute_the_same():
  """Random tensors in HF layout -> model -> HF again is the identity, and two models
  loaded from the same tensors compute the same logits."""
  args, model = _model(False, seed=1)
  rng = np.random.default_rng(0)
  names = convert.to_hf(_pure(model), args, with_shared_copies=False)
  hf = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in names.items()}
  params = convert.from_hf(hf, args)
  again = convert.to_hf(params, args, with_shared_copies=False)
  assert sorted(again) == sorted(hf)
  for k in hf:
    np.testing.assert_array_equal(again[k], hf[k])
  outs = []
  for seed in (2, 3):
    _, m = _model(False, seed=seed)
    state = nnx.state(m, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(m, state)
    tokens = np.arange(16)[None] % args.vocab_size
    outs.append([np.asarray(x) for x in _logits(m, tokens)])
  for a, b in zip(*outs):
    np.testing.assert_array_equal(a, b)


def test_rejects_mismatched_tensors():
  args, model = _model(True)
  hf = convert.to_hf(_pure(model), args)
  bad = dict(hf)
  bad['model.layers.2.embed_tokens.weight'] = bad['model.layers.2.embed_tokens.weight'] + 1
  with pytest.raises(ValueError, match='shares Emb and OutHead'):
    convert.from_hf(bad, args)
  extra = dict(hf, **{'model.layers.9.enorm.weight': np.ones(3)})
  with pytest.raises(ValueError, match='unused tensors'):
    convert.from_hf(extra, args)
  pargs = ModelArgs.from_config(tiny_model_config(1, 'parallel'))
  pmodel = MTPModel(pargs, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='sequential MTP modules only'):
    convert.to_hf(_pure(pmodel), pargs)
