"""The block and MTP-head kinds: one table of names and facts (config/kinds.py), read by the
config checks and by the model classes. Every test here takes a kind's facts from its entry
or its class, so a new kind is tested without editing this file."""
import dataclasses
import inspect

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from helpers import dsv3_model_config, tiny_model_config
from mtp_jax import config_lib
from mtp_jax import model as mtp
from mtp_jax.config import kinds
from mtp_jax.data import tokenizers
from mtp_jax.decode import Decoder
from mtp_jax.errors import RequestError
from mtp_jax.interop import layouts
from mtp_jax.interop.safetensors_io import InteropError
from mtp_jax.model import layers, moe
from mtp_jax.train import flops


def _args(config):
  return mtp.ModelArgs.from_config(tokenizers.resolve_vocab_size(config))


@pytest.mark.parametrize('table, classes', [(kinds.ATTENTION, mtp.ATTENTION_KINDS),
                                            (kinds.MLP, mtp.MLP_KINDS),
                                            (kinds.MTP_HEADS, mtp.MTP_KINDS)])
def test_the_model_builds_the_classes_the_table_names(table, classes):
  assert list(classes) == list(table)
  for name, facts in table.items():
    cls = classes[name]
    assert isinstance(cls, type) and f'{cls.__module__}.{cls.__qualname__}' == facts.cls
    if table is kinds.ATTENTION:
      assert cls.facts is facts, (name, 'holds another kind\'s facts')


@pytest.mark.parametrize('name', kinds.ATTENTION_KINDS)
def test_an_attention_class_behaves_as_its_facts_say(name):
  """config/kinds.py's entry, which the config checks read before JAX starts, is what the
  class does: its head widths on the config and on the model arguments agree, its
  softmax_scale is 1 / sqrt(q/k width) and every core reads it, RoPE scaling moves its
  output, the bias flag adds q/k/v bias parameters."""
  cls = mtp.ATTENTION_KINDS[name]
  facts = cls.facts
  c = dsv3_model_config(1, attention=name, mlp='dense')  # head_dim 8, MLA's q/k heads 6 + 4
  args = _args(c)
  assert facts.head_widths(kinds.args_view(c.model)) == facts.head_widths(args)
  x_BxTxD = jax.random.normal(jax.random.key(0), (1, 6, args.d_model))
  positions_BxT = jnp.arange(6)[None] + 100
  mask = jnp.tril(jnp.ones((6, 6), bool))[None, None]

  def out(**fields):
    with nnx.use_eager_sharding(False):  # as MTPModel builds its layers, outside a mesh
      layer = cls(dataclasses.replace(args, **fields), rngs=nnx.Rngs(0))
    return layer, layer(x_BxTxD, positions_BxT, mask)[0]

  layer, plain = out()
  assert layer.softmax_scale == pytest.approx(facts.head_widths(args)[0] ** -0.5)
  for core in ('blocked', 'xla'):
    with nnx.use_eager_sharding(False):
      layer = cls(dataclasses.replace(args, attention_core=core), rngs=nnx.Rngs(0))
    base = layer(x_BxTxD, positions_BxT, mask)[0]
    layer.softmax_scale *= 3.0
    assert not jnp.allclose(base, layer(x_BxTxD, positions_BxT, mask)[0]), core
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


def _measured_flops_per_token(module, args, t: int = 8) -> float:
  """XLA's count of the FLOPs of a head's block_input (what it does before its block) per
  token of a [1, t] batch."""
  h_BxTxD = jnp.ones((1, t, args.d_model), args.dtype)
  tokens_BxT = jnp.zeros((1, t), jnp.int32)
  embed = lambda tok: jnp.ones(tok.shape + (args.d_model,), args.dtype)
  cost = jax.jit(lambda h, tok: module.block_input(h, tok, embed)).lower(
      h_BxTxD, tokens_BxT).cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get('flops', 0.0)) / t


@pytest.mark.parametrize('kind', kinds.MTP_KINDS)
def test_a_head_kind_carries_its_facts(kind):
  depth = min(2, kinds.MTP_HEADS[kind].max_depth or 2)
  args = _args(tiny_model_config(depth, kind))
  head = args.mtp_head()
  assert head is mtp.MTP_KINDS[kind]
  model = mtp.MTPModel(args, rngs=nnx.Rngs(0))
  assert all(type(m) is head for m in model.mtp)
  # FLOPs outside the block: what XLA counts in its block_input, within its norms' and
  # concatenations' few elementwise FLOPs (sequential: eh_proj 2d -> d and two RMSNorms)
  measured = _measured_flops_per_token(model.mtp[0], args)
  assert head.flops_per_token(args) <= measured <= 1.25 * head.flops_per_token(args), measured
  assert flops.flops_per_token(args, 16).mtp_eh_proj == depth * head.flops_per_token(args)
  assert (flops.flops_per_token(args, 16).mtp_block > 0) == head.has_block
  # drafts: only a chained head may rerun its last module (recursive drafts); a head that
  # predicts no single token drafts none
  assert head.max_drafts(0) == 0
  assert head.max_drafts(depth) <= (mtp.MAX_DRAFTS if head.chained else depth)
  if not kinds.MTP_HEADS[kind].predicts_tokens:
    assert head.max_drafts(depth) == 0
  assert args.drafting_depths() == (depth if kinds.MTP_HEADS[kind].predicts_tokens else 0)
  decoder = Decoder(model)
  decoder.program(1, 4, 4, num_drafts=head.max_drafts(depth))
  with pytest.raises(RequestError, match='num_drafts must be in'):
    decoder.program(1, 4, 4, num_drafts=head.max_drafts(depth) + 1)


@pytest.mark.parametrize('kind', [k for k in kinds.MTP_KINDS if mtp.MTP_KINDS[k].has_block])
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


@pytest.mark.parametrize('layout', ['llama', 'mimo', 'deepseek_v3'])
def test_export_refuses_a_kind_no_layout_holds_naming_that_kind(layout, monkeypatch):
  """A kind whose entry lists no export layout is refused by every layout with advice about
  that kind, not about MLA / MoE; a known kind another layout holds names that layout."""
  gqa = kinds.ATTENTION['gqa']
  monkeypatch.setitem(kinds.ATTENTION, 'unlisted', dataclasses.replace(gqa, hf_layouts=()))
  args = dataclasses.replace(_args(tiny_model_config(1)), attention='unlisted')
  with pytest.raises(InteropError, match=r"no export layout holds the attention kind "
                     r"'unlisted'; the layouts hold gqa as --layout llama or mimo; mla as"):
    layouts.check_layout(args, layout)
  for name, facts in kinds.ATTENTION.items():
    other = [x for x in layouts.LAYOUTS if x not in facts.hf_layouts]
    if facts.hf_layouts and other:
      args = dataclasses.replace(args, attention=name)
      with pytest.raises(InteropError, match=f'{facts.label} blocks export as --layout '
                         f'{facts.hf_layouts[0]}'):
        layouts.check_layout(args, other[0])
