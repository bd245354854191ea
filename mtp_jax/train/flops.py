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

import mtp_jax
from mtp_jax.config.readers import optional
from mtp_jax.data import tokenizers
from mtp_jax.model.args import ModelArgs
from mtp_jax.model.blocks import block_classes
from mtp_jax.runtime import peak as peak_lib


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
  """Forward FLOPs per token by part; `train` = 3 x `forward`."""
  trunk_matmul: float  # L blocks: q, k, v, o projections and the SwiGLU MLP
  trunk_attention: float  # L blocks: scores (q k^T) and weighted values
  mtp_eh_proj: float  # M depths: the head's own layers (sequential: eh_proj, 2d -> d)
  mtp_block: float  # M depths: their block's projections, MLP and attention (TOP: none)
  vocab: float  # (M + 1) [D, V] projections: the main head and one per depth (TOP: U_top)

  @property
  def forward(self) -> float:
    return (self.trunk_matmul + self.trunk_attention + self.mtp_eh_proj + self.mtp_block
            + self.vocab)

  @property
  def train(self) -> float:
    return 3.0 * self.forward

  def train_frozen_trunk(self, mtp_depth: int) -> float:
    """model.mtp.freeze_trunk: the trunk and the main head run forward only; the MTP
    eh_proj and blocks 3x; the M MTP vocab projections 2x (input gradient, frozen OutHead)."""
    mtp_vocab = self.vocab * mtp_depth / (mtp_depth + 1)
    return self.forward + 2.0 * (self.mtp_eh_proj + self.mtp_block) + mtp_vocab

  def as_dict(self) -> dict:
    return {'trunk_matmul': self.trunk_matmul, 'trunk_attention': self.trunk_attention,
            'mtp_eh_proj': self.mtp_eh_proj, 'mtp_block': self.mtp_block, 'vocab': self.vocab,
            'forward': self.forward, 'train': self.train}


def layer_flops(args, layer: int, seq_len: int, causal: bool = True) -> tuple[float, float]:
  """(projections + MLP, attention) forward FLOPs per token of trunk layer `layer`
  (n_layers: the MTP block), each kind's own count (its class's flops_per_token): MoE
  counts only the active experts, the FLOPs a token actually costs."""
  attn_cls, mlp_cls = block_classes(args, layer)
  keys = (seq_len + 1) / 2 if causal else seq_len
  proj, attn = attn_cls.flops_per_token(args, keys)
  return proj + mlp_cls.flops_per_token(args), attn


def flops_per_token(args, seq_len: int, causal: bool = True) -> FlopsPerToken:
  """FLOPs per token of `args` (a model.ModelArgs) on sequences of seq_len tokens.

  Every MTP term is per depth: under model.mtp.share_modules the one module runs at each
  of the M depths, so it costs what M modules cost (its parameters are counted once by
  model.count_params, not here)."""
  per_layer = [layer_flops(args, i, seq_len, causal) for i in range(args.n_layers + 1)]
  mtp_depth = args.mtp_depth
  head = args.mtp_head()
  eh = head.flops_per_token(args)
  return FlopsPerToken(
      trunk_matmul=sum(p for p, _ in per_layer[:-1]),
      trunk_attention=sum(a for _, a in per_layer[:-1]),
      mtp_eh_proj=float(mtp_depth * eh),
      mtp_block=mtp_depth * sum(per_layer[-1]) if head.has_block else 0.0,
      vocab=float((mtp_depth + 1) * 2 * args.d_model * args.vocab_size))


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
                            if optional(config, 'model.mtp.freeze_trunk', False)
                            else per_token.train)
    self.peak_info = peak_lib.job_peak(peak_lib.compute_dtype(config.model.dtype), devices,
                                       probe=probe)
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


def __getattr__(name: str):  # a name an earlier release had here: mtp_jax.MOVED_NAMES
  return mtp_jax.moved_name(__name__, name)
