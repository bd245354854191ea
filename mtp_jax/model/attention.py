"""The attention core without a cache (training, prefill): masks and the blocked kernel.

`blocked_causal_attention` never computes a fully masked key block; with `saved_core`
its custom VJP saves the per-block outputs and log-sum-exps, so the backward pass does
not recompute the forward's softmax. `attention_impl` picks it on CPU and the library's
`jax.nn.dot_product_attention` (cuDNN / TPU kernels) elsewhere.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array


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
  (docs/benchmarks.md); 'xla' elsewhere, the library call that dispatches to cuDNN
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
  2 x 128 heads (docs/benchmarks.md). GQA: query head n uses kv head
  n // (N / K), as jax.nn.dot_product_attention does. Returns [B, T, N, H].

  saved_core (no GQA only; Attention sets it under model.remat = block): the same forward
  as a custom VJP (_saved_core) that keeps the output, each row's log-sum-exp and the
  heads-major q / k / v, named for the block remat policy (ATTENTION_SAVED_NAMES), and whose
  backward recomputes only the block probabilities (flash-style: dS = P (dP - rowsum(dO O))).
  Under remat the autodiff form reruns the whole forward in the backward pass first; this one
  does not (measured in docs/benchmarks.md). Without remat autodiff keeps the
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
