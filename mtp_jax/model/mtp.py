"""The main decoder and its M multi-token-prediction modules (docs/design.md sections 1-2).

Sequential (DeepSeek-V3) depth k at position i:
  h'^k_i = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)])
  h^k    = block_k(h'^k)              causal, RoPE at the original positions i
  P^k    = OutHead(shared_head.norm(h^k_i))     distribution of t_{i+k+1}
Parallel heads (ablation): h^k = block_k(h^0), no token input, no chain.
`Emb` and `OutHead` are shared by every depth.
Token order prediction (TOP, Zuhri et al. 2025): no block; one extra unembedding
U_top [D, V] scores every token on the trunk's normed h^0 (train/loss.py's top_sums).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

import mtp_jax.model.attention as attn_lib
import mtp_jax.model.decode_ops as decode_ops
import mtp_jax.model.layers as layers
import mtp_jax.model.matmul as matmul
import mtp_jax.model.moe as moe
from mtp_jax import config_lib
from mtp_jax.config import kinds
from mtp_jax.errors import ConfigError
from mtp_jax.model.kind_classes import ATTENTION_KINDS, MLP_KINDS, MTP_KINDS
from mtp_jax.runtime import peak as peak_lib
from mtp_jax.runtime.sharding import constrain

Array = jax.Array


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
  rope_scaling: tuple = ()  # layers.rope_inv_freq's form (config_lib.rope_scaling_tuple)
  tie_embeddings: bool = True
  dtype: jnp.dtype = jnp.float32
  init_std: float = 0.02
  mtp_depth: int = 1
  mtp_kind: str = 'sequential'
  detach_trunk: bool = False
  stop_gradient: bool = False  # MTP losses reach neither h^0 nor Emb nor OutHead (config_lib)
  mtp_target_offsets: tuple = ()  # o_1..o_M: depth k predicts t_(i+o_k); () = k + 1
  strict_leaps: bool = False  # a leap depth reads no token its leap skips (input_offsets)
  share_modules: bool = False  # one MTP module serves every depth (FastMTP's recursion)
  top_window: int = 16  # mtp_kind 'top': W, the upcoming tokens its ranking target orders
  remat: str = 'none'  # none | block | full (see remat_policy); never changes parameters
  scan_layers: bool = False  # lax.scan over trunk blocks and MTP depths; never changes parameters
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
              'rope_scaling': config_lib.rope_scaling_tuple(config)}
    for field in dataclasses.fields(cls):
      if field.name not in values:  # a config saved before a field existed: its default
        values[field.name] = config_lib.optional(config, 'model.' + config_path(field.name),
                                                 field.default)
    values['mtp_target_offsets'] = tuple(int(o) for o in values['mtp_target_offsets'])
    return cls(**values)

  def target_offsets(self) -> tuple:
    """(1, o_1, ..., o_M): how far ahead each head predicts, the main head first. A TOP
    head's ranking starts at the next token: offset 1 (it cannot draft)."""
    if self.mtp_kind == 'top':
      return (1,) * (self.mtp_depth + 1)
    return (1,) + (tuple(self.mtp_target_offsets) or tuple(range(2, self.mtp_depth + 2)))

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


def block_kinds(args: ModelArgs, layer: int) -> tuple[str, str]:
  """(attention kind, MLP kind) names of trunk layer `layer`; layer n_layers is the MTP
  block.

  Dense MLPs in layers [0, first_k_dense), MoE after when args.mlp is 'moe'; the MTP
  blocks take that rule at index n_layers (MoE, as DeepSeek-V3's MTP layer 61) unless
  mtp_block_attention / mtp_block_mlp name a kind.
  """
  attention, mlp = args.attention, args.mlp
  if mlp == 'moe' and layer < args.first_k_dense:
    mlp = 'dense'
  if layer >= args.n_layers:
    attention = args.mtp_block_attention or attention
    mlp = args.mtp_block_mlp or mlp
  return attention, mlp


def block_classes(args: ModelArgs, layer: int) -> tuple:
  """(attention class, MLP class) of trunk layer `layer` (block_kinds' names)."""
  attention, mlp = block_kinds(args, layer)
  return ATTENTION_KINDS[attention], MLP_KINDS[mlp]


