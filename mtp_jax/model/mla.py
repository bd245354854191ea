"""Multi-head Latent Attention (DeepSeek-V2 / V3), an attention option of the blocks.

Per token (DeepSeek-V3 report, eqs. 1-11), with d the model width and n heads:
  c_q   = q_a_layernorm(x W_qa)            [q_lora_rank]    (q_lora_rank = 0: no c_q,
  q     = c_q W_qb                         [n, dn + dr]      q = x W_q, named q_proj)
  [c_kv ; k_r] = x W_kva                   [kv_lora_rank + dr]  (kv_a_proj_with_mqa)
  [k_n ; v]    = kv_a_layernorm(c_kv) W_kvb   [n, dn + dv]
  q = [q_n ; RoPE(q_r)],  k = [k_n ; RoPE(k_r) shared by every head]
  o = softmax(q k^T / sqrt(dn + dr)) v,  out = o W_o
with dn = qk_nope_head_dim, dr = qk_rope_head_dim (decoupled RoPE: only those dims
rotate, and their key is one per token, as in multi-query attention), dv = v_head_dim.

Parameter names are Hugging Face's DeepSeek-V3 ones under `self_attn`. The rotary dims
use this package's rotate-half RoPE (layers.apply_rope); DeepSeek's released weights use
the interleaved-pair form, so interop/layouts.py permutes the rotary rows of q_b_proj / q_proj and
kv_a_proj_with_mqa on import and export (layouts.rope_to_half / rope_to_pairs).

Cached decoding (DeepSeek-V2 section 2.1.2, "absorbed" form) keeps per position only
what MLA compresses into: the latent [kv_a_layernorm(c_kv) ; RoPE(k_r)], kv_lora_rank +
qk_rope_head_dim numbers per layer (GQA keeps 2 K H). The up-projections move to the
query and output side: with W_kb, W_vb the k_n and v parts of kv_b_proj,
  q_lat_n = W_kb_n q_n                     per head, into latent space [kv_lora_rank]
  score(n, s) = ([q_lat_n ; RoPE(q_r)_n] . latent_s) / sqrt(dn + dr)
             = (q_n . k_n,s + RoPE(q_r)_n . RoPE(k_r)_s) / sqrt(dn + dr)
  out = sum_n (sum_s p_n,s c_kv_s) W_vb_n W_o_n
so no per-head key or value is ever formed (latent_attention). The output side is
either one absorbed [n kv_lora_rank -> d] matrix (W_vb_n W_o_n stacked) or the two steps
W_vb then o_proj, whichever holds fewer numbers (MLAttention.prepare_decode): a decode
step reads every weight once, and for DeepSeek-V3's widths (kv_lora_rank 512 > v_head_dim
128) the absorbed matrix would be 3.7x larger than the two.
"""
from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

import mtp_jax.model.attention as attn_lib
import mtp_jax.model.decode_ops as decode_ops
import mtp_jax.model.layers as layers
from mtp_jax.config import kinds
from mtp_jax.runtime.sharding import constrain

Array = jax.Array


