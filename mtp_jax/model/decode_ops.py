"""Decode-time products: the KV cache layouts and the few-row matmuls of a decode step.

A decode step multiplies a few rows (batch x window) by every weight. XLA:CPU runs those
fastest in a tall-skinny form kept behind an optimization barrier; this module holds that
rule (`decode_dot`, `few_query_dot`) and the cache helpers the layers' `decode` paths use.
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx

import mtp_jax

Array = jax.Array


def write_cache(cache_BxSxKxH: Array, new_BxTxKxH: Array, index_B: Array) -> Array:
  """Writes each row's new entries at that row's own offset."""
  def one(c, n, i):
    return jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), i, axis=0)
  return jax.vmap(one)(cache_BxSxKxH, new_BxTxKxH, index_B)


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
  return empty_kv(batch, slots, cfg.n_kv_heads, cfg.head_dim, cfg.dtype, layout)


def cache_slot_axes(cache: tuple, layout: str) -> tuple:
  """The slot axis of each array of one block's cache: GQA 'heads_major' k [B*K, S, H] and
  v [B*K, H, S], 'bskh' k, v [B, S, K, H], MLA's latent [B, S, C] in either layout."""
  if len(cache) == 1:
    return (1,)
  return (1, 2) if layout == 'heads_major' else (1, 1)


def empty_kv(batch: int, slots: int, k: int, h: int, dtype, layout: str) -> tuple:
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
# (benchmarks/few_row_check.py, docs/benchmarks.md "Few-row products", and a 768 x 2048
# check of 1-128 rows: the barrier form beats x W_t^T up to 64 rows, 882 vs 1185 us at 32,
# equal at 128): with W_t stored O x I the tall-skinny product W_t x^T (dot_general over
# W_t's axis 1 and x's axis 1, output [O, M] kept in that layout by an optimization barrier,
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
# 1.9-3.4, 16 rows 1.3-2.4), so the M = 3 MTP windows of 5 and 6 rows run as 8.
ROW_MULTIPLE = 8
WRITE_LOOP_ROWS = 6  # cache updates: one in-place update per row up to here, else a scatter

_CONTRACT_1_1 = (((1,), (1,)), ((), ()))


