"""The attention core without a cache (training, prefill): masks, the blocked core, kernels.

`attention_impl` names the core (config.model.attention_core):
  blocked  `blocked_causal_attention`, plain JAX: never computes a fully masked key block;
           with `saved_core` its custom VJP saves the per-block outputs and log-sum-exps,
           so the backward pass does not recompute the forward's softmax. The CPU default.
  splash   `kernel_attention`: the Pallas TPU splash-attention kernel (forward, and its own
           dq / dkv backward kernels), causal with segment ids, per shard in jax.shard_map.
           The TPU default; elsewhere (on CPU: tests) it runs in Pallas interpret mode.
  triton   `kernel_attention`: the Pallas GPU (Triton) flash-attention kernel `mha` (its
           own backward kernels), causal with segment ids, per shard in jax.shard_map. The
           GPU default; elsewhere it runs in Pallas interpret mode.
  xla      `jax.nn.dot_product_attention` with a dense mask and no `implementation`: the
           XLA path on every backend (dense [B, K, G, T, T] float32 scores), no fused kernel.
The kernel cores take the [B, T] segment ids where the others take the dense [B, 1, T, T]
mask (`training_mask`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import spmd as flax_spmd
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import mtp_jax.model.context as context_lib
import mtp_jax.model.matmul as matmul
from mtp_jax.config.kernel_limits import attention_kernel_problem, triton_blocks
from mtp_jax.errors import ConfigError
from mtp_jax.runtime import profiling, sharding

Array = jax.Array


def attention_mask(segment_ids_BxT: Array) -> Array:
  """Causal mask restricted to one packed document: [B, 1, T, T] booleans (in context
  parallelism's balanced layout, causal by the tokens' natural indices)."""
  t = segment_ids_BxT.shape[1]
  layout = context_lib.active()
  if layout is not None and layout.length == t:
    order = jnp.asarray(layout.order)
    causal_TxT = order[:, None] >= order[None, :]
  else:
    causal_TxT = jnp.tril(jnp.ones((t, t), dtype=bool))
  same_BxTxT = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
  return (causal_TxT[None] & same_BxTxT)[:, None]


# The large negative that masked scores get (jax.nn.dot_product_attention's value): finite,
# so a row's max-subtraction never sees inf - inf.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


# The core `auto` picks per backend: on CPU the blocked core (~2x faster there than
# jax.nn.dot_product_attention, docs/benchmarks.md), on TPU / GPU the backend's kernel.
AUTO_CORES = {'cpu': 'blocked', 'tpu': 'splash', 'gpu': 'triton', 'cuda': 'triton'}
# The cores that read segment ids instead of a dense mask (the Pallas kernels), and the
# backends each kernel is compiled for.
SEGMENT_CORES = ('splash', 'triton')
KERNEL_BACKENDS = {'splash': ('tpu',), 'triton': ('gpu', 'cuda')}


def attention_impl(cfg) -> str:
  """The attention core for training / prefill (config.model.attention_core; module
  docstring): 'blocked', 'splash', 'triton' or 'xla'; auto by backend (AUTO_CORES)."""
  impl = getattr(cfg, 'attention_core', 'auto')
  if impl == 'auto':
    return AUTO_CORES.get(jax.default_backend(), 'xla')
  return impl


def training_mask(segment_ids_BxT: Array, impl: str) -> Array:
  """What the layers' no-cache path reads as its mask for core `impl`: the segment ids
  themselves for the kernels (SEGMENT_CORES) and in context parallelism's layout
  (context_attention), else the dense attention_mask."""
  if impl in SEGMENT_CORES or context_lib.active() is not None:
    return segment_ids_BxT
  return attention_mask(segment_ids_BxT)


def no_cache_context_parallel(cache) -> bool:
  """Whether a layer's no-cache attention runs context_attention (the step is in the
  balanced layout of model/context.py)."""
  return cache is None and context_lib.active() is not None


def dense_mask(mask: Array) -> Array:
  """The [B, 1, T, T] mask of a training_mask: [B, T] segment ids are expanded."""
  return attention_mask(mask) if mask.ndim == 2 else mask


@jax.named_scope(profiling.ATTENTION_SCOPE)
def blocked_causal_attention(q_BxTxNxH: Array, k_BxTxKxH: Array, v_BxTxKxH: Array,
                             mask_Bx1xTxT: Array, block: int = 64,
                             saved_core: bool = False, scale: float | None = None) -> Array:
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
  n // (N / K), as jax.nn.dot_product_attention does. Returns [B, T, N, H]. scale: the
  attention class's softmax_scale (None: 1 / sqrt(H), jax.nn.dot_product_attention's).

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
  scale = 1.0 / math.sqrt(h) if scale is None else scale
  # Masked scores get a large finite negative (see MASKED); a row always sees its own
  # position (causal, same document), so no row is all masked.
  bias_Bx1xTxT = jnp.where(mask_Bx1xTxT, 0.0, MASKED).astype(jnp.float32)
  f32 = jnp.float32
  # Keys and values enter the block loop in float32 (each block's product casts its slice to
  # the compute dtype): the backward pass sums every query block's key / value gradient
  # (one padded slice per block), and in bfloat16 XLA:CPU ran each of those sums as a
  # convert-add-convert pass: 15 % of the bf16 step at configs/stdlib_mtp.py.
  # (The saved core's own backward sums them in float32 already.)
  kv_dtype = k_BxTxKxH.dtype if saved_core and g == 1 else f32
  k_BxKxTxH = jnp.transpose(k_BxTxKxH.astype(kv_dtype), (0, 2, 1, 3))
  v_BxKxTxH = jnp.transpose(v_BxTxKxH.astype(kv_dtype), (0, 2, 1, 3))
  if g == 1:  # no GQA: 4-D [B, N, ., .] throughout (measured faster on XLA:CPU than the 5-D form)
    q_BxNxTxH = jnp.transpose(q_BxTxNxH * scale, (0, 2, 1, 3))
    if saved_core:
      return jnp.transpose(_saved_core(q_BxNxTxH, k_BxKxTxH, v_BxKxTxH, bias_Bx1xTxT, block),
                           (0, 2, 1, 3))
    outs = []
    for a in range(0, t, block):
      e = min(a + block, t)
      s_BxNxTqxTk = matmul.einsum('bnqh,bnsh->bnqs', q_BxNxTxH[:, :, a:e], k_BxKxTxH[:, :, :e],
                                  q_BxNxTxH.dtype, f32) + bias_Bx1xTxT[:, :, a:e, :e]
      row_max = jax.lax.stop_gradient(jnp.max(s_BxNxTqxTk, axis=-1, keepdims=True))
      p_BxNxTqxTk = jnp.exp(s_BxNxTqxTk - row_max)
      o_BxNxTqxH = matmul.einsum('bnqs,bnsh->bnqh', p_BxNxTqxTk.astype(v_BxTxKxH.dtype),
                                 v_BxKxTxH[:, :, :e], v_BxTxKxH.dtype, f32)
      outs.append((o_BxNxTqxH / jnp.sum(p_BxNxTqxTk, axis=-1, keepdims=True)
                   ).astype(q_BxTxNxH.dtype))
    return jnp.transpose(jnp.concatenate(outs, axis=2), (0, 2, 1, 3))
  q_BxKxGxTxH = jnp.transpose((q_BxTxNxH * scale).reshape(b, t, kv, g, h), (0, 2, 3, 1, 4))
  outs = []
  for a in range(0, t, block):
    e = min(a + block, t)
    # the G query heads of a KV head stacked along the query axis: 4-D dots [B, K, G*Tq, .]
    q_BxKxGTqxH = q_BxKxGxTxH[:, :, :, a:e].reshape(b, kv, g * (e - a), h)
    s_BxKxGTqxTk = matmul.einsum('bkqh,bksh->bkqs', q_BxKxGTqxH, k_BxKxTxH[:, :, :e],
                                 q_BxKxGTqxH.dtype, f32)
    s_BxKxGxTqxTk = s_BxKxGTqxTk.reshape(b, kv, g, e - a, e) + bias_Bx1xTxT[:, :, None, a:e, :e]
    row_max = jax.lax.stop_gradient(jnp.max(s_BxKxGxTqxTk, axis=-1, keepdims=True))
    p_BxKxGxTqxTk = jnp.exp(s_BxKxGxTqxTk - row_max)
    p_BxKxGTqxTk = p_BxKxGxTqxTk.reshape(b, kv, g * (e - a), e).astype(v_BxTxKxH.dtype)
    o_BxKxGTqxH = matmul.einsum('bkqs,bksh->bkqh', p_BxKxGTqxTk, v_BxKxTxH[:, :, :e],
                                v_BxTxKxH.dtype, f32)
    o_BxKxGxTqxH = (o_BxKxGTqxH.reshape(b, kv, g, e - a, h)
                    / jnp.sum(p_BxKxGxTqxTk, axis=-1, keepdims=True))
    outs.append(o_BxKxGxTqxH.astype(q_BxTxNxH.dtype))
  o_BxKxGxTxH = jnp.concatenate(outs, axis=3)
  return jnp.transpose(o_BxKxGxTxH, (0, 3, 1, 2, 4)).reshape(b, t, n, h)


# The names under which remat='block' (model.remat_policy) saves the custom-VJP core's
# residuals: with them saved its backward never reruns its forward.
QKV_SAVED_NAME = 'attention_qkv_heads_major'
# the kernel cores' residuals (output, row log-sum-exp, their inputs: _saved_kernel)
KERNEL_SAVED_NAME = 'attention_kernel_residuals'
ATTENTION_SAVED_NAMES = ('attention_out', 'attention_lse', QKV_SAVED_NAME, KERNEL_SAVED_NAME)


def _query_blocks(t: int, block: int) -> list:
  return [(a, min(a + block, t)) for a in range(0, t, block)]


def _block_scores(q_BxNxTxH, k_BxNxTxH, bias_Bx1xTxT, a: int, e: int) -> Array:
  """Scores of query block [a, e) against keys [0, e), masked by the additive bias:
  [B, N, Tq, Tk]."""
  return matmul.einsum('bnqh,bnsh->bnqs', q_BxNxTxH[:, :, a:e], k_BxNxTxH[:, :, :e],
                       q_BxNxTxH.dtype, jnp.float32) + bias_Bx1xTxT[:, :, a:e, :e]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _saved_core(q_BxNxTxH, k_BxNxTxH, v_BxNxTxH, bias_Bx1xTxT, block: int) -> Array:
  """The blocked core (heads-major, no GQA, q pre-scaled) with a flash-style backward."""
  return _saved_core_fwd(q_BxNxTxH, k_BxNxTxH, v_BxNxTxH, bias_Bx1xTxT, block)[0]


def _saved_core_fwd(q, k, v, bias, block):
  outs, lses = [], []
  for a, e in _query_blocks(q.shape[2], block):
    s_BxNxTqxTk = _block_scores(q, k, bias, a, e)
    m_BxNxTqx1 = jnp.max(s_BxNxTqxTk, axis=-1, keepdims=True)
    p_BxNxTqxTk = jnp.exp(s_BxNxTqxTk - m_BxNxTqx1)
    l_BxNxTqx1 = jnp.sum(p_BxNxTqxTk, axis=-1, keepdims=True)
    o_BxNxTqxH = matmul.einsum('bnqs,bnsh->bnqh', p_BxNxTqxTk.astype(v.dtype), v[:, :, :e],
                               v.dtype, jnp.float32) / l_BxNxTqx1
    outs.append(o_BxNxTqxH.astype(q.dtype))
    lses.append(m_BxNxTqx1 + jnp.log(l_BxNxTqx1))
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
    p_BxNxTqxTk = jnp.exp(_block_scores(q, k, bias, a, e) - lse[:, :, a:e])
    do_BxNxTqxH = do_BxNxTxH[:, :, a:e]
    dt = do_BxNxTqxH.dtype
    dvs.append(matmul.einsum_lhs_t('bnqs,bnqh->bnsh', p_BxNxTqxTk.astype(dt), do_BxNxTqxH, dt, f32))
    dp_BxNxTqxTk = matmul.einsum('bnqh,bnsh->bnqs', do_BxNxTqxH, v[:, :, :e].astype(dt), dt, f32)
    ds_BxNxTqxTk = p_BxNxTqxTk * (dp_BxNxTqxTk - delta_BxNxTx1[:, :, a:e])
    dqs.append(matmul.einsum('bnqs,bnsh->bnqh', ds_BxNxTqxTk.astype(k.dtype), k[:, :, :e],
                             k.dtype, f32).astype(q.dtype))
    dks.append(matmul.einsum_lhs_t('bnqs,bnqh->bnsh', ds_BxNxTqxTk.astype(q.dtype), q[:, :, a:e],
                                   q.dtype, f32))

  def keys_sum(parts):  # block row [a, e)'s key gradients cover keys [0, e): pad to T, add
    return sum(jnp.pad(x, ((0, 0), (0, 0), (0, t - x.shape[2]), (0, 0))) for x in parts)
  return (jnp.concatenate(dqs, axis=2), keys_sum(dks).astype(k.dtype),
          keys_sum(dvs).astype(v.dtype), jnp.zeros_like(bias))


_saved_core.defvjp(_saved_core_fwd, _saved_core_bwd)


# -- the Pallas kernels: splash (TPU) and the Triton flash kernel (GPU) ----------------------
@jax.named_scope(profiling.ATTENTION_SCOPE)
def kernel_attention(impl: str, q_BxTxNxH: Array, k_BxTxKxH: Array, v_BxTxKxHv: Array,
                     segment_ids_BxT: Array, scale: float, block_q: int = 512,
                     block_kv: int = 512) -> Array:
  """softmax(q k^T * scale) v, causal within each document (segment), by the kernel of
  `impl` ('splash' or 'triton'), per shard of the mesh in context: [B, T, N, Hv].

  GQA: query head n uses kv head n // (N / K). The value width Hv may differ from the
  query / key width H (MLA): splash takes it as it is; the Triton kernel wants one
  width, so v is zero-padded to H there and the output's extra columns sliced off.
  Pallas interpret mode (exact, slow) off the kernel's backend. Shapes the kernel
  cannot take raise ConfigError (attention_kernel_problem) while tracing,
  before anything compiles.
  """
  problem = attention_kernel_problem(impl, q_BxTxNxH.shape[1], block_q, block_kv,
                                     q_BxTxNxH.shape[3])
  if problem:
    raise ConfigError(problem)
  # compiled on the kernel's own backend, Pallas interpret mode anywhere else (CPU: tests)
  interpret = jax.default_backend() not in KERNEL_BACKENDS[impl]
  if impl == 'splash':
    local = functools.partial(_splash_local, scale=scale, block_q=block_q, block_kv=block_kv,
                              interpret=interpret)
  elif impl == 'triton':
    local = functools.partial(_triton_local, scale=scale, interpret=interpret)
  else:
    raise ValueError(f'no attention kernel {impl!r}')
  return _per_shard(local, q_BxTxNxH, k_BxTxKxH, v_BxTxKxHv, segment_ids_BxT)


def _per_shard(fn, q_BxTxNxH, k_BxTxKxH, v_BxTxKxHv, seg_BxT):
  """fn(q, k, v, seg) on each device's shard in jax.shard_map over the mesh in context:
  rows over the mesh axes of the 'batch' rule, heads over those of 'act_heads' (q and
  k / v alike, so a shard holds whole GQA groups), each only where it divides the
  array; whatever does not divide stays whole on every device. fn itself outside a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not flax_spmd.get_logical_axis_rules():
    return fn(q_BxTxNxH, k_BxTxKxH, v_BxTxKxHv, seg_BxT)

  def axes(logical: str, *sizes: int):
    spec = sharding.logical_spec((logical,))[0]
    names = () if spec is None else (tuple(spec) if isinstance(spec, (tuple, list)) else (spec,))
    ways = math.prod(mesh.shape[a] for a in names)
    return (names if len(names) > 1 else names[0]) if names and all(
        s % ways == 0 for s in sizes) else None

  rows = axes('batch', q_BxTxNxH.shape[0])
  heads = axes('act_heads', q_BxTxNxH.shape[2], k_BxTxKxH.shape[2])
  qkv = P(rows, None, heads, None)
  return jax.shard_map(fn, mesh=mesh, in_specs=(qkv, qkv, qkv, P(rows, None)), out_specs=qkv,
                       check_vma=False)(q_BxTxNxH, k_BxTxKxH, v_BxTxKxHv, seg_BxT)


