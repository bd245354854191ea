"""Transformer building blocks: RoPE, grouped-query attention, SwiGLU, the pre-norm block.

Parameter names follow Hugging Face's DeepSeek-V3 / Llama layout (input_layernorm,
self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj) so the
MTP layer maps 1:1 onto released weights.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mtp_jax.runtime.sharding import constrain

Array = jax.Array


def _init(initializer, names):
  return nnx.with_partitioning(initializer, names)


def rms_norm(d: int, cfg, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return RMSNorm(d, epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=jnp.float32,
                 scale_init=_init(nnx.initializers.ones, ('norm',)), rngs=rngs)


def rms_normalize_autodiff(x_NxD: Array, scale_D: Array, eps: float, dtype) -> Array:
  """nnx.RMSNorm's arithmetic: x * (rsqrt(mean(x^2) + eps) * scale), statistics in float32."""
  r_Nx1 = jax.lax.rsqrt(jnp.mean(jnp.square(x_NxD.astype(jnp.float32)), -1, keepdims=True) + eps)
  return jnp.asarray(x_NxD * (r_Nx1 * scale_D), dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_normalize_vjp(x_NxD: Array, scale_D: Array, eps: float, dtype) -> Array:
  """rms_normalize_autodiff with a closed-form backward (residuals: x and the row rsqrt):
  with x_hat = r x and u = scale * dy, dx = r (u - x_hat mean(x_hat u)), dscale = sum(dy x_hat)."""
  return rms_normalize_autodiff(x_NxD, scale_D, eps, dtype)


def _rms_vjp_fwd(x, scale, eps, dtype):
  r = jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + eps)
  return jnp.asarray(x * (r * scale), dtype), (x, r, scale)


def _rms_vjp_bwd(eps, dtype, res, dy):
  x, r, scale = res
  d = x.shape[-1]
  x_hat = x.astype(jnp.float32) * r
  dy, scale32 = dy.astype(jnp.float32), scale.astype(jnp.float32)
  # mean(x_hat * scale * dy) as (x_hat dy) . scale / d, a matrix-vector product: the scale
  # broadcast to [N, d] then never feeds a reduction (XLA:CPU materialised it there)
  xdy_NxD = (x_hat * dy).reshape(-1, d)
  c = (jnp.dot(xdy_NxD, scale32, precision=jax.lax.Precision.HIGHEST) / d).reshape(x.shape[:-1] + (1,))
  dx = r * (dy * scale32 - x_hat * c)
  return dx.astype(x.dtype), jnp.sum(xdy_NxD, 0).astype(scale.dtype)


rms_normalize_vjp.defvjp(_rms_vjp_fwd, _rms_vjp_bwd)

# The form every RMSNorm runs (benchmarks/train_throughput.py's 'norm' variants swap it while
# tracing). The closed form (issue 14, fourth pass, benchmarks/RESULTS.md): the MaxText-shape
# step (remat block) 0.97-1.00x the time of autodiff at D = 0 / 1 / 3 and 12-16 % less temp
# memory; configs/stdlib_mtp.py (no remat) 0.95-0.99x, 17 % less.
rms_normalize = rms_normalize_vjp


