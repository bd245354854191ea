"""The block and MTP-head kinds: one table of names, and classes that carry their own facts."""
import dataclasses
import inspect

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from helpers import dsv3_model_config, tiny_model_config
from mtp_jax import config_lib
from mtp_jax.data import tokenizers
from mtp_jax.decode import Decoder
from mtp_jax.errors import RequestError
from mtp_jax.model import layers, moe, moe_exchange, mtp
from mtp_jax.train import flops


def _args(config):
  return mtp.ModelArgs.from_config(tokenizers.resolve_vocab_size(config))


def test_the_config_accepts_exactly_the_model_s_kind_names():
  assert config_lib.ATTENTION_KINDS == tuple(mtp.ATTENTION_KINDS)
  assert config_lib.MLP_KINDS == tuple(mtp.MLP_KINDS)
  assert config_lib.MTP_KINDS == tuple(mtp.MTP_KINDS)
  assert config_lib.MOE_DISPATCHES == moe.DISPATCHES
  assert config_lib.MOE_EXCHANGES == moe_exchange.EXCHANGES


@pytest.mark.parametrize('name', config_lib.ATTENTION_KINDS)
def test_the_config_s_attention_facts_are_the_model_classes_own(name):
  """config_lib checks a config with ATTENTION_FACTS before JAX starts; each class carries
  the same facts, and behaves as they say: RoPE scaling moves its output, the bias flag
  adds q/k/v bias parameters."""
  assert tuple(config_lib.ATTENTION_FACTS) == tuple(mtp.ATTENTION_KINDS)
  facts, cls = config_lib.ATTENTION_FACTS[name], mtp.ATTENTION_KINDS[name]
  c = dsv3_model_config(1, attention=name, mlp='dense')  # head_dim 8, MLA's q/k heads 6 + 4
  args = _args(c)
  assert facts.qk_head_dim(c.model) == cls.head_widths(args)[0]
  assert (facts.takes_rope_scaling, facts.takes_qkv_bias) == (
      cls.takes_rope_scaling, cls.takes_qkv_bias)
  x_BxTxD = jax.random.normal(jax.random.key(0), (1, 6, args.d_model))
  positions_BxT = jnp.arange(6)[None] + 100
  mask = jnp.tril(jnp.ones((6, 6), bool))[None, None]

  def out(**fields):
    with nnx.use_eager_sharding(False):  # as MTPModel builds its layers, outside a mesh
      layer = cls(dataclasses.replace(args, **fields), rngs=nnx.Rngs(0))
    return layer, layer(x_BxTxD, positions_BxT, mask)[0]

  _, plain = out()
  _, scaled = out(rope_scaling=('linear', 4.0))
  assert (not jnp.allclose(plain, scaled)) == facts.takes_rope_scaling
  biased, _ = out(attention_bias=True)
  has_bias = any('bias' in str(path) for path, _ in nnx.to_flat_state(nnx.state(biased, nnx.Param)))
  assert has_bias == facts.takes_qkv_bias


@pytest.mark.parametrize('field, name', [('model.attention', 'sparse'), ('model.mlp', 'glu'),
                                         ('model.mtp.kind', 'medusa'),
                                         ('model.mtp.block_attention', 'sparse')])
def test_an_unknown_kind_is_refused_with_the_accepted_names(field, name):
  c = tiny_model_config()
  node = c
  for part in field.split('.')[:-1]:
    node = node[part]
  node[field.split('.')[-1]] = name
  with pytest.raises(config_lib.ConfigError, match=rf"{field}.*'\w+' or '\w+', got '{name}'"):
    config_lib.validate(c)


@pytest.mark.parametrize('table, protocol', [(mtp.ATTENTION_KINDS, layers.AttentionKind),
                                             (mtp.MLP_KINDS, layers.MLPKind)])
def test_every_block_kind_has_what_its_protocol_asks(table, protocol):
  wanted = {n for n, v in vars(protocol).items() if callable(v) or isinstance(v, staticmethod)}
  wanted -= {n for n in wanted if n.startswith('_') and n not in ('__init__', '__call__')}
  assert {'__call__', 'decode', 'prepare_decode', 'flops_per_token'} <= wanted
  for cls in table.values():
    for name in wanted:
      got = inspect.signature(getattr(cls, name))
      want = inspect.signature(getattr(protocol, name))
      assert list(got.parameters)[:len(want.parameters)] == list(want.parameters), (cls, name)