def shift_left(x_BxT: Array, k: int, fill=0) -> Array:
  """x[:, i + k] at position i; the last k positions hold `fill` (static shape)."""
  if k == 0:
    return x_BxT
  k = min(k, x_BxT.shape[1])  # k >= T: all fill, still length T
  pad = jnp.full((x_BxT.shape[0], k) + x_BxT.shape[2:], fill, x_BxT.dtype)
  return jnp.concatenate([x_BxT[:, k:], pad], axis=1)


def vocab_logits(norm, h_BxTxD: Array, w_DxV: Array) -> Array:
  """float32 logits [B, T, V] of norm(h) @ w as one 2-D matmul (see layers.project)."""
  b, t, d = h_BxTxD.shape
  x_BTxD = norm(h_BxTxD).reshape(b * t, d)
  return matmul.matmul(x_BTxD, w_DxV, x_BTxD.dtype, jnp.float32).reshape(b, t, -1)


# what each block policy keeps beyond `block`'s (layers: the names Block and MLP give them)
_KEPT_BEYOND_BLOCK = {'block': (), 'block_norms': (layers.NORM_SAVED_NAME,),
                      'block_mlp': (layers.MLP_SAVED_NAME,),
                      'block_inputs': (layers.NORM_SAVED_NAME, layers.MLP_SAVED_NAME)}


def remat_policy(name: str):
  """The jax.checkpoint policy of config.model.remat (None: no rematerialisation).

  block:        keep each block's weight-matmul outputs (q/k/v/o, gate/up/down
                projections, the routed experts' grouped products: moe.EXPERT_SAVED_NAME)
                and the attention core's residuals (attn_lib.ATTENTION_SAVED_NAMES: the
                blocked core's custom VJP, the splash / Triton kernels' output and
                log-sum-exp); recompute the norms, the SwiGLU product and, where that core
                is not used, RoPE and the attention scores and softmax.
  block_norms:  block, and the two RMSNorm outputs of each block (the inputs of the
                q/k/v and gate/up matmuls: their weight gradients need them) with their
                row rsqrt: no norm is recomputed ([B, T, D] twice per layer more).
  block_mlp:    block, and the SwiGLU product (the down projection's input): [B, T, F]
                per layer more.
  block_inputs: both: every weight matmul's input and output is kept.
  full:         keep only each block's input; recompute the whole block in the backward
                pass.
  """
  if name == 'none':
    return None
  if name in _KEPT_BEYOND_BLOCK:
    # plus the attention core's named residuals (output, row log-sum-exp and, for the
    # blocked core, heads-major q / k / v): its backward needs only those, never a rerun
    # of its forward
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*attn_lib.ATTENTION_SAVED_NAMES,
                                                      moe.EXPERT_SAVED_NAME,
                                                      *_KEPT_BEYOND_BLOCK[name]))
  if name == 'full':
    return jax.checkpoint_policies.nothing_saveable
  raise ValueError(f'unknown remat policy {name!r}')


def _apply_block(graphdef, state, x, positions, mask):
  """A pure function of the block's state (what jax.checkpoint and lax.scan need)."""
  block = nnx.merge(graphdef, state)
  out, _ = block(x, positions, mask)
  return out, nnx.state(block, nnx.Intermediate)  # MoE routing statistics, if any


def run_blocks(blocks, x_BxTxD, positions_BxT, mask, remat: str = 'none',
               scan: bool = False) -> Array:
  """x through `blocks` in order (no caches), optionally rematerialised and scanned.

  With scan, the per-layer parameters of each run of same-structure blocks
  (_same_structure_runs) are stacked inside the traced computation and one block body is
  scanned over them: the HLO holds one block per run instead of L (compile time on deep
  models; one block's buffers reused layer after layer), while the parameter tree
  (checkpoints, the decoder's per-layer loop) stays a list of blocks whatever remat /
  scan are. MoE statistics leave the scan stacked and go back onto each block.
  """
  policy = remat_policy(remat)

  def block_fn(graphdef, in_scan):
    fn = functools.partial(_apply_block, graphdef)
    # Inside a scan the loop already keeps XLA from merging recomputation with the
    # forward pass, so CSE prevention is not needed there (JAX's advice for scans).
    return fn if policy is None else jax.checkpoint(fn, policy=policy, prevent_cse=not in_scan)

  for run in (_same_structure_runs(blocks) if scan else [[b] for b in blocks]):
    graphdef, state = nnx.split(run[0])
    fn = block_fn(graphdef, len(run) > 1)
    if len(run) == 1:
      x_BxTxD, stats = fn(state, x_BxTxD, positions_BxT, mask)
      nnx.update(run[0], stats)  # out of the pure function onto the block (moe.collect)
      continue
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in run])

    def body(x, state, fn=fn):
      return fn(state, x, positions_BxT, mask)  # the MoE statistics leave stacked, [L, ...]

    x_BxTxD, stats_L = jax.lax.scan(body, x_BxTxD, stacked)
    for i, block in enumerate(run):
      nnx.update(block, jax.tree.map(lambda a, i=i: a[i], stats_L))
  return x_BxTxD


