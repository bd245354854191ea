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
the interleaved-pair form, so convert.py permutes the rotary rows of q_b_proj / q_proj and
kv_a_proj_with_mqa on import and export (convert.rope_to_half / rope_to_pairs).

Only the uncached (training / teacher-forced) form is implemented; the absorbed-latent
decode (caching c_kv and k_r only) is not, and decode.Decoder rejects MLA models.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax import layers
from mtp_jax.sharding import constrain

Array = jax.Array


def _init(names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


def _pad_last(x: Array, width: int) -> Array:
  pad = width - x.shape[-1]
  return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def attention_core(q_BxTxNxH, k_BxSxNxH, v_BxSxNxV, mask_Bx1xTxS, scale: float) -> Array:
  """softmax(q k^T * scale) v by the same jax.nn.dot_product_attention as layers.Attention.

  That function needs one head width for q, k and v; MLA's value width dv may differ
  from its query/key width dn + dr, so all three are zero-padded to the larger one
  (zeros change no dot product, and the padded output columns are 0 and sliced off).
  """
  width = max(q_BxTxNxH.shape[-1], v_BxSxNxV.shape[-1])
  out = jax.nn.dot_product_attention(
      _pad_last(q_BxTxNxH, width), _pad_last(k_BxSxNxH, width).astype(q_BxTxNxH.dtype),
      _pad_last(v_BxSxNxV, width).astype(q_BxTxNxH.dtype), mask=mask_Bx1xTxS, scale=scale)
  return out[..., :v_BxSxNxV.shape[-1]]


class MLAttention(nnx.Module):
  """Causal multi-head latent attention; the call signature of layers.Attention."""

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
    self.dtype = dt

  def __call__(self, x_BxTxD, positions_BxT, mask_Bx1xTxS, cache=None, cache_index_B=None):
    """(out_BxTxD, None); a KV cache is not supported (see the module docstring)."""
    if cache is not None:
      raise NotImplementedError('MLA has no cached decode path yet (issue 13)')
    n, qr, kvr, dn, dr, dv = self.dims
    b, t, _ = x_BxTxD.shape
    x_NxD = x_BxTxD.reshape(b * t, -1)
    if qr:
      c_q = self.q_a_layernorm(layers.project(x_NxD, self.q_a_proj.kernel, self.dtype))
      q = layers.project(c_q, self.q_b_proj.kernel, self.dtype)
    else:
      q = layers.project(x_NxD, self.q_proj.kernel, self.dtype)
    q_BxTxNxQ = q.reshape(b, t, n, dn + dr)
    q_rope = layers.apply_rope(q_BxTxNxQ[..., dn:], positions_BxT, self.rope_theta)
    q_BxTxNxQ = jnp.concatenate([q_BxTxNxQ[..., :dn], q_rope], axis=-1)

    kv_a = layers.project(x_NxD, self.kv_a_proj_with_mqa.kernel, self.dtype)
    c_kv_NxR = self.kv_a_layernorm(kv_a[:, :kvr])
    k_rope_BxTx1xR = layers.apply_rope(kv_a[:, kvr:].reshape(b, t, 1, dr), positions_BxT,
                                       self.rope_theta)
    kv_BxTxNxK = layers.project(c_kv_NxR, self.kv_b_proj.kernel, self.dtype).reshape(
        b, t, n, dn + dv)
    k_BxTxNxQ = jnp.concatenate(
        [kv_BxTxNxK[..., :dn], jnp.broadcast_to(k_rope_BxTx1xR, (b, t, n, dr))], axis=-1)
    v_BxTxNxV = kv_BxTxNxK[..., dn:]
    q_BxTxNxQ = constrain(q_BxTxNxQ, ('batch', 'length', 'act_heads', None))
    out = attention_core(q_BxTxNxQ, k_BxTxNxQ, v_BxTxNxV, mask_Bx1xTxS,
                         1.0 / math.sqrt(dn + dr))
    out = constrain(out, ('batch', 'length', 'act_heads', None))
    o_NxD = layers.project(out.reshape(b * t, -1), self.o_proj.kernel, self.dtype, in_dims=2)
    return o_NxD.reshape(b, t, -1), None