def test_layer_flops_are_each_kind_s_own_count():
  """A GQA + dense trunk under an MLA + MoE MTP block: each layer's FLOPs are its two
  classes' counts, and the class counts are the hand counts."""
  c = dsv3_model_config(1, attention='gqa', mlp='dense')
  c.model.mtp.block_attention, c.model.mtp.block_mlp = 'mla', 'moe'
  args = _args(c)
  keys = (16 + 1) / 2
  gqa = layers.Attention.flops_per_token(args, keys)
  assert gqa == (2 * 32 * 4 * 8 + 2 * 2 * 32 * args.n_kv_heads * 8 + 2 * 4 * 8 * 32,
                 2 * 2 * 4 * 8 * keys)
  mla_proj = (2 * 32 * 12 + 2 * 12 * 4 * 10) + (2 * 32 * 12 + 2 * 8 * 4 * 11) + 2 * 4 * 5 * 32
  assert mtp.ATTENTION_KINDS['mla'].flops_per_token(args, keys) == (
      mla_proj, 2 * 4 * 10 * keys + 2 * 4 * 5 * keys)
  assert layers.MLP.flops_per_token(args) == 3 * 2 * 32 * 64
  assert moe.MoE.flops_per_token(args) == 2 * 32 * 4 + 3 * 2 * 32 * 16 * (2 + 1)
  assert flops.layer_flops(args, 0, 16) == (gqa[0] + 3 * 2 * 32 * 64, gqa[1])
  got = flops.flops_per_token(args, 16)
  assert got.mtp_block == mla_proj + moe.MoE.flops_per_token(args) + 2 * 4 * 15 * keys


@pytest.mark.parametrize('kind', config_lib.MTP_KINDS)
def test_a_head_kind_carries_its_facts(kind):
  depth = 1 if kind == 'top' else 2  # TOP is one ranking head
  args = _args(tiny_model_config(depth, kind))
  head = args.mtp_head()
  assert head is mtp.MTP_KINDS[kind]
  model = mtp.MTPModel(args, rngs=nnx.Rngs(0))
  assert all(type(m) is head for m in model.mtp)
  # FLOPs outside the block: sequential's eh_proj 2d -> d, nothing for parallel or TOP heads
  assert head.flops_per_token(args) == {'sequential': 2 * 64 * 32, 'parallel': 0, 'top': 0}[kind]
  assert flops.flops_per_token(args, 16).mtp_eh_proj == depth * head.flops_per_token(args)
  assert (flops.flops_per_token(args, 16).mtp_block > 0) == head.has_block
  # drafts: a chained head reruns its last module (recursive drafts), a parallel one cannot,
  # a TOP head ranks tokens and drafts none
  assert head.max_drafts(0) == 0
  assert head.max_drafts(depth) == {'sequential': mtp.MAX_DRAFTS, 'parallel': depth,
                                    'top': 0}[kind]
  assert args.drafting_depths() == (0 if kind == 'top' else depth)
  decoder = Decoder(model)
  decoder.program(1, 4, 4, num_drafts=head.max_drafts(depth))
  with pytest.raises(RequestError, match='num_drafts must be in'):
    decoder.program(1, 4, 4, num_drafts=head.max_drafts(depth) + 1)


@pytest.mark.parametrize('kind', [k for k in config_lib.MTP_KINDS if mtp.MTP_KINDS[k].has_block])
def test_chained_says_whether_a_depth_reads_the_one_before(kind):
  """h^2 moves when depth 1's block changes iff the head is chained; h^1 reads tokens
  (t_(i+1)) iff chained too."""
  args = _args(tiny_model_config(2, kind))
  model = mtp.MTPModel(args, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (1, 8), 0, args.vocab_size)
  h = model(tokens)
  block = model.mtp[0].block
  kernel = block.mlp.down_proj.kernel
  kernel[...] = kernel[...] + 0.5
  h_moved = model(tokens)
  assert not jnp.allclose(h[1], h_moved[1])
  assert bool(not jnp.allclose(h[2], h_moved[2])) == args.mtp_head().chained
  later = tokens.at[0, -1].set((tokens[0, -1] + 1) % args.vocab_size)
  h_later = model(later)  # only the last token differs: h^1 at i = T-2 reads t_(T-1)
  assert bool(not jnp.allclose(h_moved[1][:, -2], h_later[1][:, -2])) == args.mtp_head().chained