def _same_structure_runs(blocks) -> list[list]:
  """Consecutive blocks of one structure (graphdef), each run scanned on its own: the dense
  first layers of a DeepSeekMoE trunk, then its MoE layers."""
  runs = []
  for block in blocks:
    if runs and nnx.graphdef(block) == nnx.graphdef(runs[-1][0]):
      runs[-1].append(block)
    else:
      runs.append([block])
  return runs


class SharedHead(nnx.Module):
  """DeepSeek-V3's `shared_head`: its own norm; the projection is the shared OutHead."""

  def __init__(self, args: ModelArgs, rngs: nnx.Rngs):
    self.norm = layers.rms_norm(args.d_model, args, rngs)


# Drafts past the model's depth reuse its last MTP module (recursive drafts), up to this many.
MAX_DRAFTS = 8


class SequentialMTP(nnx.Module):
  """One DeepSeek-V3 MTP module: enorm, hnorm, eh_proj, a block, shared_head.norm."""

  chained: ClassVar[bool] = True  # depth k reads h^{k-1} and the token t_(i+k)
  hf_layer: ClassVar[bool] = True  # DeepSeek-V3's MTP layer: the HF layouts hold it
  has_block: ClassVar[bool] = True  # a transformer block of its own (FLOPs: mtp_block)

  @staticmethod
  def max_drafts(depths: int) -> int:
    """The drafts a model of `depths` drafting depths can make: the last module reads its
    own output and runs again (recursive drafts), up to MAX_DRAFTS."""
    return max(MAX_DRAFTS, depths) if depths else 0

  @staticmethod
  def flops_per_token(cfg) -> float:
    """Forward FLOPs per token outside the block and OutHead: eh_proj, 2d -> d."""
    return float(2 * (2 * cfg.d_model) * cfg.d_model)

  def __init__(self, args: ModelArgs, rngs: nnx.Rngs):
    d = args.d_model
    self.enorm = layers.rms_norm(d, args, rngs)
    self.hnorm = layers.rms_norm(d, args, rngs)
    self.eh_proj = nnx.Linear(
        2 * d, d, use_bias=False, dtype=args.dtype,
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, 'embed')),
        rngs=rngs)
    self.block = layers.Block(args, rngs, *block_classes(args, args.n_layers))
    self.shared_head = SharedHead(args, rngs)

  def combine(self, h_prev_BxTxD: Array, emb_BxTxD: Array, decode: bool = False) -> Array:
    """eh_proj([enorm(emb) ; hnorm(h)]): the order of DeepSeek's released weights.

    decode: a decode step (decode_ops.decode_dot's rule, the decode layout's eh_t).
    """
    b, t, d = emb_BxTxD.shape
    x = jnp.concatenate([self.enorm(emb_BxTxD), self.hnorm(h_prev_BxTxD)], axis=-1)
    x = x.reshape(b * t, 2 * d)
    h = (decode_ops.decode_dot(x, self.eh_t[...]) if decode
         else layers.project(x, self.eh_proj.kernel, self.eh_proj.dtype))
    return constrain(h.reshape(b, t, d), ('batch', 'length', 'act_embed'))

  def block_input(self, h_prev_BxTxD: Array, tokens_BxT, embed, decode: bool = False) -> Array:
    """The block's input: combine(h^{k-1}, embed(t_(i+k)))."""
    return self.combine(h_prev_BxTxD, embed(tokens_BxT), decode)

  def prepare_decode(self, layout: str) -> None:
    """The decode layout (decode_ops.DecodeWeight): eh_proj as eh_t [d, 2d], the block's."""
    self.eh_t = decode_ops.DecodeWeight(decode_ops.decode_kernel(self.eh_proj.kernel))
    del self.eh_proj
    self.block.prepare_decode(layout)


