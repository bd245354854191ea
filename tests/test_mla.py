"""Multi-head latent attention (mtp_jax/model/mla.py): numpy agreement, causality, names, config,
the absorbed-latent cached decode."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import numpy_reference as ref
from helpers import dsv3_model_config, randomize, set_field
from mtp_jax import config_lib
from mtp_jax.data import tokenizers
from mtp_jax.model import ModelArgs, MTPModel

TOKENS = np.array([[5, 9, 1, 33, 2, 7, 60, 4, 11, 12, 3, 8, 21, 22, 0, 0]])
SEG = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 0, 0]])
POS = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1]])


def build(q_lora_rank=12, depth=1, seed=0):
  cfg = dsv3_model_config(depth, mlp='dense', q_lora_rank=q_lora_rank)
  return MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(cfg)), rngs=nnx.Rngs(seed))


@nnx.jit
def forward(model, tokens, positions=None, segment_ids=None):
  return model(tokens, positions, segment_ids)


@pytest.mark.parametrize('q_lora_rank', [0, 12])
def test_mla_model_matches_numpy(q_lora_rank):
  """Trunk and MTP blocks, packed documents, q compression on and off, dv != dn + dr."""
  model = build(q_lora_rank)
  params = randomize(model)
  hs = forward(model, jnp.asarray(TOKENS), jnp.asarray(POS), jnp.asarray(SEG))
  want = ref.forward(params, TOKENS[0], POS[0], SEG[0], 1)
  for k in range(2):
    np.testing.assert_allclose(np.asarray(hs[k][0]), want[k], rtol=2e-4, atol=2e-4)


def test_mla_is_causal():
  model = build()
  randomize(model)
  x = jax.random.normal(jax.random.key(0), (1, 10, 32))
  pos = jnp.arange(10)[None]
  mask = jnp.tril(jnp.ones((10, 10), bool))[None, None]
  attn = model.layers[0].self_attn
  jac = jax.jit(jax.jacrev(lambda v: attn(v, pos, mask)[0][0].sum(-1)))(x)[:, 0]  # [i, j, d]
  touched = np.abs(np.asarray(jac)).sum(-1) > 0
  assert np.array_equal(touched, np.tril(np.ones((10, 10), bool)))


def test_hugging_face_names_and_shapes():
  names = nnx.to_pure_dict(nnx.state(build(12), nnx.Param))
  a = names['layers'][0]['self_attn']
  assert set(a) == {'q_a_proj', 'q_a_layernorm', 'q_b_proj', 'kv_a_proj_with_mqa',
                    'kv_a_layernorm', 'kv_b_proj', 'o_proj'}
  assert a['kv_a_proj_with_mqa']['kernel'].shape == (32, 8 + 4)  # kv_lora + one rotary key
  assert a['kv_b_proj']['kernel'].shape == (8, 4, 6 + 5)  # per head: k_nope + v
  assert a['q_b_proj']['kernel'].shape == (12, 4, 6 + 4)
  assert set(names['mtp'][0]['block']['self_attn']) == set(a)  # the MTP block is MLA too
  plain = nnx.to_pure_dict(nnx.state(build(0), nnx.Param))['layers'][0]['self_attn']
  assert 'q_proj' in plain and 'q_a_proj' not in plain


# Row 0 grows 6 -> 7 -> 10 -> 12 tokens, row 1 (a shorter prompt, right-padded in the
# prefill as the Decoder pads it) 4 -> 5 -> 8 -> 10: per chunk (width, each row's start).
CHUNKS = [(6, (0, 0)), (1, (6, 4)), (3, (7, 5)), (2, (10, 8))]
VALID = (12, 10)
SLOTS = 16


@functools.partial(nnx.jit, static_argnums=6)
def _cached_step(attn, x, pos, mask, cache, start_B, layout):
  step = attn.decode if layout == 'heads_major' else attn  # bskh: __call__ with a cache
  return step(x, pos, mask, cache, start_B)


def chunked_decode(attn, x_BxTxD, noise_BxTxD, layout):
  """attn's cached path over CHUNKS: outputs [B, T, D] at the valid positions, the cache.

  Slots past a row's length hold `noise` (the prefill's padding) until overwritten, as
  in the Decoder: no query may see them."""
  x, noise, valid_B = np.asarray(x_BxTxD), np.asarray(noise_BxTxD), np.asarray(VALID)
  rows = np.arange(x.shape[0])[:, None]
  cache = attn.empty_cache(x.shape[0], SLOTS, layout)
  out = np.zeros_like(x)
  for width, starts in CHUNKS:
    pos_BxW = np.asarray(starts)[:, None] + np.arange(width)
    valid = (pos_BxW < valid_B[:, None])[..., None]
    mask = (np.arange(SLOTS)[None, None] <= pos_BxW[:, :, None])[:, None]
    y, cache = _cached_step(attn, np.where(valid, x[rows, pos_BxW], noise[rows, pos_BxW]),
                            pos_BxW, mask, cache, np.asarray(starts, np.int32), layout)
    out[rows, pos_BxW] = np.where(valid, np.asarray(y), out[rows, pos_BxW])
  return out, cache


@pytest.mark.parametrize('q_lora_rank,layout,absorb', [
    (12, 'heads_major', False), (12, 'heads_major', True), (0, 'heads_major', False),
    (0, 'heads_major', True), (12, 'bskh', None), (0, 'bskh', None)])
def test_absorbed_latent_decode_matches_the_uncached_forward(q_lora_rank, layout, absorb):
  """The cached absorbed-latent path (prefill, 1- and multi-token steps, rows of different
  lengths) == the explicit uncached forward, and the cache holds kvr + dr numbers per
  position only. heads_major: the decode layout, both output forms; bskh: __call__'s."""
  model = build(q_lora_rank)
  randomize(model)
  attn = model.layers[0].self_attn
  x = jax.random.normal(jax.random.key(1), (2, 12, 32))
  noise = jax.random.normal(jax.random.key(2), (2, 12, 32))
  pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
  want, _ = attn(x, pos, jnp.tril(jnp.ones((12, 12), bool))[None, None])
  copy = nnx.merge(*nnx.split(attn))
  if layout == 'heads_major':
    copy.prepare_decode(absorb)
    assert copy.absorb_output == absorb
    assert not hasattr(copy, 'kv_b_proj')  # the up-projections live in the query / output
  got, cache = chunked_decode(copy, x, noise, layout)
  for r in range(2):
    np.testing.assert_allclose(np.asarray(got[r, :VALID[r]]), np.asarray(want[r, :VALID[r]]),
                               atol=1e-5, rtol=1e-5, err_msg=f'row {r}')
  kvr, dr = 8, 4  # dsv3_model_config's kv_lora_rank, qk_rope_head_dim
  assert [c.shape for c in jax.tree.leaves(cache)] == [(2, SLOTS, kvr + dr)]