def _splash_local(q_BxTxNxH, k_BxTxKxH, v_BxTxKxHv, seg_BxT, *, scale, block_q, block_kv,
                  interpret):
  """One shard through the Pallas TPU splash kernel (make_splash_mha: causal mask, segment
  ids, vmapped over rows). Its multi-head form takes K <= N kv heads and maps query head
  n to kv head n // (N / K): grouped-query attention with no K / V repeated in memory.
  Blocks of block_q queries x block_kv keys (at most T) in the forward and both backward
  kernels (dq, dkv); its residuals are named for remat (_saved_kernel)."""
  # Deferred: the Pallas TPU kernels load only where the splash core is chosen.
  import jax.experimental.pallas.ops.tpu.splash_attention as splash
  _, t, n, _ = q_BxTxNxH.shape
  bq, bkv = min(block_q, t), min(block_kv, t)
  sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                            block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq,
                            block_kv_dq=bkv)
  # its block tables (which blocks the causal mask keeps) are arrays: the kernel object is
  # a pytree, passed as an argument (_saved_kernel), never closed over
  kernel = splash.make_splash_mha(splash.MultiHeadMask([splash.CausalMask((t, t))] * n),
                                  block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)
  heads_major = lambda x: jnp.transpose(x, (0, 2, 1, 3))
  q_BxNxTxH = heads_major((q_BxTxNxH * scale).astype(q_BxTxNxH.dtype))
  k_BxKxTxH = heads_major(k_BxTxKxH.astype(q_BxTxNxH.dtype))
  v_BxKxTxHv = heads_major(v_BxTxKxHv.astype(q_BxTxNxH.dtype))
  return heads_major(_saved_kernel(_splash_rows, kernel, q_BxNxTxH, k_BxKxTxH, v_BxKxTxHv,
                                   seg_BxT))


