"""`ModelArgs`: the model's hyper-parameters, read once from `config.model`, and where each
lives in the config."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mtp_jax.config import kinds
from mtp_jax.config.mesh import mesh_axes_form
from mtp_jax.config.readers import optional, rope_scaling_tuple
from mtp_jax.errors import ConfigError
from mtp_jax.model.kind_classes import MTP_KINDS
from mtp_jax.runtime import peak as peak_lib


@dataclasses.dataclass(frozen=True)
class ModelArgs:
  """Static model hyper-parameters (the resolved `config.model`)."""
  vocab_size: int
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 4
  head_dim: int = 64
  mlp_dim: int = 768
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  attention_bias: bool = False  # q/k/v biases (Qwen2)
  rope_scaling: tuple = ()  # layers.rope_inv_freq's form (config/readers.py)
  tie_embeddings: bool = True
  dtype: jnp.dtype = jnp.float32
  init_std: float = 0.02
  mtp_depth: int = 1
  mtp_kind: str = 'sequential'
  detach_trunk: bool = False
  stop_gradient: bool = False  # MTP losses reach neither h^0 nor Emb nor OutHead (config/base.py)
  mtp_target_offsets: tuple = ()  # o_1..o_M: depth k predicts t_(i+o_k); () = k + 1
  strict_leaps: bool = False  # a leap depth reads no token its leap skips (input_offsets)
  share_modules: bool = False  # one MTP module serves every depth (FastMTP's recursion)
  top_window: int = 16  # mtp_kind 'top': W, the upcoming tokens its ranking target orders
  remat: str = 'none'  # none | block | full (see remat_policy); never changes parameters
  scan_layers: bool = False  # lax.scan over trunk blocks and MTP depths; never changes parameters
  pipeline_stages: int = 1  # the mesh's 'stage' axis: S > 1 pipelines the trunk (pipeline.py)
  pipeline_microbatches: int = 0  # microbatches through the pipeline; 0: S
  # Block kinds (config/kinds.py's ATTENTION and MLP names; config/base.py documents each).
  attention: str = 'gqa'
  mlp: str = 'dense'
  mtp_block_attention: str = ''  # '' = attention
  mtp_block_mlp: str = ''  # '' = the rule of layer index n_layers (DeepSeek-V3's MTP layer)
  q_lora_rank: int = 0
  kv_lora_rank: int = 64
  qk_nope_head_dim: int = 32
  qk_rope_head_dim: int = 16
  v_head_dim: int = 32
  n_routed_experts: int = 8
  n_shared_experts: int = 1
  num_experts_per_tok: int = 2
  moe_intermediate_size: int = 128
  routed_scaling_factor: float = 1.0
  n_group: int = 1  # node-limited routing: expert groups (1: off) ...
  topk_group: int = 1  # ... and how many of them a token may use
  moe_dispatch: str = 'auto'  # grouped matmul: auto | ragged | blocks | gmm (moe.DISPATCHES)
  moe_exchange: str = 'all_to_all'  # expert-parallel exchange (moe_exchange.EXCHANGES)
  moe_capacity_factor: float = 0.0  # receive buffer / mean rows; 0: dropless
  first_k_dense: int = 1
  attention_core: str = 'auto'  # attention core without a cache (attn_lib.attention_impl)
  attention_block: int = 64  # the blocked core's block
  attention_block_q: int = 512  # the splash kernel's query / key blocks
  attention_block_kv: int = 512

  @classmethod
  def from_config(cls, config, vocab_size: int | None = None) -> ModelArgs:
    """The model of `config`; vocab_size overrides config.model.vocab_size.

    The model does not read tokenizers: a config whose model.vocab_size is 0 (the
    tokenizer's size) is resolved first, by data.tokenizers.resolve_vocab_size.
    """
    vocab_size = int(vocab_size or config.model.vocab_size)
    if vocab_size <= 0:
      raise ConfigError('model.vocab_size is 0 (the tokenizer\'s size): resolve it first '
                        '(mtp_jax.data.tokenizers.resolve_vocab_size) or pass vocab_size')
    values = {'vocab_size': vocab_size, 'dtype': peak_lib.compute_dtype(config.model.dtype),
              'rope_scaling': rope_scaling_tuple(config),
              'pipeline_stages': mesh_axes_form(config.mesh)['stage']}
    for field in dataclasses.fields(cls):
      if field.name not in values:  # a config saved before a field existed: its default
        values[field.name] = optional(config, 'model.' + config_path(field.name),
                                      field.default)
    values['mtp_target_offsets'] = tuple(int(o) for o in values['mtp_target_offsets'])
    return cls(**values)

  def target_offsets(self) -> tuple:
    """(1, o_1, ..., o_M): how far ahead each head predicts, the main head first. A TOP
    head's ranking starts at the next token: offset 1 (it cannot draft)."""
    return kinds.target_offsets(self.mtp_kind, self.mtp_depth, self.mtp_target_offsets)

  def input_offsets(self) -> tuple:
    """(a_1, ..., a_M): depth k reads the token t_(i+a_k). o_k - 1, the token just before
    its target, unless strict_leaps: then the longest run 1..a of offsets that a head
    before depth k predicts (1, o_1, ..., o_(k-1)), at most o_k - 1, so a leap depth reads
    no token its leap skips (causal attention shows position i its neighbours' inputs
    t_(i+a-1), t_(i+a-2), ..., so only such a run leaks none). Equal to o_k - 1 for every
    adjacent depth."""
    offsets = self.target_offsets()
    if not self.strict_leaps:
      return tuple(o - 1 for o in offsets[1:])
    out = []
    for k in range(1, self.mtp_depth + 1):
      known, a = set(offsets[:k]), 0
      while a + 1 in known and a + 1 < offsets[k]:
        a += 1
      out.append(a)
    return tuple(out)

  def mtp_modules(self) -> int:
    """How many MTP modules hold parameters: one under share_modules, else one per depth."""
    return kinds.mtp_module_count(self.mtp_depth, self.share_modules)

  def module_index(self, k: int) -> int:
    """The index into MTPModel.mtp of depth k's module (k > M: the last, for recursive
    drafts; every depth the one module under share_modules)."""
    return 0 if self.share_modules else min(k, self.mtp_depth) - 1

  def head_facts(self) -> kinds.HeadFacts:
    """The MTP head kind's entry in config/kinds.py's table (what is known without its class)."""
    return kinds.MTP_HEADS[self.mtp_kind]

  def mtp_head(self) -> type:
    """The class of the MTP modules (MTP_KINDS[mtp_kind]): what they read and can draft."""
    return MTP_KINDS[self.mtp_kind]

  def drafting_depths(self) -> int:
    """How many leading depths can draft: those with o_k = k + 1. A leap depth (o_k > k + 1)
    predicts a token past the position the next draft fills, so the chain stops before it."""
    offsets = self.target_offsets()
    c = 0
    while c < self.mtp_depth and offsets[c + 1] == c + 2:
      c += 1
    return c


# Where each ModelArgs field lives under config.model when not under its own name there.
_MLA_FIELDS = ('q_lora_rank', 'kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim',
               'v_head_dim')
_MOE_FIELDS = ('n_routed_experts', 'n_shared_experts', 'num_experts_per_tok',
               'moe_intermediate_size', 'routed_scaling_factor', 'n_group', 'topk_group',
               'first_k_dense')
_CONFIG_PATHS = {
    'mtp_depth': 'mtp.depth', 'mtp_kind': 'mtp.kind', 'detach_trunk': 'mtp.detach_trunk',
    'stop_gradient': 'mtp.stop_gradient', 'mtp_target_offsets': 'mtp.target_offsets',
    'top_window': 'mtp.top_window', 'strict_leaps': 'mtp.strict_leaps',
    'share_modules': 'mtp.share_modules',
    'mtp_block_attention': 'mtp.block_attention',
    'mtp_block_mlp': 'mtp.block_mlp', 'moe_dispatch': 'moe.dispatch',
    'moe_exchange': 'moe.exchange', 'moe_capacity_factor': 'moe.capacity_factor',
    **{name: f'mla.{name}' for name in _MLA_FIELDS},
    **{name: f'moe.{name}' for name in _MOE_FIELDS},
}


def config_path(field: str) -> str:
  """The config.model path of a ModelArgs field ('mtp_depth' -> 'mtp.depth')."""
  return _CONFIG_PATHS.get(field, field)
