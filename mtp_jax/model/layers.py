"""Transformer building blocks: RoPE, grouped-query attention, SwiGLU, the pre-norm block.

Parameter names follow Hugging Face's DeepSeek-V3 / Llama layout (input_layernorm,
self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj) so the
MTP layer maps 1:1 onto released weights.
"""
from __future__ import annotations

import functools
import math
from typing import ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import mtp_jax.model.attention as attn_lib
import mtp_jax.model.matmul as matmul
from mtp_jax.config import kinds
from mtp_jax.model.attention import MASKED, attention_impl, blocked_causal_attention
from mtp_jax.model.decode_ops import (
  DecodeWeight,
  decode_dot,
  decode_kernel,
  empty_kv,
  few_query_dot,
  write_cache,
  write_heads_major,
)
from mtp_jax.runtime.sharding import constrain

Array = jax.Array
# Names of activations a remat policy may keep beyond the weight-matmul outputs
# (blocks.remat_policy): each block's two RMSNorm outputs (the q/k/v and gate/up matmuls'
# input) with their row rsqrt and the SwiGLU product (the down projection's input).
NORM_SAVED_NAME = 'block_norm_out'
MLP_SAVED_NAME = 'mlp_hidden'


def _init(initializer, names):
  return nnx.with_partitioning(initializer, names)


