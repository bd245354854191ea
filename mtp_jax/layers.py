"""Transformer building blocks: RoPE, grouped-query attention, SwiGLU, the pre-norm block.

Parameter names follow Hugging Face's DeepSeek-V3 / Llama layout (input_layernorm,
self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj) so the
MTP layer maps 1:1 onto released weights.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.sharding import constrain

Array = jax.Array


def _init(initializer, names):
  return nnx.with_partitioning(initializer, names)


def rms_norm(d: int, cfg, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(d, epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=jnp.float32,
                     scale_init=_init(nnx.initializers.ones, ('norm',)), rngs=rngs)


def project(x_NxI: Array, kernel, dtype, in_dims: int = 1) -> Array:
  """x @ kernel with the kernel's first `in_dims` axes contracted, as one 2-D matmul.

  Activations are flattened to [B*T, features] for every projection: XLA:CPU runs a
  plain 2-D matmul (and its two backward matmuls) ~1.5x faster than the same einsum
  over [B, T, ...] with two contracting dims in the weight gradient; on GPU/TPU it is
  the same HLO dot. Parameters keep their [in..., out...] shapes (checkpoints and
  per-axis sharding names unchanged).
  """
  w = kernel[...]
  w_IxO = w.reshape(math.prod(w.shape[:in_dims]), -1)
  return jnp.dot(x_NxI.astype(dtype), w_IxO.astype(dtype))


def apply_rope(x_BxTxNxH: Array, positions_BxT: Array, theta: float) -> Array:
  """Rotary embedding (rotate-half form) at the given integer positions."""
  h = x_BxTxNxH.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  angles_BxTxF = positions_BxT[..., None].astype(jnp.float32) * inv_freq
  sin = jnp.sin(angles_BxTxF)[:, :, None, :]
  cos = jnp.cos(angles_BxTxF)[:, :, None, :]
  x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxH.dtype)


def attention_mask(segment_ids_BxT: Array) -> Array:
  """Causal mask restricted to one packed document: [B, 1, T, T] booleans."""
  t = segment_ids_BxT.shape[1]
  causal_TxT = jnp.tril(jnp.ones((t, t), dtype=bool))
  same_BxTxT = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
  return (causal_TxT[None] & same_BxTxT)[:, None]


# The large negative that masked scores get (jax.nn.dot_product_attention's value): finite,
# so a row's max-subtraction never sees inf - inf.
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_impl(cfg) -> str:
  """The attention core for training / prefill: 'blocked' or 'xla' (config.model.attention_core).

  auto: 'blocked' on CPU, where it is ~2x faster than jax.nn.dot_product_attention
  (benchmarks/RESULTS.md); 'xla' elsewhere, the library call that dispatches to cuDNN
  flash attention / TPU kernels and must stay the accelerator path.
  """
  impl = getattr(cfg, 'attention_core', 'auto')
  if impl == 'auto':
    return 'blocked' if jax.default_backend() == 'cpu' else 'xla'
  return impl


def blocked_causal_attention(q_BxTxNxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array,
                             mask_Bx1xTxT: Array, block: int = 64) -> Array:
  """Causal self-attention that never computes a fully masked key block.

  Query block [a, e) can only see keys [0, e) (the mask is causal, a precondition: the
  training mask of `attention_mask`), so its scores are [e - a, e] instead of [e - a, T]:
  for T = 256 and blocks of 64, 62.5 % of the full T x T work. Each block's softmax is
  exact (the keys of a block row are all there), so no online-softmax rescaling is
  needed, and autodiff gives the backward (a hand-written VJP was measured no faster).
  Heads-major einsums [B, K, G, t, H] (one transpose in, one out) let XLA:CPU run the
  score / value products as plain batched matmuls. GQA: query head n uses kv head
  n // (N / K), as jax.nn.dot_product_attention does. Returns [B, T, N, H].
  """
  b, t, n, h = q_BxTxNxH.shape
  kv = k_BxTxKxH.shape[2]
  g = n // kv
  scale = 1.0 / math.sqrt(h)
  q_BxKxGxTxH = jnp.transpose((q_BxTxNxH * scale).reshape(b, t, kv, g, h), (0, 2, 3, 1, 4))
  k_BxKxTxH = jnp.transpose(k_BxTxKxH, (0, 2, 1, 3))
  v_BxKxTxH = jnp.transpose(v_BxTxKxH, (0, 2, 1, 3))
  outs = []
  for a in range(0, t, block):
    e = min(a + block, t)
    s_BxKxGxQxE = jnp.einsum('bkgqh,bksh->bkgqs', q_BxKxGxTxH[:, :, :, a:e], k_BxKxTxH[:, :, :e],
                             preferred_element_type=jnp.float32)
    s_BxKxGxQxE = jnp.where(mask_Bx1xTxT[:, :, None, a:e, :e], s_BxKxGxQxE, _MASKED)
    p = jax.nn.softmax(s_BxKxGxQxE, axis=-1).astype(v_BxTxKxH.dtype)
    outs.append(jnp.einsum('bkgqs,bksh->bkgqh', p, v_BxKxTxH[:, :, :e]))
  o_BxKxGxTxH = jnp.concatenate(outs, axis=3)
  return jnp.transpose(o_BxKxGxTxH, (0, 3, 1, 2, 4)).reshape(b, t, n, h)


def write_cache(cache_BxSxKxH: Array, new_BxQxKxH: Array, index_B: Array) -> Array:
  """Writes each row's new entries at that row's own offset."""
  def one(c, n, i):
    return jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), i, axis=0)
  return jax.vmap(one)(cache_BxSxKxH, new_BxQxKxH, index_B)


class Attention(nnx.Module):
  """Causal grouped-query attention with RoPE; optional per-row KV cache."""

  def __init__(self, cfg, rngs: nnx.Rngs):
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    init = nnx.initializers.lecun_normal()
    dt = cfg.dtype
    self.q_proj = nnx.Einsum('btd,dnh->btnh', (d, n, h), dtype=dt,
                             kernel_init=_init(init, ('embed', 'heads', 'head_dim')), rngs=rngs)
    self.k_proj = nnx.Einsum('btd,dkh->btkh', (d, k, h), dtype=dt,
                             kernel_init=_init(init, ('embed', 'kv_heads', 'head_dim')), rngs=rngs)
    self.v_proj = nnx.Einsum('btd,dkh->btkh', (d, k, h), dtype=dt,
                             kernel_init=_init(init, ('embed', 'kv_heads', 'head_dim')), rngs=rngs)
    self.o_proj = nnx.Einsum('btnh,nhd->btd', (n, h, d), dtype=dt,
                             kernel_init=_init(init, ('heads', 'head_dim', 'embed')), rngs=rngs)
    self.rope_theta = cfg.rope_theta
    self.dtype = dt
    self.impl = attention_impl(cfg)  # resolved at build time: the backend is known by then
    self.block = getattr(cfg, 'attention_block', 64)

  def __call__(self, x_BxTxD, positions_BxT, mask_Bx1xTxS, cache=None, cache_index_B=None):
    """Attention over x (cache=None) or over a cache the new keys are written into.

    cache: (k_BxSxKxH, v_BxSxKxH); the T new keys/values of row b land at
    cache_index_B[b] .. +T, and mask_Bx1xTxS says which cache slots each query sees.
    Returns (out_BxTxD, new_cache or None).
    """
    b, t, _ = x_BxTxD.shape
    x_NxD = x_BxTxD.reshape(b * t, -1)

    def heads(proj):  # [B*T, N*H] -> [B, T, N, H]
      return project(x_NxD, proj.kernel, self.dtype).reshape(b, t, *proj.kernel.shape[1:])

    q = apply_rope(heads(self.q_proj), positions_BxT, self.rope_theta)
    k = apply_rope(heads(self.k_proj), positions_BxT, self.rope_theta)
    v = heads(self.v_proj)
    q = constrain(q, ('batch', 'length', 'act_heads', None))
    if cache is not None:
      k = write_cache(cache[0], k, cache_index_B)
      v = write_cache(cache[1], v, cache_index_B)
      cache = (k, v)
    if cache is None and self.impl == 'blocked':  # training / no cache: self-attention, causal
      out = blocked_causal_attention(q, k, v, mask_Bx1xTxS, self.block)
    else:
      out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype),
                                         mask=mask_Bx1xTxS)
    out = constrain(out, ('batch', 'length', 'act_heads', None))
    o_NxD = project(out.reshape(b * t, -1), self.o_proj.kernel, self.dtype, in_dims=2)
    return o_NxD.reshape(b, t, -1), cache


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

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
    x_NxD = x_BxTxD.reshape(b * t, -1)
    h_NxF = (jax.nn.silu(project(x_NxD, self.gate_proj.kernel, self.dtype))
             * project(x_NxD, self.up_proj.kernel, self.dtype))
    h_NxF = constrain(h_NxF, ('batch', 'act_mlp'))
    return project(h_NxF, self.down_proj.kernel, self.dtype).reshape(b, t, -1)


class Block(nnx.Module):
  """Pre-norm decoder block: x + Attn(RMSNorm(x)), then x + MLP(RMSNorm(x)).

  attention_cls / mlp_cls: other classes of the same call signatures (mla.MLAttention,
  moe.MoE), chosen per layer by model.block_classes.
  """

  def __init__(self, cfg, rngs: nnx.Rngs, attention_cls=None, mlp_cls=None):
    self.input_layernorm = rms_norm(cfg.d_model, cfg, rngs)
    self.self_attn = (attention_cls or Attention)(cfg, rngs)
    self.post_attention_layernorm = rms_norm(cfg.d_model, cfg, rngs)
    self.mlp = (mlp_cls or MLP)(cfg, rngs)

  def __call__(self, x_BxTxD, positions_BxT, mask_Bx1xTxS, cache=None, cache_index_B=None):
    a, cache = self.self_attn(self.input_layernorm(x_BxTxD), positions_BxT, mask_Bx1xTxS,
                              cache, cache_index_B)
    x = x_BxTxD + a
    x = x + self.mlp(self.post_attention_layernorm(x))
    return constrain(x, ('batch', 'length', 'act_embed')), cache