class ParallelHead(nnx.Module):
  """An independent block on the trunk's h^0 (Gloeckle et al. 2024), no token input."""

  chained: ClassVar[bool] = False  # every depth reads h^0 only
  hf_layer: ClassVar[bool] = False
  has_block: ClassVar[bool] = True

  @staticmethod
  def max_drafts(depths: int) -> int:
    """One draft per drafting depth: a head never reads another's output."""
    return depths

  @staticmethod
  def flops_per_token(cfg) -> float:
    """No layers outside the block and OutHead."""
    del cfg
    return 0.0

  def __init__(self, args: ModelArgs, rngs: nnx.Rngs):
    self.block = layers.Block(args, rngs, *block_classes(args, args.n_layers))
    self.shared_head = SharedHead(args, rngs)

  def block_input(self, h_prev_BxTxD: Array, tokens_BxT, embed, decode: bool = False) -> Array:
    """The block's input: the trunk's h^0 itself (the caller passes h^0)."""
    del tokens_BxT, embed, decode
    return h_prev_BxTxD

  def prepare_decode(self, layout: str) -> None:
    self.block.prepare_decode(layout)


class TokenOrderHead(nnx.Module):
  """TOP (Zuhri et al. 2025): one extra unembedding U_top [D, V] on the trunk's h^0 after
  the final norm; no block, no token input. Its scores rank the vocabulary by how soon each
  token next appears (train/loss.py: top_targets, top_sums); it predicts no single token,
  so it cannot draft."""

  chained: ClassVar[bool] = False
  hf_layer: ClassVar[bool] = False
  has_block: ClassVar[bool] = False

  @staticmethod
  def max_drafts(depths: int) -> int:
    del depths
    return 0

  @staticmethod
  def flops_per_token(cfg) -> float:
    """Nothing outside OutHead's count: U_top is one more [D, V] product, which flops.py
    counts with the vocab projections (one per depth)."""
    del cfg
    return 0.0

  def __init__(self, args: ModelArgs, rngs: nnx.Rngs):
    init = nnx.with_partitioning(nnx.initializers.normal(args.init_std), ('embed', 'vocab'))
    self.unembed = nnx.Param(init(rngs.params(), (args.d_model, args.vocab_size), args.dtype))

  def block_input(self, h_prev_BxTxD: Array, tokens_BxT, embed, decode: bool = False) -> Array:
    """The head's input: the trunk's h^0 itself (the caller passes h^0)."""
    del tokens_BxT, embed, decode
    return h_prev_BxTxD

  def prepare_decode(self, layout: str) -> None:
    del layout  # never drafts: nothing to lay out