def _splash_rows(kernel, q_BxNxTxH, k_BxKxTxH, v_BxKxTxHv, seg_BxT):
  """The splash kernel (one sequence at a time) vmapped over rows."""
  # Deferred: as in _splash_local.
  import jax.experimental.pallas.ops.tpu.splash_attention as splash
  return jax.vmap(lambda q, k, v, seg: kernel(q, k, v, splash.SegmentIds(q=seg, kv=seg)))(
      q_BxNxTxH, k_BxKxTxH, v_BxKxTxHv, seg_BxT)


def _triton_local(q_BxTxNxH, k_BxTxKxH, v_BxTxKxHv, seg_BxT, *, scale, interpret):
  """One shard through the Pallas GPU flash kernel (`mha`: causal, segment ids, its own
  Triton backward; residuals named for remat by _saved_kernel). It takes one head count
  and one head width for q, k and v: GQA's kv heads are repeated (a [B, T, N, H] copy, no
  scores) and v is zero-padded to H. Its blocks follow the head width
  (TRITON_BLOCKS), so that MLA's 192-wide heads fit a GPU's shared memory."""
  n, kv, v_width = q_BxTxNxH.shape[2], k_BxTxKxH.shape[2], v_BxTxKxHv.shape[3]
  dt = q_BxTxNxH.dtype
  k, v = k_BxTxKxH.astype(dt), v_BxTxKxHv.astype(dt)
  if kv != n:
    k, v = jnp.repeat(k, n // kv, axis=2), jnp.repeat(v, n // kv, axis=2)
  pad = q_BxTxNxH.shape[3] - v_width
  if pad:
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, pad)))
  call = functools.partial(_triton_call, scale=scale, interpret=interpret,
                           blocks=triton_blocks(q_BxTxNxH.shape[3]))
  return _saved_kernel(call, None, q_BxTxNxH, k, v, seg_BxT)[..., :v_width]