class RMSNorm(nnx.RMSNorm):
  """nnx.RMSNorm (same parameter, same values) over the last axis through rms_normalize."""

  def __call__(self, x, mask=None):
    if mask is not None or self.reduction_axes not in (-1, (-1,)) or self.scale is None:
      return super().__call__(x, mask)
    x, scale = self.promote_dtype((x, self.scale[...]), dtype=self.dtype)
    return rms_normalize(x, scale, self.epsilon, self.dtype)


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
               scaling: tuple = ()) -> Array:
  """Rotary embedding (rotate-half form) at the given integer positions (see rope_inv_freq)."""
  inv_freq = rope_inv_freq(x_BxTxNxH.shape[-1], theta, scaling)
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
                             mask_Bx1xTxT: Array, block: int = 64,
                             saved_core: bool = False) -> Array:
  """Causal self-attention that never computes a fully masked key block.

  Query block [a, e) can only see keys [0, e) (the mask is causal, a precondition: the
  training mask of `attention_mask`), so its scores are [e - a, e] instead of [e - a, T]:
  for T = 256 and blocks of 64, 62.5 % of the full T x T work. Each block's softmax is
  exact (the keys of a block row are all there), so no online-softmax rescaling is
  needed; autodiff gives the backward unless saved_core (below).
  The softmax is spelled out so that XLA:CPU does fewer passes over the [q, e] scores:
  the mask is an additive bias (one add, not a select), and the normalisation divides
  the [q, H] output rather than the [q, e] probabilities (exp(s - max) V / sum, the same
  value up to rounding). Heads-major 4-D einsums [B, N, t, H] (one transpose in, one out;
  with GQA the G query heads of a KV head stacked along the query axis) let XLA:CPU run
  the score / value products as plain batched matmuls; fwd + bwd of the core (8 x 32
  heads, B 16, T 256) took 0.85x the time of the softmax / select / 5-D form, 0.69x at
  2 x 128 heads (benchmarks/RESULTS.md, issue 14). GQA: query head n uses kv head
  n // (N / K), as jax.nn.dot_product_attention does. Returns [B, T, N, H].

  saved_core (no GQA only; Attention sets it under model.remat = block): the same forward
  as a custom VJP (_saved_core) that keeps the output, each row's log-sum-exp and the
  heads-major q / k / v, named for the block remat policy (ATTENTION_SAVED_NAMES), and whose
  backward recomputes only the block probabilities (flash-style: dS = P (dP - rowsum(dO O))).
  Under remat the autodiff form reruns the whole forward in the backward pass first; this one
  does not (benchmarks/RESULTS.md, issue 14 third pass). Without remat autodiff keeps the
  probabilities instead, and recomputing them would be extra work.
  """
  b, t, n, h = q_BxTxNxH.shape
  kv = k_BxTxKxH.shape[2]
  g = n // kv
  scale = 1.0 / math.sqrt(h)
  # Masked scores get a large finite negative (see _MASKED); a row always sees its own
  # position (causal, same document), so no row is all masked.
  bias_Bx1xTxT = jnp.where(mask_Bx1xTxT, 0.0, _MASKED).astype(jnp.float32)
  k_BxKxTxH = jnp.transpose(k_BxTxKxH, (0, 2, 1, 3))
  v_BxKxTxH = jnp.transpose(v_BxTxKxH, (0, 2, 1, 3))
  if g == 1:  # no GQA: 4-D [B, N, ., .] throughout (measured faster on XLA:CPU than the 5-D form)
    q_BxNxTxH = jnp.transpose(q_BxTxNxH * scale, (0, 2, 1, 3))
    if saved_core:
      return jnp.transpose(_saved_core(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, bias_Bx1xTxT, block),
                           (0, 2, 1, 3))
    outs = []
    for a in range(0, t, block):
      e = min(a + block, t)
      s_BxNxQxE = jnp.einsum('bnqh,bnsh->bnqs', q_BxNxTxH[:, :, a:e], k_BxKxTxH[:, :, :e],
                             preferred_element_type=jnp.float32) + bias_Bx1xTxT[:, :, a:e, :e]
      row_max = jax.lax.stop_gradient(jnp.max(s_BxNxQxE, axis=-1, keepdims=True))
      p_BxNxQxE = jnp.exp(s_BxNxQxE - row_max)
      o_BxNxQxH = jnp.einsum('bnqs,bnsh->bnqh', p_BxNxQxE.astype(v_BxTxKxH.dtype),
                             v_BxKxTxH[:, :, :e], preferred_element_type=jnp.float32)
      outs.append((o_BxNxQxH / jnp.sum(p_BxNxQxE, axis=-1, keepdims=True)).astype(q_BxTxNxH.dtype))
    return jnp.transpose(jnp.concatenate(outs, axis=2), (0, 2, 1, 3))
  q_BxKxGxTxH = jnp.transpose((q_BxTxNxH * scale).reshape(b, t, kv, g, h), (0, 2, 3, 1, 4))
  outs = []
  for a in range(0, t, block):
    e = min(a + block, t)
    # the G query heads of a KV head stacked along the query axis: 4-D dots [B, K, G*Q, .]
    q_BxKxGQxH = q_BxKxGxTxH[:, :, :, a:e].reshape(b, kv, g * (e - a), h)
    s_BxKxGQxE = jnp.einsum('bkqh,bksh->bkqs', q_BxKxGQxH, k_BxKxTxH[:, :, :e],
                            preferred_element_type=jnp.float32)
    s_BxKxGxQxE = s_BxKxGQxE.reshape(b, kv, g, e - a, e) + bias_Bx1xTxT[:, :, None, a:e, :e]
    row_max = jax.lax.stop_gradient(jnp.max(s_BxKxGxQxE, axis=-1, keepdims=True))
    p_BxKxGxQxE = jnp.exp(s_BxKxGxQxE - row_max)
    o_BxKxGQxH = jnp.einsum('bkqs,bksh->bkqh',
                            p_BxKxGxQxE.reshape(b, kv, g * (e - a), e).astype(v_BxTxKxH.dtype),
                            v_BxKxTxH[:, :, :e], preferred_element_type=jnp.float32)
    o_BxKxGxQxH = (o_BxKxGQxH.reshape(b, kv, g, e - a, h)
                   / jnp.sum(p_BxKxGxQxE, axis=-1, keepdims=True))
    outs.append(o_BxKxGxQxH.astype(q_BxTxNxH.dtype))
  o_BxKxGxTxH = jnp.concatenate(outs, axis=3)
  return jnp.transpose(o_BxKxGxTxH, (0, 3, 1, 2, 4)).reshape(b, t, n, h)


