"""The MTP head kinds (config/kinds.py's MTP_HEADS) and the output head they share.

Sequential (DeepSeek-V3) depth k at position i:
  h'^k_i = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)])
  h^k    = block_k(h'^k)              causal, RoPE at the original positions i
  P^k    = OutHead(shared_head.norm(h^k_i))     distribution of t_{i+k+1}
Parallel heads (ablation): h^k = block_k(h^0), no token input, no chain.
Token order prediction (TOP, Zuhri et al. 2025): no block; one extra unembedding
U_top [D, V] scores every token on the trunk's normed h^0 (train/loss.py's top_sums).
Each class says what it is (chained, has_block, hf_layer, max_drafts, flops_per_token);
the model, the decoder and the FLOP count read that, never the kind's name.
"""
from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

import mtp_jax.model.decode_ops as decode_ops
import mtp_jax.model.layers as layers
import mtp_jax.model.matmul as matmul
from mtp_jax.model.args import ModelArgs
from mtp_jax.model.blocks import block_classes
from mtp_jax.runtime.sharding import constrain

Array = jax.Array


def vocab_logits(norm, h_BxTxD: Array, w_DxV: Array) -> Array:
  """float32 logits [B, T, V] of norm(h) @ w as one 2-D matmul (see layers.project)."""
  b, t, d = h_BxTxD.shape
  x_BTxD = norm(h_BxTxD).reshape(b * t, d)
  return matmul.matmul(x_BTxD, w_DxV, x_BTxD.dtype, jnp.float32).reshape(b, t, -1)


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
    # float32 as every parameter (the optimizer's updates are float32); args.dtype computes
    self.unembed = nnx.Param(init(rngs.params(), (args.d_model, args.vocab_size), jnp.float32))

  def block_input(self, h_prev_BxTxD: Array, tokens_BxT, embed, decode: bool = False) -> Array:
    """The head's input: the trunk's h^0 itself (the caller passes h^0)."""
    del tokens_BxT, embed, decode
    return h_prev_BxTxD

  def prepare_decode(self, layout: str) -> None:
    del layout  # never drafts: nothing to lay out