class MTPModel(nnx.Module):
  """Main decoder + M MTP modules sharing one embedding and one output head."""

  def __init__(self, args: ModelArgs, *, rngs: nnx.Rngs):
    # Parameters are placed on devices by jit out_shardings (sharding.py), not eagerly,
    # so the model also builds outside a mesh (tests, notebooks).
    with nnx.use_eager_sharding(False):
      self.args = args
      self.embed = nnx.Embed(
          args.vocab_size, args.d_model, dtype=args.dtype,
          embedding_init=nnx.with_partitioning(
              nnx.initializers.normal(args.init_std), ('vocab', 'embed')), rngs=rngs)
      self.layers = nnx.List([layers.Block(args, rngs, *block_classes(args, i))
                              for i in range(args.n_layers)])
      self.norm = layers.rms_norm(args.d_model, args, rngs)
      if not args.tie_embeddings:
        self.lm_head = nnx.Linear(
            args.d_model, args.vocab_size, use_bias=False, dtype=args.dtype,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ('embed', 'vocab')),
            rngs=rngs)
      head = args.mtp_head()
      self.mtp = nnx.List([head(args, rngs) for _ in range(args.mtp_modules())])

  # -- pieces, also used by the decoder ----------------------------------------------
  def embed_tokens(self, tokens_BxT: Array) -> Array:
    return constrain(self.embed(tokens_BxT), ('batch', 'length', 'act_embed'))

  def head_norm(self, k: int) -> nnx.RMSNorm:
    """The norm before OutHead: the final norm (k = 0) or depth k's shared_head.norm."""
    return self.norm if k == 0 else self.mtp_module(k).shared_head.norm

  def output_kernel(self) -> Array:
    """OutHead as a [D, V] matrix (the embedding transposed when tied)."""
    if self.args.tie_embeddings:
      return self.embed.embedding[...].T
    return self.lm_head.kernel[...]

  def logits(self, h_BxTxD: Array, k: int = 0) -> Array:
    """OutHead(norm_k(h)) in float32: the main head (k = 0) or depth k's."""
    return vocab_logits(self.head_norm(k), h_BxTxD, self.output_kernel())

  def trunk(self, tokens_BxT, positions_BxT, mask_Bx1xTxT) -> Array:
    """h^0: the last block's output, before the final norm."""
    x = self.embed_tokens(tokens_BxT)
    return run_blocks(self.layers, x, positions_BxT, mask_Bx1xTxT, self.args.remat,
                      self.args.scan_layers)

  def mtp_embed(self, tokens_BxT: Array) -> Array:
    """Emb(t_(i+k)) as an MTP input: detached from the shared table under stop_gradient."""
    x = self.embed_tokens(tokens_BxT)
    return jax.lax.stop_gradient(x) if self.args.stop_gradient else x

  def mtp_step(self, k: int, h_prev_BxTxD, tokens_BxT, positions_BxT, mask, cache=None,
               cache_index_B=None):
    """h^k from h^{k-1} (sequential) or h^0 (parallel); tokens_BxT are t_{i+k} at i."""
    module = self.mtp_module(k)
    x = module.block_input(h_prev_BxTxD, tokens_BxT, self.embed_tokens)
    return module.block(x, positions_BxT, mask, cache, cache_index_B)

  # -- the decode path: few-token steps through KV caches (layers.Block.decode) --------
  def for_decoding(self, layout: str) -> MTPModel:
    """A copy of the model in the decode layout (decode_ops.DecodeWeight) for cache `layout`.

    It shares this model's norms and embedding and holds every other matrix transposed
    (O x I, q/k/v and gate/up fused; MLA's and MoE's: their prepare_decode) for
    decode_ops.decode_dot; the 'bskh' layout keeps the
    blocks' kernels (it runs __call__, the library path). The copy runs the decode_*
    methods only: its blocks may lack what __call__ and the training path read.
    """
    model = nnx.merge(*nnx.split(self))  # new modules over the same arrays
    for block in model.layers:
      block.prepare_decode(layout)
    for module in model.mtp:
      module.prepare_decode(layout)
    if not model.args.tie_embeddings:
      model.head_t = decode_ops.DecodeWeight(decode_ops.decode_kernel(model.lm_head.kernel))
      del model.lm_head
    return model

  def trunk_caches(self, batch: int, slots: int, layout: str) -> tuple:
    """Zero caches of the trunk's layers (Block.empty_cache), for decode_trunk."""
    return tuple(block.empty_cache(batch, slots, layout) for block in self.layers)

  def mtp_caches(self, num_drafts: int, batch: int, slots: int, layout: str) -> tuple:
    """Zero caches of drafting depths 1..num_drafts (mtp_module's blocks)."""
    return tuple(self.mtp_module(k).block.empty_cache(batch, slots, layout)
                 for k in range(1, num_drafts + 1))

  def mtp_module(self, k: int):
    """Module of depth k; depths past M reuse the last module (recursive drafts), and under
    share_modules every depth runs the one module."""
    return self.mtp[self.args.module_index(k)]

  def decode_embed(self, tokens_BxT: Array) -> Array:
    """Emb rows in the activations' dtype (gathering first: the table may be bfloat16)."""
    return jnp.take(self.embed.embedding[...], tokens_BxT, axis=0).astype(self.args.dtype)

  def decode_logits(self, h_BTxD: Array, k: int = 0) -> Array:
    """logits(h, k) for a few rows [N, D] (decode_ops.decode_dot's rule), float32.

    The tied head is the embedding table itself, already [V, D] (O x I)."""
    norm = self.norm if k == 0 else self.mtp_module(k).shared_head.norm
    w_VxD = self.embed.embedding[...] if self.args.tie_embeddings else self.head_t[...]
    return decode_ops.decode_dot(norm(h_BTxD), w_VxD).astype(jnp.float32)

  def decode_trunk(self, tokens_BxT, positions_BxT, mask, caches, cache_index_B, layout):
    """h^0 of new tokens through the trunk's per-layer caches; (h, new caches)."""
    x = self.decode_embed(tokens_BxT)
    new = []
    for block, cache in zip(self.layers, caches):
      x, cache = block.decode(x, positions_BxT, mask, cache, cache_index_B, layout)
      new.append(cache)
    return x, tuple(new)

  def decode_mtp_step(self, k: int, h_prev_BxTxD, tokens_BxT, positions_BxT, mask, cache,
                      cache_index_B, layout):
    """mtp_step through a cache (k may exceed M: see mtp_module); (h^k, new cache)."""
    module = self.mtp_module(k)
    x = module.block_input(h_prev_BxTxD, tokens_BxT, self.decode_embed, decode=True)
    return module.block.decode(x, positions_BxT, mask, cache, cache_index_B, layout)

  def __call__(self, tokens_BxT: Array, positions_BxT: Array | None = None,
               segment_ids_BxT: Array | None = None) -> list[Array]:
    """Hidden states [h^0, h^1, ..., h^M], each [B, T, D], for teacher-forced training.

    Sequential depth k reads the true tokens t_{i+a_k} (shifted left by a_k = o_k - 1,
    o_k = k + 1 unless model.mtp.target_offsets says otherwise; strict_leaps:
    ModelArgs.input_offsets; the tail is padding and is masked out by the loss).
    """
    b, t = tokens_BxT.shape[:2]
    if positions_BxT is None:
      positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids_BxT is None:
      segment_ids_BxT = jnp.ones((b, t), jnp.int32)
    mask = attn_lib.training_mask(segment_ids_BxT, attn_lib.attention_impl(self.args))
    h0 = self.trunk(tokens_BxT, positions_BxT, mask)
    hiddens = [h0]
    detach = self.args.detach_trunk or self.args.stop_gradient
    h = jax.lax.stop_gradient(h0) if detach else h0
    if self.args.scan_layers and self.args.mtp_depth > 1 and not self.args.share_modules:
      return hiddens + self._scan_depths(h, tokens_BxT, positions_BxT, mask)
    reads = self.args.input_offsets()
    chained = self.args.mtp_head().chained
    for k in range(1, self.args.mtp_depth + 1):
      module = self.mtp_module(k)  # shared: one module's parameters, its gradient summed
      x = module.block_input(h, shift_left(tokens_BxT, reads[k - 1]), self.mtp_embed)
      if not module.has_block:  # TOP: its head reads h^0 itself
        hiddens.append(x)
        continue
      hk = run_blocks([module.block], x, positions_BxT, mask, self.args.remat)
      hiddens.append(hk)
      h = hk if chained else h
    return hiddens

  def _scan_depths(self, h0, tokens_BxT, positions_BxT, mask) -> list[Array]:
    """[h^1 .. h^M] by one lax.scan over the depths' stacked parameters.

    XLA runs the depths strictly one after another and reuses one depth's buffers for
    the next, so (with remat) step memory stays nearly flat in M; unrolled, XLA:CPU's
    scheduler keeps several depths' recomputed activations alive at once.
    """
    graphdef, _ = nnx.split(self.mtp[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(m) for m in self.mtp])
    chained = self.args.mtp_head().chained
    tokens_MxBxT = jnp.stack([shift_left(tokens_BxT, a) for a in self.args.input_offsets()])

    def body(h, xs):
      state, tokens = xs
      module = nnx.merge(graphdef, state)
      x = module.block_input(h, tokens, self.mtp_embed)
      hk = run_blocks([module.block], x, positions_BxT, mask, self.args.remat)
      return (hk if chained else h), (hk, nnx.state(module, nnx.Intermediate))

    _, (h_MxBxTxD, stats_M) = jax.lax.scan(body, h0, (stacked, tokens_MxBxT))
    for k, module in enumerate(self.mtp):  # the MoE statistics onto each depth (moe.collect)
      nnx.update(module, jax.tree.map(lambda a, k=k: a[k], stats_M))
    return list(h_MxBxTxD)


def count_params(model: nnx.Module) -> dict[str, int]:
  """Parameter counts: total, trunk (embedding, blocks, final norm, head), mtp."""
  state = nnx.state(model, nnx.Param)
  total = sum(x.size for x in jax.tree.leaves(state))
  mtp = sum(x.size for x in jax.tree.leaves(nnx.state(model.mtp, nnx.Param)))
  return {'total': int(total), 'trunk': int(total - mtp), 'mtp': int(mtp)}
