"""Model FLOPs per token, and MFU: those FLOPs x tokens/s over the peak FLOP/s.

Counts matmul FLOPs only (2 per multiply-add): norms, RoPE, softmax and the optimizer
are left out, as in PaLM's MFU. Unlike MaxText's count, every MTP depth contributes
its `eh_proj`, its block **and** its vocab projection (the shared OutHead is applied
once per depth). A training token costs 3x the forward pass (backward = 2x forward);
rematerialisation is not counted (this is MFU, not hardware FLOPs utilisation).

Attention scores and values are counted causally: query i attends i + 1 keys, so a
sequence of T tokens averages (T + 1) / 2 keys per query (what a causal kernel has to
compute; `causal=False` counts the full T x T as PaLM's appendix does).

`MFU` divides by the job's peak FLOP/s from runtime/peak.py.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mtp_jax import config_lib
from mtp_jax.data import tokenizers
from mtp_jax.model import mla
from mtp_jax.model import moe
from mtp_jax.model.mtp import ModelArgs, block_classes
from mtp_jax.runtime import peak as peak_lib


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
  """Forward FLOPs per token by part; `train` = 3 x `forward`."""
  trunk_matmul: float  # L blocks: q, k, v, o projections and the SwiGLU MLP
  trunk_attention: float  # L blocks: scores (q k^T) and weighted values
  mtp_eh_proj: float  # D sequential depths: M_k, 2d -> d
  mtp_block: float  # D depths: their block's projections, MLP and attention
  vocab: float  # (D + 1) OutHead projections: the main head and one per depth

  @property
  def forward(self) -> float:
    return (self.trunk_matmul + self.trunk_attention + self.mtp_eh_proj + self.mtp_block
            + self.vocab)

  @property
  def train(self) -> float:
    return 3.0 * self.forward

  def train_frozen_trunk(self, depth: int) -> float:
    """model.mtp.freeze_trunk: the trunk and the main head run forward only; the MTP
    eh_proj and blocks 3x; the D MTP vocab projections 2x (input gradient, frozen OutHead)."""
    mtp_vocab = self.vocab * depth / (depth + 1)
    return self.forward + 2.0 * (self.mtp_eh_proj + self.mtp_block) + mtp_vocab

  def as_dict(self) -> dict:
    return {'trunk_matmul': self.trunk_matmul, 'trunk_attention': self.trunk_attention,
            'mtp_eh_proj': self.mtp_eh_proj, 'mtp_block': self.mtp_block, 'vocab': self.vocab,
            'forward': self.forward, 'train': self.train}


def block_flops(d: int, n_heads: int, n_kv_heads: int, head_dim: int, mlp_dim: int,
                seq_len: int, causal: bool = True) -> tuple[float, float]:
  """(projection + MLP, attention) forward FLOPs per token of one decoder block."""
  q = 2 * d * n_heads * head_dim
  kv = 2 * 2 * d * n_kv_heads * head_dim
  o = 2 * n_heads * head_dim * d
  mlp = 3 * 2 * d * mlp_dim  # gate, up, down
  keys = (seq_len + 1) / 2 if causal else seq_len
  attn = 2 * 2 * n_heads * head_dim * keys  # q k^T and p v, per query head
  return float(q + kv + o + mlp), float(attn)


def layer_flops(args, layer: int, seq_len: int, causal: bool = True) -> tuple[float, float]:
  """block_flops of trunk layer `layer` (n_layers: the MTP block) by its kinds.

  MLA: the q (latent or direct), kv_a, kv_b and o projections, scores over dn + dr and
  values over dv. MoE: only the active experts (router, K routed + the shared SwiGLUs),
  the FLOPs a token actually costs, not the parameters it could reach.
  """
  attn_cls, mlp_cls = block_classes(args, layer)
  d, n = args.d_model, args.n_heads
  proj, attn = block_flops(d, n, args.n_kv_heads, args.head_dim, args.mlp_dim, seq_len, causal)
  keys = (seq_len + 1) / 2 if causal else seq_len
  if attn_cls is mla.MLAttention:
    qr, kvr = args.q_lora_rank, args.kv_lora_rank
    dn, dr, dv = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    q = 2 * d * qr + 2 * qr * n * (dn + dr) if qr else 2 * d * n * (dn + dr)
    kv = 2 * d * (kvr + dr) + 2 * kvr * n * (dn + dv)
    proj = proj - 2 * d * n * args.head_dim * 2 - 2 * 2 * d * args.n_kv_heads * args.head_dim
    proj += q + kv + 2 * n * dv * d
    attn = 2 * n * (dn + dr) * keys + 2 * n * dv * keys
  if mlp_cls is moe.MoE:
    f = args.moe_intermediate_size
    proj = proj - 3 * 2 * d * args.mlp_dim + 2 * d * args.n_routed_experts
    proj += 3 * 2 * d * f * (args.num_experts_per_tok + args.n_shared_experts)
  return float(proj), float(attn)


def flops_per_token(args, seq_len: int, causal: bool = True) -> FlopsPerToken:
  """FLOPs per token of `args` (a model.ModelArgs) on sequences of seq_len tokens."""
  per_layer = [layer_flops(args, i, seq_len, causal) for i in range(args.n_layers + 1)]
  depth = args.mtp_depth
  eh = 2 * (2 * args.d_model) * args.d_model if args.mtp_kind == 'sequential' else 0
  return FlopsPerToken(
      trunk_matmul=sum(p for p, _ in per_layer[:-1]),
      trunk_attention=sum(a for _, a in per_layer[:-1]),
      mtp_eh_proj=float(depth * eh),
      mtp_block=depth * sum(per_layer[-1]),
      vocab=float((depth + 1) * 2 * args.d_model * args.vocab_size))


def config_flops_per_token(config, causal: bool = True) -> FlopsPerToken:
  args = ModelArgs.from_config(config, tokenizers.model_vocab_size(config))
  return flops_per_token(args, config.data.seq_len, causal)


class MFU:
  """perf/mfu of a run: model FLOPs per token x tokens/s over the job's peak FLOP/s.

  The peak is runtime/peak.py's `job_peak` (CPU: the cache, checked against a quick probe
  at start). perf/mfu never exceeds 1: a window whose achieved FLOP/s beat the peak raises
  it (and the cache) and says so once through `notify`. The first metrics (and those after
  a raise) carry the peak used (perf/peak_*).
  """

  def __init__(self, config, devices=None, notify=None, probe: bool = True):
    per_token = config_flops_per_token(config)
    self.flops_per_token = (per_token.train_frozen_trunk(config.model.mtp.depth)
                            if config_lib.optional(config, 'model.mtp.freeze_trunk', False)
                            else per_token.train)
    self.peak_info = peak_lib.job_peak(jnp.dtype(config.model.dtype), devices, probe=probe)
    self.notify = notify
    self._report = True  # the peak goes into the next metrics row

  @property
  def peak(self) -> float:
    return self.peak_info.flops

  def metrics(self, tokens_per_sec: float) -> dict:
    before = self.peak
    out = {'perf/mfu': self.peak_info.check(self.flops_per_token * tokens_per_sec,
                                            self.notify, 'this run')}
    if self._report or self.peak != before:
      out.update(self.peak_info.as_metrics())
      out['perf/model_flops_per_token'] = float(self.flops_per_token)
      self._report = False
    return out

  def describe(self) -> str:
    """The console's peak line."""
    return self.peak_info.line()