# The names under which remat='block' (model.remat_policy) saves the custom-VJP core's
# residuals: with them saved its backward never reruns its forward.
QKV_SAVED_NAME = 'attention_qkv_heads_major'
ATTENTION_SAVED_NAMES = ('attention_out', 'attention_lse', QKV_SAVED_NAME)


def _query_blocks(t: int, block: int) -> list:
  return [(a, min(a + block, t)) for a in range(0, t, block)]


def _block_scores(q_BxNxTxH, k_BxNxTxH, bias_Bx1xTxT, a: int, e: int) -> Array:
  """Scores of query block [a, e) against keys [0, e), masked by the additive bias: [B, N, Q, E]."""
  return jnp.einsum('bnqh,bnsh->bnqs', q_BxNxTxH[:, :, a:e], k_BxNxTxH[:, :, :e],
                    preferred_element_type=jnp.float32) + bias_Bx1xTxT[:, :, a:e, :e]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _saved_core(q_BxNxTxH, k_BxNxTxH, v_BxNxTxH, bias_Bx1xTxT, block: int) -> Array:
  """The blocked core (heads-major, no GQA, q pre-scaled) with a flash-style backward."""
  return _saved_core_fwd(q_BxNxTxH, k_BxNxTxH, v_BxNxTxH, bias_Bx1xTxT, block)[0]


def _saved_core_fwd(q, k, v, bias, block):
  outs, lses = [], []
  for a, e in _query_blocks(q.shape[2], block):
    s_BxNxQxE = _block_scores(q, k, bias, a, e)
    m_BxNxQx1 = jnp.max(s_BxNxQxE, axis=-1, keepdims=True)
    p_BxNxQxE = jnp.exp(s_BxNxQxE - m_BxNxQx1)
    l_BxNxQx1 = jnp.sum(p_BxNxQxE, axis=-1, keepdims=True)
    o_BxNxQxH = jnp.einsum('bnqs,bnsh->bnqh', p_BxNxQxE.astype(v.dtype), v[:, :, :e],
                           preferred_element_type=jnp.float32) / l_BxNxQx1
    outs.append(o_BxNxQxH.astype(q.dtype))
    lses.append(m_BxNxQx1 + jnp.log(l_BxNxQx1))
  o_BxNxTxH = checkpoint_name(jnp.concatenate(outs, axis=2), ATTENTION_SAVED_NAMES[0])
  lse_BxNxTx1 = checkpoint_name(jnp.concatenate(lses, axis=2), ATTENTION_SAVED_NAMES[1])
  # and q, k, v heads-major: kept, the backward reruns neither RoPE nor the transposes
  q, k, v = (checkpoint_name(x, QKV_SAVED_NAME) for x in (q, k, v))
  return o_BxNxTxH, (q, k, v, bias, o_BxNxTxH, lse_BxNxTx1)