def _padded_rows(m: int) -> int:
  """Rows a tall-skinny product of m rows runs with: m up to 4, else the next multiple of
  ROW_MULTIPLE."""
  return m if m <= 4 else -(-m // ROW_MULTIPLE) * ROW_MULTIPLE


def decode_dot(x_BTxI: Array, w_OxI: Array) -> Array:
  """x @ w_OxI.T for a decode step of M = batch x window rows, by the rule above.

  Accumulates in float32; returns x's dtype.
  """
  m, out_dtype = x_BTxI.shape[0], x_BTxI.dtype
  f32 = jnp.float32
  if w_OxI.dtype == jnp.bfloat16 or jax.default_backend() != 'cpu':
    x = x_BTxI.astype(w_OxI.dtype)
    pad = m == 1 and w_OxI.dtype == jnp.bfloat16 and jax.default_backend() == 'cpu'
    if pad:
      x = jnp.concatenate([x, jnp.zeros_like(x)], 0)
    y = jax.lax.dot_general(x, w_OxI, _CONTRACT_1_1, preferred_element_type=f32)
    return (y[:1] if pad else y).astype(out_dtype)
  w_OxI = w_OxI.astype(out_dtype)
  if m == 1:  # a GEMV; its [O, 1] -> [1, O] transpose is a bitcast
    return jax.lax.dot_general(x_BTxI, w_OxI, _CONTRACT_1_1, preferred_element_type=f32
                               ).astype(out_dtype)
  if m <= TALL_ROWS:  # verify / MTP windows, up to batch 8-16
    # The barrier keeps the [O, M] product in that layout: without it XLA:CPU's layout
    # assignment makes the transpose free by laying the dot's output out as [M, O],
    # which is the slow GEMM again (1.5-3x at 2-8 rows).
    mp = _padded_rows(m)
    x = x_BTxI if mp == m else jnp.pad(x_BTxI, ((0, mp - m), (0, 0)))
    y_OxBT = jax.lax.optimization_barrier(
        jax.lax.dot_general(w_OxI, x, _CONTRACT_1_1, preferred_element_type=f32))
    return y_OxBT[:, :m].T.astype(out_dtype)
  return jax.lax.dot_general(x_BTxI, w_OxI, _CONTRACT_1_1,
                             preferred_element_type=f32).astype(out_dtype)


# The attention core of a few-query step, by the same rule: its two products, scores
# q k^T and probs v, each multiply a few query rows by a cache-long matrix per KV head.
# As einsums over [queries, ...] x [slots, ...] XLA:CPU runs them (YNNPACK, >= 2 queries)
# as the slow GEMM form: at 4 queries a trunk pass's attention cost 4x the 1-query one
# (0.4 AR step at d 768 / L 12); the tall-skinny form, [slots, queries] behind a barrier,
# then the small transpose, cut a 4-row trunk pass from 1.40 to 1.26 one-row passes.
# One query (an AR step), prefill-sized
# windows and other backends keep the einsum. The form is chosen while tracing:
# Decoder(tall_attention=False) traces its programs under tall_attention(False).
_TALL_ATTENTION = contextvars.ContextVar('tall_attention', default=True)


@contextlib.contextmanager
def tall_attention(enabled: bool):
  """Whether few_query_dot may use the tall-skinny form in what is traced inside."""
  token = _TALL_ATTENTION.set(enabled)
  try:
    yield
  finally:
    _TALL_ATTENTION.reset(token)


def few_query_dot(a_BKxGTxI, b_BKxOxI, out_dtype):
  """[BK, GT, O] = a b^T per leading index, contracting I; GT few rows (decode_dot's rule)."""
  q = a_BKxGTxI.shape[1]
  if not _TALL_ATTENTION.get() or q == 1 or q > TALL_ROWS or jax.default_backend() != 'cpu':
    return jnp.einsum('xqc,xrc->xqr', a_BKxGTxI, b_BKxOxI,
                      preferred_element_type=jnp.float32).astype(out_dtype)
  qp = _padded_rows(q)
  a = a_BKxGTxI if qp == q else jnp.pad(a_BKxGTxI, ((0, 0), (0, qp - q), (0, 0)))
  y_BKxOxGT = jax.lax.optimization_barrier(
      jnp.einsum('xrc,xqc->xrq', b_BKxOxI, a, preferred_element_type=jnp.float32))
  return y_BKxOxGT[:, :, :q].transpose(0, 2, 1).astype(out_dtype)


def write_heads_major(cache_BKx, new_BxKx, index_B, axis):
  """Row b's T new entries go to slots index_B[b].. along `axis` (1 or 2) of its K heads
  (any cache [B*K, ...]: new_BxKx is [B, K, ...] with T at axis + 1)."""
  b, kv = new_BxKx.shape[:2]
  new_BxKx = new_BxKx.astype(cache_BKx.dtype)
  if b > WRITE_LOOP_ROWS:
    cache = cache_BKx.reshape((b, kv) + cache_BKx.shape[1:])
    cache = jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice_in_dim(c, n, i, axis))(
        cache, new_BxKx, index_B)
    return cache.reshape(cache_BKx.shape)
  zero = jnp.zeros((), jnp.int32)  # few rows: one in-place update each, no scatter
  for row in range(b):
    start = [jnp.int32(row * kv)] + [zero] * (cache_BKx.ndim - 1)
    start[axis] = index_B[row]
    cache_BKx = jax.lax.dynamic_update_slice(cache_BKx, new_BxKx[row], start)
  return cache_BKx


def __getattr__(name: str):  # a name an earlier release had here: mtp_jax.MOVED_NAMES
  return mtp_jax.moved_name(__name__, name)