def _triton_call(kernel, q, k, v, seg, *, scale, interpret, blocks):
  """The Triton `mha`, its forward and backward blocks by head width
  (TRITON_BLOCKS)."""
  del kernel  # the Triton kernel has no per-shape tables
  # Deferred: the Pallas GPU kernels load only where the triton core is chosen.
  import jax.experimental.pallas.ops.gpu.attention as gpu_attention
  names = ('block_q', 'block_k', 'block_q_dkv', 'block_kv_dkv', 'block_q_dq', 'block_kv_dq')
  sizes = gpu_attention.BlockSizes(**dict(zip(names, blocks)))
  return gpu_attention.mha(q, k, v, seg, sm_scale=scale, causal=True, block_sizes=sizes,
                           interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _saved_kernel(call, kernel, q, k, v, seg):
  """call(kernel, q, k, v, seg): a Pallas attention call with its own custom VJP (kernel:
  its pytree of tables, or None), with every residual of its forward named
  KERNEL_SAVED_NAME: under remat='block' the policy keeps them and the backward runs
  only the kernel's backward. (Applied to the library call directly, a name-based
  policy reran the forward kernel in the backward pass: four kernel calls per layer
  instead of three.)"""
  return call(kernel, q, k, v, seg)


def _saved_kernel_fwd(call, kernel, q, k, v, seg):
  out, vjp_fn = jax.vjp(lambda q, k, v: call(kernel, q, k, v, seg), q, k, v)
  name = lambda x: checkpoint_name(x, KERNEL_SAVED_NAME)
  return name(out), jax.tree.map(name, vjp_fn)  # vjp_fn's leaves: the kernel's residuals


def _saved_kernel_bwd(call, vjp_fn, do):
  del call
  return (None, *vjp_fn(do), None)


_saved_kernel.defvjp(_saved_kernel_fwd, _saved_kernel_bwd)


# -- context parallelism: K / V all-gathered over the context axes, queries local ----------
def context_attention(impl: str, q_BxTxNxH: Array, k_BxTxKxH: Array, v_BxTxKxHv: Array,
                      segment_ids_BxT: Array, scale: float, block_q: int = 512,
                      block_kv: int = 512) -> Array:
  """Attention of a step in context parallelism's balanced layout (model/context.py): each
  shard keeps its own queries and all-gathers the keys, values and segment ids over the
  context axes (MaxText's default strategy); a query sees a key when the key's natural
  index is not later and both are in one document. [B, T, N, Hv], in the layout.

  splash: the TPU kernel with a mask over natural indices (_layout_splash_kernel), its
  block tables split over the context shards, the gathered keys put back in the natural
  order so that the kernel skips every block the causal mask removes. The other cores
  (blocked, xla, and the GPU kernel, whose causal form needs queries and keys of one
  length) take the dense masked product per shard: every shard does the same work, the
  whole key range, about twice the causal minimum.
  """
  layout = context_lib.active()
  mesh = jax.sharding.get_abstract_mesh()
  ctx = layout.axes if len(layout.axes) > 1 else layout.axes[0]
  b, t, n, _ = q_BxTxNxH.shape
  rows = _shard_axes(mesh, 'batch', b)
  heads = _shard_axes(mesh, 'act_heads', n, k_BxTxKxH.shape[2])
  q_spec, kv_spec = P(rows, ctx, heads, None), P(rows, None, heads, None)
  # one int array holds the shard's query segment ids, then all T of the keys'
  seg = jnp.concatenate([segment_ids_BxT, segment_ids_BxT], axis=1)
  seg_spec = P(rows, None)
  local_q = t // layout.ways
  if impl == 'splash':
    problem = attention_kernel_problem(impl, local_q, block_q, block_kv,
                                       q_BxTxNxH.shape[3])
    if problem:
      raise ConfigError(problem + f' (per context shard: {local_q} tokens)')
    n_local = n // _ways(mesh, heads)
    kernel = _layout_splash_kernel(layout, n_local, min(block_q, local_q), min(block_kv, t),
                                   jax.default_backend() not in KERNEL_BACKENDS['splash'])
    kernel_spec = kernel.manual_sharding_spec(jax.sharding.NamedSharding(mesh, P(None, ctx)))
    fn = functools.partial(_context_splash_local, order=layout.order, inverse=layout.inverse,
                           ways=layout.ways, axes=layout.axes, scale=scale)
    return jax.shard_map(fn, mesh=mesh, in_specs=(kernel_spec, q_spec, kv_spec, kv_spec, seg_spec),
                         out_specs=q_spec, check_vma=False)(
                             kernel, q_BxTxNxH, k_BxTxKxH, v_BxTxKxHv, seg)
  fn = functools.partial(_context_dense_local, order=layout.order, ways=layout.ways,
                         axes=layout.axes, scale=scale)
  return jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
                       out_specs=q_spec, check_vma=False)(q_BxTxNxH, k_BxTxKxH, v_BxTxKxHv, seg)