def test_output_absorption_is_chosen_by_size():
  """Absorbing W_vb into o_proj only when the one matrix is smaller than the two."""
  attn = nnx.merge(*nnx.split(build().layers[0].self_attn))
  attn.prepare_decode()  # kvr 8, d 32, dv 5: 8 * 32 = 256 > 5 * (8 + 32) = 200
  assert not attn.absorb_output and attn.o_t.shape == (32, 4 * 5)
  cfg = dsv3_model_config(mlp='dense')
  cfg.model.mla.v_head_dim = 8  # 256 <= 8 * 40
  model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(cfg)), rngs=nnx.Rngs(0))
  attn = model.layers[0].self_attn
  attn.prepare_decode()
  assert attn.absorb_output and attn.vo_t.shape == (32, 4 * 8)


@pytest.mark.parametrize('field,value,match', [
    ('attention', 'mha', "model.attention must be 'gqa' or 'mla'"),
    ('mla.qk_rope_head_dim', 3, 'qk_rope_head_dim must be even'),
    ('mla.kv_lora_rank', 0, 'kv_lora_rank must be a positive integer'),
    ('mla.q_lora_rank', -1, 'q_lora_rank must be a non-negative'),
])
def test_bad_mla_fields(field, value, match):
  c = dsv3_model_config(mlp='dense')
  set_field(c, field, value)
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(c)