def _init(names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


def _pad_last(x: Array, width: int) -> Array:
  pad = width - x.shape[-1]
  return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def attention_core(q_BxTxNxH, k_BxSxNxH, v_BxSxNxHv, mask_Bx1xTxS, scale: float,
                   impl: str = 'xla', kernel_blocks: tuple = (512, 512)) -> Array:
  """softmax(q k^T * scale) v by core `impl` (attn_lib.attention_impl), as layers.Attention.

  MLA's value width dv may differ from its query/key width dn + dr (DeepSeek-V3: 128
  against 192). The splash kernel takes v at its own width; the Triton kernel pads v to
  the query width (attn_lib.kernel_attention). jax.nn.dot_product_attention and the
  blocked core need one head width for q, k and v, so there all three are zero-padded
  to the larger one (zeros change no dot product, and the padded output columns are 0
  and sliced off). mask_Bx1xTxS: attn_lib.training_mask's (segment ids for the kernels).
  """
  if attn_lib.context_lib.active() is not None:  # the sequence split over context axes
    return attn_lib.context_attention(impl, q_BxTxNxH, k_BxSxNxH, v_BxSxNxHv, mask_Bx1xTxS,
                                      scale, *kernel_blocks)
  if impl in attn_lib.SEGMENT_CORES:
    return attn_lib.kernel_attention(impl, q_BxTxNxH, k_BxSxNxH, v_BxSxNxHv, mask_Bx1xTxS,
                                     scale, *kernel_blocks)
  width = max(q_BxTxNxH.shape[-1], v_BxSxNxHv.shape[-1])
  out = jax.nn.dot_product_attention(
      _pad_last(q_BxTxNxH, width), _pad_last(k_BxSxNxH, width).astype(q_BxTxNxH.dtype),
      _pad_last(v_BxSxNxHv, width).astype(q_BxTxNxH.dtype),
      mask=attn_lib.dense_mask(mask_Bx1xTxS), scale=scale)
  return out[..., :v_BxSxNxHv.shape[-1]]


class MLAttention(nnx.Module):
  """Causal multi-head latent attention; the call signature of layers.Attention.

  Its cache (empty_cache) is the latent only, one [B, S, kv_lora_rank + qk_rope_head_dim]
  array per layer, the same in both decode_ops.CACHE_LAYOUTS: 'bskh' runs __call__ with the
  training kernels and 'heads_major' runs `decode` with the decode layout
  (prepare_decode); both are the absorbed-latent path (latent_attention).
  """

  # config/kinds.py's entry: q/k heads dn + dr wide, values dv; its decoupled RoPE keeps
  # the unscaled frequencies; no q/k/v biases
  facts: ClassVar[kinds.AttentionFacts] = kinds.ATTENTION['mla']

  def __init__(self, cfg, rngs: nnx.Rngs):
    d, n = cfg.d_model, cfg.n_heads
    qr, kvr = cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    dt = cfg.dtype
    if qr:
      self.q_a_proj = nnx.Linear(d, qr, use_bias=False, dtype=dt,
                                 kernel_init=_init(('embed', 'latent')), rngs=rngs)
      self.q_a_layernorm = layers.rms_norm(qr, cfg, rngs)
      self.q_b_proj = nnx.Einsum('btr,rnh->btnh', (qr, n, dn + dr), dtype=dt,
                                 kernel_init=_init(('latent', 'heads', 'head_dim')), rngs=rngs)
    else:
      self.q_proj = nnx.Einsum('btd,dnh->btnh', (d, n, dn + dr), dtype=dt,
                               kernel_init=_init(('embed', 'heads', 'head_dim')), rngs=rngs)
    self.kv_a_proj_with_mqa = nnx.Linear(d, kvr + dr, use_bias=False, dtype=dt,
                                         kernel_init=_init(('embed', 'latent')), rngs=rngs)
    self.kv_a_layernorm = layers.rms_norm(kvr, cfg, rngs)
    self.kv_b_proj = nnx.Einsum('btr,rnh->btnh', (kvr, n, dn + dv), dtype=dt,
                                kernel_init=_init(('latent', 'heads', 'head_dim')), rngs=rngs)
    self.o_proj = nnx.Einsum('btnh,nhd->btd', (n, dv, d), dtype=dt,
                             kernel_init=_init(('heads', 'head_dim', 'embed')), rngs=rngs)
    self.dims = (n, qr, kvr, dn, dr, dv)
    self.rope_theta = cfg.rope_theta
    self.softmax_scale = self.facts.softmax_scale(cfg)  # 1 / sqrt(dn + dr)
    self.dtype = dt
    # the core without a cache: the Pallas kernels where attention_impl picks one, else
    # jax.nn.dot_product_attention (MLA has no blocked form; 'blocked' runs the library call)
    self.impl = attn_lib.attention_impl(cfg)
    self.rope_by_matmul = self.impl in layers.ROPE_MATMUL_CORES
    self.kernel_blocks = (getattr(cfg, 'attention_block_q', 512),
                          getattr(cfg, 'attention_block_kv', 512))

  @staticmethod
  def flops_per_token(cfg, keys: float) -> tuple[float, float]:
    """Forward FLOPs per token (2 per multiply-add): (the q (latent or direct), kv_a, kv_b
    and o projections, the scores over dn + dr and values over dv for `keys` keys on average
    per query); the training path's, not the absorbed decode form's."""
    d, n, qr, kvr = cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q = 2 * d * qr + 2 * qr * n * (dn + dr) if qr else 2 * d * n * (dn + dr)
    kv = 2 * d * (kvr + dr) + 2 * kvr * n * (dn + dv)
    return float(q + kv + 2 * n * dv * d), float(2 * n * (dn + dr) * keys + 2 * n * dv * keys)

  def _latent(self, kv_a_BTxC: Array, positions_BxT: Array) -> Array:
    """[kv_a_layernorm(c_kv) ; RoPE(k_r)] per token, [B, T, kvr + dr]: what the cache holds."""
    _, _, kvr, _, dr, _ = self.dims
    b, t = positions_BxT.shape
    c_kv = self.kv_a_layernorm(kv_a_BTxC[:, :kvr]).reshape(b, t, kvr)
    k_rope = layers.apply_rope(kv_a_BTxC[:, kvr:].reshape(b, t, 1, dr), positions_BxT,
                               self.rope_theta, swap_by_matmul=self.rope_by_matmul)
    return jnp.concatenate([c_kv, k_rope[:, :, 0].astype(c_kv.dtype)], axis=-1)

  def empty_cache(self, batch: int, slots: int, layout: str) -> tuple:
    """(latent [B, S, kvr + dr],): one layer's zero cache, the same in either layout."""
    del layout  # one latent per position has no heads to order
    _, _, kvr, _, dr, _ = self.dims
    return (jnp.zeros((batch, slots, kvr + dr), self.dtype),)

  def __call__(self, x_BxTxD, positions_BxT, mask_Bx1xTxS, cache=None, cache_index_B=None):
    """(out_BxTxD, new cache or None).

    cache=None: the explicit form (per-head keys and values, training / prefill).
    cache=(latent_BxSxC,) from empty_cache: the T new latents of row b land at
    cache_index_B[b] .. +T and the queries attend through the absorbed form
    (latent_attention), with these training-layout kernels (the 'bskh' decode path).
    """
    n, qr, kvr, dn, dr, dv = self.dims
    b, t, _ = x_BxTxD.shape
    x_BTxD = x_BxTxD.reshape(b * t, -1)
    if qr:
      c_q = self.q_a_layernorm(layers.project(x_BTxD, self.q_a_proj.kernel, self.dtype))
      q = layers.project(c_q, self.q_b_proj.kernel, self.dtype)
    else:
      q = layers.project(x_BTxD, self.q_proj.kernel, self.dtype)
    q_BxTxNxH = q.reshape(b, t, n, dn + dr)
    q_rope = layers.apply_rope(q_BxTxNxH[..., dn:], positions_BxT, self.rope_theta,
                               swap_by_matmul=self.rope_by_matmul)
    latent_BxTxC = self._latent(
        layers.project(x_BTxD, self.kv_a_proj_with_mqa.kernel, self.dtype), positions_BxT)
    scale = self.softmax_scale
    if cache is not None:
      latent_BxSxC = decode_ops.write_cache(cache[0], latent_BxTxC, cache_index_B)
      w_kvb = self.kv_b_proj.kernel[...].astype(self.dtype)  # [kvr, n, dn + dv]
      q_lat = jnp.einsum('btnh,rnh->btnr', q_BxTxNxH[..., :dn], w_kvb[..., :dn])
      lat = latent_attention(q_lat, q_rope, latent_BxSxC, mask_Bx1xTxS, scale)
      out = jnp.einsum('btnr,rnv->btnv', lat, w_kvb[..., dn:])
      o_BTxD = layers.project(out.reshape(b * t, -1), self.o_proj.kernel, self.dtype, in_dims=2)
      return o_BTxD.reshape(b, t, -1), (latent_BxSxC,)
    q_BxTxNxH = jnp.concatenate([q_BxTxNxH[..., :dn], q_rope], axis=-1)
    c_kv_BTxR = latent_BxTxC[..., :kvr].reshape(b * t, kvr)
    k_rope_BxTx1xHr = latent_BxTxC[:, :, None, kvr:]
    # [B, T, N, dn + dv]: each head's no-RoPE key, then its value
    kv = layers.project(c_kv_BTxR, self.kv_b_proj.kernel, self.dtype).reshape(
        b, t, n, dn + dv)
    k_BxTxNxH = jnp.concatenate(
        [kv[..., :dn], jnp.broadcast_to(k_rope_BxTx1xHr, (b, t, n, dr))], axis=-1)
    v_BxTxNxHv = kv[..., dn:]
    q_BxTxNxH = constrain(q_BxTxNxH, ('batch', 'length', 'act_heads', None))
    out = attention_core(q_BxTxNxH, k_BxTxNxH, v_BxTxNxHv, mask_Bx1xTxS, scale, self.impl,
                         self.kernel_blocks)
    out = constrain(out, ('batch', 'length', 'act_heads', None))
    o_BTxD = layers.project(out.reshape(b * t, -1), self.o_proj.kernel, self.dtype, in_dims=2)
    return o_BTxD.reshape(b, t, -1), None

  # -- the decode layout (decode_ops.DecodeWeight) and its few-token step ------------------------
  def prepare_decode(self, absorb_output: bool | None = None) -> None:
    """The decode layout for `decode`; the projections are dropped.

    in_t [(qr or n (dn + dr)) + kvr + dr, d]: the q (q_a_proj or q_proj) and
    kv_a_proj_with_mqa rows fused (both read x); q_b_t [n (dn + dr), qr]; kb_t [n, kvr, dn]
    per head (W_kb_n, O x I). Output: absorb_output (default: when it holds fewer numbers,
    kvr d <= dv (kvr + d)) vo_t [d, n kvr] = (W_vb_n W_o_n) stacked and transposed; else
    vb_t [n, dv, kvr] (W_vb_n^T) and o_t [d, n dv].
    """
    n, qr, kvr, dn, dr, dv = self.dims
    first = self.q_a_proj if qr else self.q_proj
    d = self.kv_a_proj_with_mqa.kernel.shape[0]
    self.in_t = decode_ops.DecodeWeight(jnp.concatenate(
        [decode_ops.decode_kernel(first.kernel),
         decode_ops.decode_kernel(self.kv_a_proj_with_mqa.kernel)], 0))
    if qr:
      self.q_b_t = decode_ops.DecodeWeight(decode_ops.decode_kernel(self.q_b_proj.kernel))
      del self.q_a_proj, self.q_b_proj
    else:
      del self.q_proj
    w_kvb = self.kv_b_proj.kernel[...]  # [kvr, n, dn + dv]
    self.kb_t = decode_ops.DecodeWeight(jnp.transpose(w_kvb[..., :dn], (1, 0, 2)))
    if absorb_output is None:
      absorb_output = kvr * d <= dv * (kvr + d)
    self.absorb_output = bool(absorb_output)
    if self.absorb_output:
      w_vo = jnp.einsum('rnv,nvd->nrd', w_kvb[..., dn:], self.o_proj.kernel[...])
      self.vo_t = decode_ops.DecodeWeight(w_vo.reshape(n * kvr, d).T)
    else:
      self.vb_t = decode_ops.DecodeWeight(jnp.transpose(w_kvb[..., dn:], (1, 2, 0)))
      self.o_t = decode_ops.DecodeWeight(decode_ops.decode_kernel(self.o_proj.kernel, in_dims=2))
    del self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj

  def decode(self, x_BxTxD, positions_BxT, mask_Bx1xTxS, cache, cache_index_B):
    """Attention of T new tokens through the latent cache (empty_cache), absorbed form,
    with the decode layout's weights (prepare_decode). Returns (out_BxTxD, new cache)."""
    n, qr, kvr, dn, dr, dv = self.dims
    b, t, d = x_BxTxD.shape
    a = decode_ops.decode_dot(x_BxTxD.reshape(b * t, d), self.in_t[...])
    nq = qr or n * (dn + dr)
    q = decode_ops.decode_dot(self.q_a_layernorm(a[:, :qr]), self.q_b_t[...]) if qr else a[:, :nq]
    q_BxTxNxH = q.reshape(b, t, n, dn + dr)
    latent = self._latent(a[:, nq:], positions_BxT)
    # One "KV head" ([B, 1, T, C] new entries): the writer of the heads-major caches,
    # one in-place update per row for few rows.
    latent_BxSxC = decode_ops.write_heads_major(cache[0], latent[:, None], cache_index_B, axis=1)
    q_lat = _head_dot(q_BxTxNxH[..., :dn], self.kb_t[...])
    q_rope = layers.apply_rope(q_BxTxNxH[..., dn:], positions_BxT, self.rope_theta,
                               swap_by_matmul=self.rope_by_matmul)
    lat = latent_attention(q_lat, q_rope, latent_BxSxC, mask_Bx1xTxS, self.softmax_scale)
    if self.absorb_output:
      out = decode_ops.decode_dot(lat.reshape(b * t, n * kvr), self.vo_t[...])
    else:
      out = decode_ops.decode_dot(_head_dot(lat, self.vb_t[...]).reshape(b * t, n * dv),
                              self.o_t[...])
    return out.reshape(b, t, d), (latent_BxSxC,)


def _head_dot(x_BxTxNxI: Array, w_NxOxI: Array) -> Array:
  """Per head n: x_n @ w_n^T, accumulated in float32 (x cast to w's dtype, as
  decode_ops.decode_dot does), returned in x's dtype."""
  return jnp.einsum('btni,noi->btno', x_BxTxNxI.astype(w_NxOxI.dtype), w_NxOxI,
                    preferred_element_type=jnp.float32).astype(x_BxTxNxI.dtype)


def latent_attention(q_lat_BxTxNxR: Array, q_rope_BxTxNxHr: Array, latent_BxSxC: Array,
                     mask_Bx1xTxS: Array, scale: float) -> Array:
  """The absorbed-latent attention core: [B, T, N, kvr] latent outputs sum_s p_n,s c_kv_s.

  latent_BxSxC: cache rows [c_kv ; RoPE(k_r)] (C = kvr + dr); q_lat: W_kb_n q_n;
  q_rope: RoPE(q_r). Score = [q_lat ; q_rope] . latent_s * scale: the no-RoPE and RoPE
  parts in one dot, every head against the same rows (multi-query). The value product
  runs over all C columns and drops the dr rotary ones after, instead of slicing (a
  copy of) the cache. Masked slots get layers' large finite negative, never NaN.
  """
  b, t, n, r = q_lat_BxTxNxR.shape
  dt = q_lat_BxTxNxR.dtype
  q_BxTNxC = jnp.concatenate([q_lat_BxTxNxR, q_rope_BxTxNxHr.astype(dt)], -1).reshape(
      b, t * n, -1)
  latent = latent_BxSxC.astype(dt)
  scores = jnp.einsum('bqc,bsc->bqs', q_BxTNxC, latent,
                      preferred_element_type=jnp.float32) * scale
  s = scores.shape[-1]
  mask = jnp.broadcast_to(mask_Bx1xTxS[:, 0, :, None, :], (b, t, n, s)).reshape(b, t * n, s)
  probs = jax.nn.softmax(jnp.where(mask, scores, attn_lib.MASKED), axis=-1).astype(dt)
  out = jnp.einsum('bqs,bsc->bqc', probs, latent)
  return out[..., :r].reshape(b, t, n, r)