def _ways(mesh, names) -> int:
  if names is None:
    return 1
  names = names if isinstance(names, tuple) else (names,)
  return math.prod(mesh.shape[a] for a in names)


def _shard_axes(mesh, logical: str, *sizes: int):
  """The mesh axes of a logical rule where they divide every size, else None (whole)."""
  spec = sharding.logical_spec((logical,))[0]
  names = () if spec is None else (tuple(spec) if isinstance(spec, (tuple, list)) else (spec,))
  ways = math.prod(mesh.shape[a] for a in names)
  return (names if len(names) > 1 else names[0]) if names and all(
      s % ways == 0 for s in sizes) else None


def _shard_queries(seg, order, ways, axes):
  """(this shard's query segment ids [b, T / ways], all keys' segment ids [b, T], the
  natural index of each of this shard's queries [T / ways])."""
  t = order.shape[0]
  local = t // ways
  i = jax.lax.axis_index(axes)
  seg_q_all, seg_kv = seg[:, :t], seg[:, t:]
  seg_q = jax.lax.dynamic_slice_in_dim(seg_q_all, i * local, local, axis=1)
  q_nat = jax.lax.dynamic_slice_in_dim(jnp.asarray(order), i * local, local)
  return seg_q, seg_kv, q_nat


def _context_dense_local(q_BxTqxNxH, k_BxTxKxH, v_BxTxKxHv, seg, *, order, ways, axes, scale):
  """One shard's queries against every key, masked by natural index and segment."""
  seg_q, seg_kv, q_nat = _shard_queries(seg, order, ways, axes)
  mask = ((jnp.asarray(order)[None, None, :] <= q_nat[None, :, None])
          & (seg_q[:, :, None] == seg_kv[:, None, :]))[:, None]
  dt = q_BxTqxNxH.dtype
  width = max(q_BxTqxNxH.shape[-1], v_BxTxKxHv.shape[-1])
  pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])
  out = jax.nn.dot_product_attention(pad(q_BxTqxNxH), pad(k_BxTxKxH).astype(dt),
                                     pad(v_BxTxKxHv).astype(dt), mask=mask, scale=scale)
  return out[..., :v_BxTxKxHv.shape[-1]]