def rms_norm(d: int, cfg, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return RMSNorm(d, epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=jnp.float32,
                 scale_init=_init(nnx.initializers.ones, ('norm',)), rngs=rngs)


def rms_normalize_autodiff(x_BTxD: Array, scale_D: Array, eps: float, dtype) -> Array:
  """nnx.RMSNorm's arithmetic: x * (rsqrt(mean(x^2) + eps) * scale), statistics in float32."""
  r_BTx1 = jax.lax.rsqrt(jnp.mean(jnp.square(x_BTxD.astype(jnp.float32)), -1, keepdims=True) + eps)
  return jnp.asarray(x_BTxD * (r_BTx1 * scale_D), dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_normalize_vjp(x_BTxD: Array, scale_D: Array, eps: float, dtype) -> Array:
  """rms_normalize_autodiff with a closed-form backward (residuals: x and the row rsqrt):
  with x_hat = r x and u = scale * dy, dx = r (u - x_hat mean(x_hat u)), dscale = sum(dy x_hat)."""
  return rms_normalize_autodiff(x_BTxD, scale_D, eps, dtype)


def _rms_vjp_fwd(x, scale, eps, dtype):
  r = jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + eps)
  # the row rsqrt [..., 1] is named with the norm's output: a policy that keeps both
  # recomputes nothing of the norm in the backward pass
  return jnp.asarray(x * (r * scale), dtype), (x, checkpoint_name(r, NORM_SAVED_NAME), scale)


def _rms_vjp_bwd(eps, dtype, res, dy):
  x, r, scale = res
  d = x.shape[-1]
  dy = matmul.unfused_cotangent(dy)
  x_hat = x.astype(jnp.float32) * r
  dy, scale32 = dy.astype(jnp.float32), scale.astype(jnp.float32)
  # mean(x_hat * scale * dy) as (x_hat dy) . scale / d, a matrix-vector product: the scale
  # broadcast to [N, D] then never feeds a reduction (XLA:CPU materialised it there)
  xdy_BTxD = (x_hat * dy).reshape(-1, d)
  c = (jnp.dot(xdy_BTxD, scale32, precision=jax.lax.Precision.HIGHEST) / d).reshape(
      x.shape[:-1] + (1,))
  dx = r * (dy * scale32 - x_hat * c)
  return dx.astype(x.dtype), jnp.sum(xdy_BTxD, 0).astype(scale.dtype)


rms_normalize_vjp.defvjp(_rms_vjp_fwd, _rms_vjp_bwd)

# The form every RMSNorm runs (rms_normalize_autodiff: the same values by autodiff). The
# closed form against autodiff, measured in one process: the MaxText-shape
# step (remat block) 0.97-1.00x the time of autodiff at M = 0 / 1 / 3 and 12-16 % less temp
# memory; configs/stdlib_mtp.py (no remat) 0.95-0.99x, 17 % less.
rms_normalize = rms_normalize_vjp


class RMSNorm(nnx.RMSNorm):
  """nnx.RMSNorm (same parameter, same values) over the last axis through rms_normalize."""

  def __call__(self, x, mask=None):
    if mask is not None or self.reduction_axes not in (-1, (-1,)) or self.scale is None:
      return super().__call__(x, mask)
    x, scale = self.promote_dtype((x, self.scale[...]), dtype=self.dtype)
    return rms_normalize(x, scale, self.epsilon, self.dtype)


def project(x_BTxI: Array, kernel, dtype, in_dims: int = 1) -> Array:
  """x @ kernel with the kernel's first `in_dims` axes contracted, as one 2-D matmul.

  Activations are flattened to [B*T, features] for every projection: XLA:CPU runs a
  plain 2-D matmul (and its two backward matmuls) ~1.5x faster than the same einsum
  over [B, T, ...] with two contracting dims in the weight gradient; on GPU/TPU it is
  the same HLO dot. Parameters keep their [in..., out...] shapes (checkpoints and
  per-axis sharding names unchanged). The product is matmul.matmul's (bfloat16 on CPU:
  the bf16-kernel form, forward and backward).
  """
  w = kernel[...]
  w_IxO = w.reshape(math.prod(w.shape[:in_dims]), -1)
  return matmul.matmul(x_BTxI, w_IxO, dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: tuple = ()) -> Array:
  """[head_dim / 2] rotation frequencies: theta ** (-2i / head_dim), then `scaling`.

  scaling: () none; ('linear', factor) positions divided by factor (Hugging Face's
  'linear'); ('llama3', factor, low_freq_factor, high_freq_factor, original_max_positions):
  Llama 3.1's rule: wavelengths longer than original / low_freq_factor are stretched by
  factor, shorter than original / high_freq_factor kept, and the band between blended
  (transformers' _compute_llama3_parameters, the formula of Meta's release).
  """
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if not scaling:
    return inv_freq
  if scaling[0] == 'linear':
    return inv_freq / scaling[1]
  if scaling[0] == 'llama3':
    _, factor, low, high, original = scaling
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return jnp.where(wavelen > original / low, inv_freq / factor,
                     jnp.where(wavelen < original / high, inv_freq, blended))
  raise ValueError(f'unknown RoPE scaling {scaling[0]!r}')


def apply_rope(x_BxTxNxH: Array, positions_BxT: Array, theta: float,
               scaling: tuple = (), swap_by_matmul: bool = False) -> Array:
  """Rotary embedding (rotate-half form) at the given integer positions (see rope_inv_freq).

  swap_by_matmul: the two halves of each head swapped by a product with an [H, H]
  permutation matrix instead of by slices and a concatenation. The values are the same
  bit for bit (each output is one input times 1, summed in float32 at full precision),
  and the whole head stays one full-width elementwise pass. On TPU (ROPE_MATMUL_CORES)
  the half-width slices are what a step pays for: 40 ms of the 1B pod step
  (docs/scaling.md), against a product the matrix unit does on the side; on CPU the
  product costs more than the slices.
  """
  h = x_BxTxNxH.shape[-1]
  inv_freq = rope_inv_freq(h, theta, scaling)
  angles_BxTxF = positions_BxT[..., None].astype(jnp.float32) * inv_freq
  sin = jnp.sin(angles_BxTxF)[:, :, None, :]
  cos = jnp.cos(angles_BxTxF)[:, :, None, :]
  if not swap_by_matmul:
    x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxH.dtype)
  swap_HxH = np.roll(np.eye(h, dtype=np.float32), h // 2, axis=0)  # [x1, x2] -> [x2, x1]
  swapped = jnp.einsum('btnh,hg->btng', x_BxTxNxH, jnp.asarray(swap_HxH, x_BxTxNxH.dtype),
                       precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  out = (x_BxTxNxH.astype(jnp.float32) * jnp.concatenate([cos, cos], axis=-1)
         + swapped * jnp.concatenate([-sin, sin], axis=-1))
  return out.astype(x_BxTxNxH.dtype)


# The attention cores whose layers swap RoPE's halves by a matmul (apply_rope): TPU's.
ROPE_MATMUL_CORES = ('splash',)


class Attention(nnx.Module):
  """Causal grouped-query attention with RoPE; optional per-row KV cache."""

  # config/kinds.py's entry: heads head_dim wide; its RoPE follows model.rope_scaling
  # (rope_inv_freq); model.attention_bias adds q/k/v biases
  facts: ClassVar[kinds.AttentionFacts] = kinds.ATTENTION['gqa']

  def __init__(self, cfg, rngs: nnx.Rngs):
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    init = nnx.initializers.lecun_normal()
    dt = cfg.dtype
    # q/k/v biases (Qwen2; model.attention_bias): a `bias` [heads, head_dim] on each of
    # the three projections, none (no parameter at all) otherwise.
    bias = getattr(cfg, 'attention_bias', False)

    def qkv(spec, heads_axis, heads):
      return nnx.Einsum(spec, (d, heads, h), (heads, h) if bias else None, dtype=dt,
                        kernel_init=_init(init, ('embed', heads_axis, 'head_dim')),
                        bias_init=_init(nnx.initializers.zeros, (heads_axis, 'head_dim')),
                        rngs=rngs)

    self.q_proj = qkv('btd,dnh->btnh', 'heads', n)
    self.k_proj = qkv('btd,dkh->btkh', 'kv_heads', k)
    self.v_proj = qkv('btd,dkh->btkh', 'kv_heads', k)
    self.o_proj = nnx.Einsum('btnh,nhd->btd', (n, h, d), dtype=dt,
                             kernel_init=_init(init, ('heads', 'head_dim', 'embed')), rngs=rngs)
    self.rope_theta = cfg.rope_theta
    self.rope_scaling = tuple(getattr(cfg, 'rope_scaling', ()))  # rope_inv_freq's form
    self.dtype = dt
    self.softmax_scale = self.facts.softmax_scale(cfg)  # 1 / sqrt(head_dim), every core's
    self.cache_heads = (k, h)  # (KV heads, head_dim) of empty_cache
    self.impl = attention_impl(cfg)  # resolved at build time: the backend is known by then
    self.block = getattr(cfg, 'attention_block', 64)
    self.kernel_blocks = (getattr(cfg, 'attention_block_q', 512),
                          getattr(cfg, 'attention_block_kv', 512))  # the splash kernel's
    # the custom-VJP core where its residuals are saved (remat block and the policies that
    # keep more: see blocked_causal_attention)
    self.saved_core = getattr(cfg, 'remat', 'none').startswith('block')

  @staticmethod
  def flops_per_token(cfg, keys: float) -> tuple[float, float]:
    """Forward FLOPs per token (2 per multiply-add): (the q, k, v and o projections, the
    scores q k^T and weighted values over `keys` keys on average per query)."""
    d, n, kv, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    proj = 2 * d * n * h + 2 * 2 * d * kv * h + 2 * n * h * d
    return float(proj), float(2 * 2 * n * h * keys)

  def rope(self, x_BxTxNxH, positions_BxT):
    """apply_rope with this layer's theta and scaling."""
    return apply_rope(x_BxTxNxH, positions_BxT, self.rope_theta, self.rope_scaling,
                      self.impl in ROPE_MATMUL_CORES)

  def __call__(self, x_BxTxD, positions_BxT, mask_Bx1xTxS, cache=None, cache_index_B=None):
    """Attention over x (cache=None) or over a cache the new keys are written into.

    cache: (k_BxSxKxH, v_BxSxKxH); the T new keys/values of row b land at
    cache_index_B[b] .. +T, and mask_Bx1xTxS says which cache slots each query sees.
    Without a cache the mask is attn_lib.training_mask's: the [B, T] segment ids for the
    kernel cores (splash, triton), else the dense [B, 1, T, T] mask.
    Returns (out_BxTxD, new_cache or None).
    """
    b, t, _ = x_BxTxD.shape
    x_BTxD = x_BxTxD.reshape(b * t, -1)

    def heads(proj):  # [B*T, N*H] -> [B, T, N, H]
      out = project(x_BTxD, proj.kernel, self.dtype).reshape(b, t, *proj.kernel.shape[1:])
      return out if proj.bias is None else out + proj.bias[...].astype(out.dtype)

    q = self.rope(heads(self.q_proj), positions_BxT)
    k = self.rope(heads(self.k_proj), positions_BxT)
    v = heads(self.v_proj)
    q = constrain(q, ('batch', 'length', 'act_heads', None))
    if cache is not None:
      k = write_cache(cache[0], k, cache_index_B)
      v = write_cache(cache[1], v, cache_index_B)
      cache = (k, v)
    if attn_lib.no_cache_context_parallel(cache):  # the sequence split over context axes
      out = attn_lib.context_attention(self.impl, q, k, v, mask_Bx1xTxS, self.softmax_scale,
                                       *self.kernel_blocks)
    elif cache is None and self.impl in attn_lib.SEGMENT_CORES:  # the Pallas kernels
      out = attn_lib.kernel_attention(self.impl, q, k, v, mask_Bx1xTxS,
                                      self.softmax_scale, *self.kernel_blocks)
    elif cache is None and self.impl == 'blocked':  # training / no cache: self-attention, causal
      out = blocked_causal_attention(q, k, v, attn_lib.dense_mask(mask_Bx1xTxS), self.block,
                                     self.saved_core, self.softmax_scale)
    else:
      out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype),
                                         mask=attn_lib.dense_mask(mask_Bx1xTxS),
                                         scale=self.softmax_scale)
    out = constrain(out, ('batch', 'length', 'act_heads', None))
    o_BTxD = project(out.reshape(b * t, -1), self.o_proj.kernel, self.dtype, in_dims=2)
    return o_BTxD.reshape(b, t, -1), cache


  def empty_cache(self, batch: int, slots: int, layout: str) -> tuple:
    """(k, v): this layer's zero KV cache of `slots` positions in `layout` (CACHE_LAYOUTS)."""
    return empty_kv(batch, slots, *self.cache_heads, self.dtype, layout)

  def prepare_decode(self) -> None:
    """The decode layout (see DecodeWeight): [q; k; v] as one [(N + 2K) H, D] matrix
    (and their biases as one [(N + 2K) H] vector, if any), o as [D, N H]. The projections
    are dropped: the module then runs `decode` only."""
    d, n, h = self.q_proj.kernel.shape
    self.decode_heads = (n, self.k_proj.kernel.shape[1], h)
    self.qkv_t = DecodeWeight(jnp.concatenate(
        [decode_kernel(p.kernel) for p in (self.q_proj, self.k_proj, self.v_proj)], 0))
    self.o_t = DecodeWeight(decode_kernel(self.o_proj.kernel, in_dims=2))
    projs = (self.q_proj, self.k_proj, self.v_proj)
    self.qkv_bias = (None if projs[0].bias is None else DecodeWeight(
        jnp.concatenate([p.bias[...].reshape(-1) for p in projs], 0)))
    del self.q_proj, self.k_proj, self.v_proj, self.o_proj

  def decode(self, x_BxTxD, positions_BxT, mask_Bx1xTxS, cache, cache_index_B):
    """Attention of T new tokens over a 'heads_major' cache (see CACHE_LAYOUTS), with the
    decode layout's weights (prepare_decode). Returns (out_BxTxD, new cache)."""
    b, t, d = x_BxTxD.shape
    dt = x_BxTxD.dtype
    n, kv, hd = self.decode_heads
    g = n // kv
    qkv = decode_dot(x_BxTxD.reshape(b * t, d), self.qkv_t[...])
    if self.qkv_bias is not None:  # Qwen2's q/k/v biases (model.attention_bias)
      qkv = qkv + self.qkv_bias[...].astype(qkv.dtype)
    q = self.rope(qkv[:, :n * hd].reshape(b, t, n, hd), positions_BxT)
    k = self.rope(qkv[:, n * hd:(n + kv) * hd].reshape(b, t, kv, hd), positions_BxT)
    v = qkv[:, (n + kv) * hd:].reshape(b, t, kv, hd)
    k_cache = write_heads_major(cache[0], k.transpose(0, 2, 1, 3), cache_index_B, axis=1)
    v_cache = write_heads_major(cache[1], v.transpose(0, 2, 3, 1), cache_index_B, axis=2)
    # queries of one KV head: [B*K, G*T, H] (query head n = kv_head * G + g, as in GQA)
    q = q.reshape(b, t, kv, g, hd).transpose(0, 2, 3, 1, 4).reshape(b * kv, g * t, hd)
    scores = few_query_dot(q, k_cache.astype(dt), jnp.float32) * self.softmax_scale
    mask = jnp.broadcast_to(mask_Bx1xTxS[:, None], (b, kv, g, t, scores.shape[-1]))
    # Masked scores get a large finite negative: a query that sees nothing (a position
    # before 0 in an MTP window) averages finite values, never NaN.
    scores = jnp.where(mask.reshape(scores.shape), scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = few_query_dot(probs, v_cache.astype(dt), dt)  # [B*K, G*T, H]
    out = out.reshape(b, kv, g, t, hd).transpose(0, 3, 1, 2, 4).reshape(b * t, n * hd)
    return decode_dot(out, self.o_t[...]).reshape(b, t, d), (k_cache, v_cache)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  @staticmethod
  def flops_per_token(cfg) -> float:
    """Forward FLOPs per token: the gate, up and down projections."""
    return float(3 * 2 * cfg.d_model * cfg.mlp_dim)

  def __init__(self, cfg, rngs: nnx.Rngs):
    d, f, dt = cfg.d_model, cfg.mlp_dim, cfg.dtype
    init = nnx.initializers.lecun_normal()
    self.gate_proj = nnx.Linear(d, f, use_bias=False, dtype=dt,
                                kernel_init=_init(init, ('embed', 'mlp')), rngs=rngs)
    self.up_proj = nnx.Linear(d, f, use_bias=False, dtype=dt,
                              kernel_init=_init(init, ('embed', 'mlp')), rngs=rngs)
    self.down_proj = nnx.Linear(f, d, use_bias=False, dtype=dt,
                                kernel_init=_init(init, ('mlp', 'embed')), rngs=rngs)
    self.dtype = dt

  def __call__(self, x_BxTxD):
    b, t, _ = x_BxTxD.shape
    x_BTxD = x_BxTxD.reshape(b * t, -1)
    h_BTxF = (jax.nn.silu(project(x_BTxD, self.gate_proj.kernel, self.dtype))
              * project(x_BTxD, self.up_proj.kernel, self.dtype))
    h_BTxF = checkpoint_name(constrain(h_BTxF, ('batch', 'act_mlp')), MLP_SAVED_NAME)
    return project(h_BTxF, self.down_proj.kernel, self.dtype).reshape(b, t, -1)


  def prepare_decode(self) -> None:
    """The decode layout (see DecodeWeight): [gate; up] as one [2F, D] matrix, down as
    [D, F]. The projections are dropped: the module then runs `decode` only."""
    self.decode_mlp_dim = self.gate_proj.kernel.shape[1]
    self.gate_up_t = DecodeWeight(jnp.concatenate(
        [decode_kernel(self.gate_proj.kernel), decode_kernel(self.up_proj.kernel)], 0))
    self.down_t = DecodeWeight(decode_kernel(self.down_proj.kernel))
    del self.gate_proj, self.up_proj, self.down_proj

  def decode(self, x_BxTxD):
    """__call__ for a decode step, with the decode layout's weights (prepare_decode)."""
    b, t, d = x_BxTxD.shape
    f = self.decode_mlp_dim
    gu_BTx2F = decode_dot(x_BxTxD.reshape(b * t, d), self.gate_up_t[...])
    h_BTxF = jax.nn.silu(gu_BTx2F[:, :f]) * gu_BTx2F[:, f:]
    return decode_dot(h_BTxF, self.down_t[...]).reshape(b, t, d)


class AttentionKind(Protocol):
  """What Block and its callers need of an attention class (Attention, mla.MLAttention).
  config/kinds.py's ATTENTION names each by its config value (model.attention) with its
  facts (head widths, RoPE scaling, q/k/v biases, export layouts), which the class holds
  as `facts`: the config checks read the same entry before JAX starts."""

  facts: ClassVar[kinds.AttentionFacts]  # its config/kinds.py entry
  softmax_scale: float  # the scale of q k^T, facts.softmax_scale: every core and decode use it

  def __init__(self, cfg, rngs: nnx.Rngs): ...

  def __call__(self, x_BxTxD, positions_BxT, mask_Bx1xTxS, cache=None,
               cache_index_B=None) -> tuple: ...

  def empty_cache(self, batch: int, slots: int, layout: str) -> tuple: ...

  def prepare_decode(self) -> None: ...

  def decode(self, x_BxTxD, positions_BxT, mask_Bx1xTxS, cache, cache_index_B) -> tuple: ...

  @staticmethod
  def flops_per_token(cfg, keys: float) -> tuple[float, float]: ...


class MLPKind(Protocol):
  """What Block and its callers need of an MLP class (MLP, moe.MoE; mtp.MLP_KINDS)."""

  def __init__(self, cfg, rngs: nnx.Rngs): ...

  def __call__(self, x_BxTxD): ...

  def prepare_decode(self) -> None: ...

  def decode(self, x_BxTxD): ...

  @staticmethod
  def flops_per_token(cfg) -> float: ...


class Block(nnx.Module):
  """Pre-norm decoder block: x + Attn(RMSNorm(x)), then x + MLP(RMSNorm(x)).

  attention_cls / mlp_cls: classes of the AttentionKind / MLPKind protocols (mla.MLAttention,
  moe.MoE), chosen per layer by blocks.block_classes; they bring their own decode path
  (prepare_decode / decode), FLOP count and, the attention, its own cache (empty_cache).
  """

  def __init__(self, cfg, rngs: nnx.Rngs, attention_cls: type[AttentionKind] | None = None,
               mlp_cls: type[MLPKind] | None = None):
    self.input_layernorm = rms_norm(cfg.d_model, cfg, rngs)
    self.self_attn = (attention_cls or Attention)(cfg, rngs)
    self.post_attention_layernorm = rms_norm(cfg.d_model, cfg, rngs)
    self.mlp = (mlp_cls or MLP)(cfg, rngs)

  def __call__(self, x_BxTxD, positions_BxT, mask_Bx1xTxS, cache=None, cache_index_B=None):
    normed = lambda h: checkpoint_name(h, NORM_SAVED_NAME)  # noqa: E731
    a, cache = self.self_attn(normed(self.input_layernorm(x_BxTxD)), positions_BxT,
                              mask_Bx1xTxS, cache, cache_index_B)
    x = x_BxTxD + a
    x = x + self.mlp(normed(self.post_attention_layernorm(x)))
    return constrain(x, ('batch', 'length', 'act_embed')), cache

  def empty_cache(self, batch: int, slots: int, layout: str) -> tuple:
    """This block's zero cache for `layout`: its attention's (GQA k / v, MLA's latent)."""
    return self.self_attn.empty_cache(batch, slots, layout)

  def prepare_decode(self, layout: str) -> None:
    """The decode layout's weights for `layout` (CACHE_LAYOUTS): 'heads_major' runs the
    layers' `decode` (prepare_decode of each); 'bskh' runs __call__ and keeps its kernels."""
    if layout != 'bskh':
      self.self_attn.prepare_decode()
      self.mlp.prepare_decode()

  def decode(self, x_BxTxD, positions_BxT, mask_Bx1xTxS, cache, cache_index_B,
             layout: str = 'heads_major'):
    """__call__ through a KV cache of `layout` (CACHE_LAYOUTS); (x, new cache).

    heads_major needs prepare_decode('heads_major') first."""
    if layout == 'bskh':  # the library path: __call__ itself
      return self(x_BxTxD, positions_BxT, mask_Bx1xTxS, cache, cache_index_B)
    a, cache = self.self_attn.decode(self.input_layernorm(x_BxTxD), positions_BxT,
                                     mask_Bx1xTxS, cache, cache_index_B)
    x = x_BxTxD + a
    return x + self.mlp.decode(self.post_attention_layernorm(x)), cache