def _saved_core_bwd(block, res, do_BxNxTxH):
  """Per query block: P = exp(S - lse) recomputed from the saved row log-sum-exp,
  dV += P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO o O)), dQ = dS K, dK += dS^T Q."""
  q, k, v, bias, o, lse = res
  t = q.shape[2]
  f32 = jnp.float32
  delta_BxNxTx1 = jnp.sum(do_BxNxTxH.astype(f32) * o.astype(f32), axis=-1, keepdims=True)
  dqs, dks, dvs = [], [], []
  for a, e in _query_blocks(t, block):
    p_BxNxQxE = jnp.exp(_block_scores(q, k, bias, a, e) - lse[:, :, a:e])
    do_BxNxQxH = do_BxNxTxH[:, :, a:e]
    dvs.append(jnp.einsum('bnqs,bnqh->bnsh', p_BxNxQxE.astype(do_BxNxQxH.dtype), do_BxNxQxH,
                          preferred_element_type=f32))
    dp_BxNxQxE = jnp.einsum('bnqh,bnsh->bnqs', do_BxNxQxH, v[:, :, :e].astype(do_BxNxQxH.dtype),
                            preferred_element_type=f32)
    ds_BxNxQxE = p_BxNxQxE * (dp_BxNxQxE - delta_BxNxTx1[:, :, a:e])
    dqs.append(jnp.einsum('bnqs,bnsh->bnqh', ds_BxNxQxE.astype(k.dtype), k[:, :, :e],
                          preferred_element_type=f32).astype(q.dtype))
    dks.append(jnp.einsum('bnqs,bnqh->bnsh', ds_BxNxQxE.astype(q.dtype), q[:, :, a:e],
                          preferred_element_type=f32))

  def keys_sum(parts):  # block row [a, e)'s key gradients cover keys [0, e): pad to T, add
    return sum(jnp.pad(x, ((0, 0), (0, 0), (0, t - x.shape[2]), (0, 0))) for x in parts)
  return (jnp.concatenate(dqs, axis=2), keys_sum(dks).astype(k.dtype),
          keys_sum(dvs).astype(v.dtype), jnp.zeros_like(bias))


_saved_core.defvjp(_saved_core_fwd, _saved_core_bwd)


def write_cache(cache_BxSxKxH: Array, new_BxQxKxH: Array, index_B: Array) -> Array:
  """Writes each row's new entries at that row's own offset."""
  def one(c, n, i):
    return jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), i, axis=0)
  return jax.vmap(one)(cache_BxSxKxH, new_BxQxKxH, index_B)


# -- decoding: few-token steps through a KV cache ------------------------------------------
# The decode path of each layer (`decode` beside `__call__`): the same parameters and math,
# arranged for steps of a few tokens. Two cache layouts, a setting of the decoder:
#  'heads_major'  k [B*K, S, H] and v [B*K, H, S]: XLA:CPU's attention dots (matrix-vector
#                 products for a few queries) read them as they are, and the batch and KV
#                 heads share the dots' one batch axis, so the updated cache feeds them
#                 without a reshape (with one, XLA:CPU fused the reshape into the update and
#                 copied the whole cache every step). The CPU default.
#  'bskh'         k, v [B, S, K, H], `__call__`'s own cache and jax.nn.dot_product_attention
#                 (the library path, for GPU / TPU).
CACHE_LAYOUTS = ('heads_major', 'bskh')


def default_cache_layout() -> str:
  return 'heads_major' if jax.default_backend() == 'cpu' else 'bskh'


def empty_cache(cfg, batch: int, slots: int, layout: str):
  """One GQA layer's zero KV cache of `slots` positions in `layout` (Attention.empty_cache
  of a model's own layers; MLA's differs: Block.empty_cache)."""
  return _empty_kv(batch, slots, cfg.n_kv_heads, cfg.head_dim, cfg.dtype, layout)


def _empty_kv(batch: int, slots: int, k: int, h: int, dtype, layout: str) -> tuple:
  if layout == 'bskh':
    return (jnp.zeros((batch, slots, k, h), dtype),) * 2
  return (jnp.zeros((batch * k, slots, h), dtype), jnp.zeros((batch * k, h, slots), dtype))


# The decode weight layout: every matrix a decode step multiplies by is stored O x I (the
# transpose of the model's [in..., out...] kernels), q/k/v fused into one matrix and gate/up
# into another (fewer, larger products), by the modules' `prepare_decode`; the Decoder does
# this once, on its own copy of the model (model.MTPModel.for_decoding).
class DecodeWeight(nnx.Variable):
  """A weight matrix [O, I] of the decode layout (see prepare_decode); decode-only."""