def _context_splash_local(kernel, q_BxTqxNxH, k_BxTxKxH, v_BxTxKxHv, seg, *, order, inverse,
                          ways, axes, scale):
  """One shard through the splash kernel of _layout_splash_kernel: its queries (natural
  indices from the kernel's own q_sequence shard) against the gathered keys put back in
  the natural order."""
  del order, ways
  t = inverse.shape[0]
  local = q_BxTqxNxH.shape[1]
  i = jax.lax.axis_index(axes)
  seg_q = jax.lax.dynamic_slice_in_dim(seg[:, :t], i * local, local, axis=1)
  natural = lambda x: jnp.take(x, jnp.asarray(inverse), axis=1)
  seg_kv = natural(seg[:, t:])
  heads_major = lambda x: jnp.transpose(x, (0, 2, 1, 3))
  dt = q_BxTqxNxH.dtype
  q = heads_major((q_BxTqxNxH * scale).astype(dt))
  k = heads_major(natural(k_BxTxKxH).astype(dt))
  v = heads_major(natural(v_BxTxKxHv).astype(dt))
  both = jnp.concatenate([seg_q, seg_kv], axis=1)
  return heads_major(_saved_kernel(_splash_rows_two, kernel, q, k, v, both))


def _splash_rows_two(kernel, q_BxNxTqxH, k_BxKxTxH, v_BxKxTxHv, seg):
  """The splash kernel vmapped over rows; seg holds the query then the key segment ids."""
  # Deferred: as in _splash_local.
  import jax.experimental.pallas.ops.tpu.splash_attention as splash
  tq = q_BxNxTqxH.shape[2]
  return jax.vmap(lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(q=s[:tq], kv=s[tq:])))(
      q_BxNxTqxH, k_BxKxTxH, v_BxKxTxHv, seg)


