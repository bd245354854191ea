"""Multi-head latent attention (mtp_jax/mla.py): numpy agreement, causality, names, config."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import numpy_reference as ref
from helpers import dsv3_model_config, randomize, set_field
from mtp_jax import config_lib, decode
from mtp_jax.cli import RequestError
from mtp_jax.model import MTPModel, ModelArgs

TOKENS = np.array([[5, 9, 1, 33, 2, 7, 60, 4, 11, 12, 3, 8, 21, 22, 0, 0]])
SEG = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 0, 0]])
POS = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1]])


def build(q_lora_rank=12, depth=1, seed=0):
  cfg = dsv3_model_config(depth, mlp='dense', q_lora_rank=q_lora_rank)
  return MTPModel(ModelArgs.from_config(cfg), rngs=nnx.Rngs(seed))


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


def test_decoder_rejects_mla():
  with pytest.raises(RequestError, match='MLA or MoE'):
    decode.Decoder(build())


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