def decode_kernel(kernel, in_dims: int = 1) -> Array:
  """A kernel [in..., out...] as the decode layout's [O, I] matrix."""
  w = kernel[...]
  return w.reshape(math.prod(w.shape[:in_dims]), -1).T


# The few-row matmul rule, in this one place. XLA:CPU, jax 0.10.2, float32 weights
# (benchmarks/few_row_matmul.py, JSON benchmarks/few_row_matmul.json, RESULTS.md "Few-row
# products", and a 768 x 2048 check of 1-128 rows: the barrier form beats x W_t^T up to 64
# rows, 882 vs 1185 us at 32, equal at 128): with W_t stored O x I the tall-skinny product W_t x^T (dot_general over W_t's
# axis 1 and x's axis 1, output [O, M] kept in that layout by an optimization barrier,
# then the small result transposed) costs near one 1-row weight read at M up to TALL_ROWS,
# whereas x @ W (I x O) and x W_t^T with 2-8
# rows go to a GEMM that costs 1.5-4x that, and one GEMV per row costs M x. More rows (a
# prefill, large batches) are a real GEMM: x W_t^T. bfloat16 weights (activations cast to
# bfloat16, float32 accumulation): x W_t^T, a 1-row product padded to 2 rows (a 1-row bf16
# dot converts the whole weight to float32 first). Other backends: x W_t^T as it is.
TALL_ROWS = 64
# ... and the tall-skinny product's M padded up to a multiple of ROW_MULTIPLE past 4 rows:
# YNNPACK's kernels run 5-7 rows slower than 8 and 9-15 slower than 16 (768-d block
# weights, quiet, over the best 1-row product: 5 rows 1.4-2.3, 8 rows 1.1-1.9, 12 rows
# 1.9-3.4, 16 rows 1.3-2.4; RESULTS.md "Where the end-to-end time goes"; the form is
# few_row_matmul.py's Wt_x_bar_pad8), so the D = 3 MTP windows of 5 and 6 rows run as 8.
ROW_MULTIPLE = 8
WRITE_LOOP_ROWS = 6  # cache updates: one in-place update per row up to here, else a scatter

_CONTRACT_1_1 = (((1,), (1,)), ((), ()))