@functools.lru_cache(maxsize=1)
def _layout_mask_class():
  # Deferred: as in _splash_local.
  import jax.experimental.pallas.ops.tpu.splash_attention as splash
  mask_lib = splash.splash_attention_mask

  class LayoutCausalMask(mask_lib._ComputableMask):  # pylint: disable=protected-access
    """Causal by natural index, the queries in the balanced layout (q_sequence: each
    query row's natural index), the keys in the natural order."""

    def __init__(self, order: np.ndarray):
      super().__init__((len(order), len(order)), mask_function=lambda q, kv: q >= kv)
      self.q_sequence = np.asarray(order, np.int32)
      self._key = (len(order), self.q_sequence.tobytes())

    def __eq__(self, other):
      return isinstance(other, LayoutCausalMask) and self._key == other._key

    def __hash__(self):
      return hash(self._key)

  return LayoutCausalMask


def _layout_splash_kernel(layout, heads: int, bq: int, bkv: int, interpret: bool):
  """The splash kernel over a whole sequence in the layout, its block tables in one part
  per context shard (q_seq_shards): each shard runs the rows of its own queries. Built per
  trace, as _splash_local's (its tables are arrays, passed in, never closed over); the
  library caches the mask processing by the mask's hash."""
  # Deferred: the Pallas TPU kernels load only where the splash core is chosen.
  import jax.experimental.pallas.ops.tpu.splash_attention as splash
  mask = _layout_mask(layout.length, layout.ways)
  sizes = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                            block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq,
                            block_kv_dq=bkv)
  return splash.make_splash_mha(splash.MultiHeadMask([mask] * heads), block_sizes=sizes,
                                head_shards=1, q_seq_shards=layout.ways, interpret=interpret)


@functools.lru_cache(maxsize=16)
def _layout_mask(length: int, ways: int):
  """One mask object per layout, so the library's cache of processed masks finds it."""
  return _layout_mask_class()(context_lib.balanced_order(length, ways))