def _padded_rows(m: int) -> int:
  """Rows a tall-skinny product of m rows runs with: m up to 4, else the next multiple of
  ROW_MULTIPLE."""
  return m if m <= 4 else -(-m // ROW_MULTIPLE) * ROW_MULTIPLE


def decode_dot(x_MxI: Array, w_OxI: Array) -> Array:
  """x @ w_OxI.T for a decode step of M = batch x window rows, by the rule above.

  Accumulates in float32; returns x's dtype.
  """
  m, out_dtype = x_MxI.shape[0], x_MxI.dtype
  f32 = jnp.float32
  if w_OxI.dtype == jnp.bfloat16 or jax.default_backend() != 'cpu':
    x = x_MxI.astype(w_OxI.dtype)
    pad = m == 1 and w_OxI.dtype == jnp.bfloat16 and jax.default_backend() == 'cpu'
    if pad:
      x = jnp.concatenate([x, jnp.zeros_like(x)], 0)
    y = jax.lax.dot_general(x, w_OxI, _CONTRACT_1_1, preferred_element_type=f32)
    return (y[:1] if pad else y).astype(out_dtype)
  w_OxI = w_OxI.astype(out_dtype)
  if m == 1:  # a GEMV; its [O, 1] -> [1, O] transpose is a bitcast
    return jax.lax.dot_general(x_MxI, w_OxI, _CONTRACT_1_1, preferred_element_type=f32
                               ).astype(out_dtype)
  if m <= TALL_ROWS:  # verify / MTP windows, up to batch 8-16
    # The barrier keeps the [O, M] product in that layout: without it XLA:CPU's layout
    # assignment makes the transpose free by laying the dot's output out as [M, O],
    # which is the slow GEMM again (1.5-3x at 2-8 rows, few_row_matmul.py Wt_x vs Wt_x_bar).
    mp = _padded_rows(m)
    x = x_MxI if mp == m else jnp.pad(x_MxI, ((0, mp - m), (0, 0)))
    y_OxM = jax.lax.optimization_barrier(
        jax.lax.dot_general(w_OxI, x, _CONTRACT_1_1, preferred_element_type=f32))
    return y_OxM[:, :m].T.astype(out_dtype)
  return jax.lax.dot_general(x_MxI, w_OxI, _CONTRACT_1_1,
                             preferred_element_type=f32).astype(out_dtype)


# The attention core of a few-query step, by the same rule: its two products, scores
# q k^T and probs v, each multiply a few query rows by a cache-long matrix per KV head.
# As einsums over [queries, ...] x [slots, ...] XLA:CPU runs them (YNNPACK, >= 2 queries)
# as the slow GEMM form: at 4 queries a trunk pass's attention cost 4x the 1-query one
# (0.4 AR step at d 768 / L 12); the tall-skinny form, [slots, queries] behind a barrier,
# then the small transpose, cut a 4-row trunk pass from 1.40 to 1.26 one-row passes
# (RESULTS.md "Where the end-to-end time goes"). One query (an AR step), prefill-sized
# windows and other backends keep the einsum.
ATTN_TALL = True


def _few_query_dot(a_XxQxC, b_XxRxC, out_dtype):
  """[X, Q, R] = a b^T per leading index x, contracting C; Q few rows (decode_dot's rule)."""
  q = a_XxQxC.shape[1]
  if not ATTN_TALL or q == 1 or q > TALL_ROWS or jax.default_backend() != 'cpu':
    return jnp.einsum('xqc,xrc->xqr', a_XxQxC, b_XxRxC,
                      preferred_element_type=jnp.float32).astype(out_dtype)
  qp = _padded_rows(q)
  a = a_XxQxC if qp == q else jnp.pad(a_XxQxC, ((0, 0), (0, qp - q), (0, 0)))
  y_XxRxQ = jax.lax.optimization_barrier(
      jnp.einsum('xrc,xqc->xrq', b_XxRxC, a, preferred_element_type=jnp.float32))
  return y_XxRxQ[:, :, :q].transpose(0, 2, 1).astype(out_dtype)


def _write_heads_major(cache_BKx, new_BxKx, index_B, axis):
  """Row b's T new entries go to slots index_B[b].. along `axis` (1 or 2) of its K heads."""
  b, kv = new_BxKx.shape[:2]
  new_BxKx = new_BxKx.astype(cache_BKx.dtype)
  if b > WRITE_LOOP_ROWS:
    cache = cache_BKx.reshape((b, kv) + cache_BKx.shape[1:])
    cache = jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice_in_dim(c, n, i, axis))(
        cache, new_BxKx, index_B)
    return cache.reshape(cache_BKx.shape)
  zero = jnp.zeros((), jnp.int32)  # few rows: one in-place update each, no scatter
  for row in range(b):
    start = [jnp.int32(row * kv), zero, zero]
    start[axis] = index_B[row]
    cache_BKx = jax.lax.dynamic_update_slice(cache_BKx, new_BxKx[row], start)
  return cache_BKx


class Attention(nnx.Module):
  """Causal grouped-query attention with RoPE; optional per-row KV cache."""

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
    self.cache_heads = (k, h)  # (KV heads, head_dim) of empty_cache
    self.impl = attention_impl(cfg)  # resolved at build time: the backend is known by then
    self.block = getattr(cfg, 'attention_block', 64)
    # the custom-VJP core where its residuals are saved (remat block: see blocked_causal_attention)
    self.saved_core = getattr(cfg, 'remat', 'none') == 'block'

  def rope(self, x_BxTxNxH, positions_BxT):
    """apply_rope with this layer's theta and scaling."""
    return apply_rope(x_BxTxNxH, positions_BxT, self.rope_theta, self.rope_scaling)

  def __call__(self, x_BxTxD, positions_BxT, mask_Bx1xTxS, cache=None, cache_index_B=None):
    """Attention over x (cache=None) or over a cache the new keys are written into.

    cache: (k_BxSxKxH, v_BxSxKxH); the T new keys/values of row b land at
    cache_index_B[b] .. +T, and mask_Bx1xTxS says which cache slots each query sees.
    Returns (out_BxTxD, new_cache or None).
    """
    b, t, _ = x_BxTxD.shape
    x_NxD = x_BxTxD.reshape(b * t, -1)

    def heads(proj):  # [B*T, N*H] -> [B, T, N, H]
      out = project(x_NxD, proj.kernel, self.dtype).reshape(b, t, *proj.kernel.shape[1:])
      return out if proj.bias is None else out + proj.bias[...].astype(out.dtype)

    q = self.rope(heads(self.q_proj), positions_BxT)
    k = self.rope(heads(self.k_proj), positions_BxT)
    v = heads(self.v_proj)
    q = constrain(q, ('batch', 'length', 'act_heads', None))
    if cache is not None:
      k = write_cache(cache[0], k, cache_index_B)
      v = write_cache(cache[1], v, cache_index_B)
      cache = (k, v)
    if cache is None and self.impl == 'blocked':  # training / no cache: self-attention, causal
      out = blocked_causal_attention(q, k, v, mask_Bx1xTxS, self.block, self.saved_core)
    else:
      out = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype),
                                         mask=mask_Bx1xTxS)
    out = constrain(out, ('batch', 'length', 'act_heads', None))
    o_NxD = project(out.reshape(b * t, -1), self.o_proj.kernel, self.dtype, in_dims=2)
    return o_NxD.reshape(b, t, -1), cache


  def empty_cache(self, batch: int, slots: int, layout: str) -> tuple:
    """(k, v): this layer's zero KV cache of `slots` positions in `layout` (CACHE_LAYOUTS)."""
    return _empty_kv(batch, slots, *self.cache_heads, self.dtype, layout)

  def prepare_decode(self) -> None:
    """The decode layout (see DecodeWeight): [q; k; v] as one [(N + 2K) H, d] matrix
    (and their biases as one [(N + 2K) H] vector, if any), o as [d, N H]. The projections
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
    k_cache = _write_heads_major(cache[0], k.transpose(0, 2, 1, 3), cache_index_B, axis=1)
    v_cache = _write_heads_major(cache[1], v.transpose(0, 2, 3, 1), cache_index_B, axis=2)
    # queries of one KV head: [B*K, G*T, H] (query head n = kv_head * G + g, as in GQA)
    q = q.reshape(b, t, kv, g, hd).transpose(0, 2, 3, 1, 4).reshape(b * kv, g * t, hd)
    scores = _few_query_dot(q, k_cache.astype(dt), jnp.float32) * (1 / math.sqrt(hd))
    mask = jnp.broadcast_to(mask_Bx1xTxS[:, None], (b, kv, g, t, scores.shape[-1]))
    # Masked scores get a large finite negative: a query that sees nothing (a position
    # before 0 in an MTP window) averages finite values, never NaN.
    scores = jnp.where(mask.reshape(scores.shape), scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = _few_query_dot(probs, v_cache.astype(dt), dt)  # [B*K, G*T, H]
    out = out.reshape(b, kv, g, t, hd).transpose(0, 3, 1, 2, 4).reshape(b * t, n * hd)
    return decode_dot(out, self.o_t[...]).reshape(b, t, d), (k_cache, v_cache)


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


  def prepare_decode(self) -> None:
    """The decode layout (see DecodeWeight): [gate; up] as one [2F, d] matrix, down as
    [d, F]. The projections are dropped: the module then runs `decode` only."""
    self.decode_mlp_dim = self.gate_proj.kernel.shape[1]
    self.gate_up_t = DecodeWeight(jnp.concatenate(
        [decode_kernel(self.gate_proj.kernel), decode_kernel(self.up_proj.kernel)], 0))
    self.down_t = DecodeWeight(decode_kernel(self.down_proj.kernel))
    del self.gate_proj, self.up_proj, self.down_proj

  def decode(self, x_BxTxD):
    """__call__ for a decode step, with the decode layout's weights (prepare_decode)."""
    b, t, d = x_BxTxD.shape
    f = self.decode_mlp_dim
    gu_NxF2 = decode_dot(x_BxTxD.reshape(b * t, d), self.gate_up_t[...])
    h_NxF = jax.nn.silu(gu_NxF2[:, :f]) * gu_NxF2[:, f:]
    return decode_dot(h_NxF, self.down_t[...]).reshape(b, t, d)


class Block(nnx.Module):
  """Pre-norm decoder block: x + Attn(RMSNorm(x)), then x + MLP(RMSNorm(x)).

  attention_cls / mlp_cls: other classes of the same call signatures (mla.MLAttention,
  moe.MoE), chosen per layer by model.block_classes; they bring their own decode path
  (prepare_decode / decode) and, the attention, its own cache (empty_cache).
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
