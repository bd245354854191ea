"""The one form of the model's matrix products (`matmul`, `einsum`), by compute dtype and backend.

On TPU / GPU (and float16 anywhere): the plain `jnp.dot` / `jnp.einsum` of the operands cast
to the compute dtype, autodiff for the backward; the same HLO as writing the dot inline, so
these programs are unchanged by routing through here. float32 `einsum` (the attention
cores, the loss head) is that plain form on CPU too.

bfloat16 on CPU: XLA:CPU runs a dot on its bf16 kernels (a `ynn_fusion` of XNNPACK, with AMX
or AVX-512 BF16 where the CPU has them) only as `dot(bf16, bf16, preferred_element_type=f32)`
whose left operand is contracted on its last axis (not transposed); a bf16 -> bf16 dot, a
mixed f32 x bf16 dot, or one whose left operand is transposed is converted to f32 and runs
as an f32 dot. Plain autodiff of a bf16 model produces all three (every forward projection,
the attention and loss-head backward, every weight gradient x^T dy), so here the forward
and both gradient products are written in the one fast form by a custom VJP (`_cpu_dot`):
bf16 operands, f32 accumulation, the transpose of a gradient's left operand written as a
reshape / transpose pair that XLA materialises as a copy (`_transposed`) instead of folding
it into the dot. Weight gradients leave in the weight's own dtype (float32 master weights)
straight from the f32 accumulator.

float32 `matmul` on CPU (every 2-D projection): the same custom VJP in float32. Autodiff's
weight gradient x^T dy is a dot with a transposed left operand, which XLA:CPU runs on its
generic dot outside XNNPACK; in a profile of configs/stdlib_mtp.py's float32 step those 52
dots and the idle time after each were about a fifth of the step. With x^T materialised
the weight gradient is a row-major XNNPACK dot like the rest.

The backend is decided when the program is traced (`jax.default_backend()`, which the AOT
compile tool sets to its target platform while it builds a program).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

Array = jax.Array
BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.float32


# Backends whose compiler fuses the elementwise backward that follows a matmul into that
# matmul's output (unfused_cotangent): TPU's.
UNFUSED_COTANGENT_BACKENDS = ('tpu',)


def unfused_cotangent(ct: Array) -> Array:
  """ct itself, written out whole before the elementwise backward that reads it (an
  optimization barrier) where the backend is in UNFUSED_COTANGENT_BACKENDS.

  Used by the RMSNorm backward (layers._rms_vjp_bwd): the TPU compiler otherwise fuses
  its float32 row reductions into the output of the matmul that produced dy and prices
  that fusion at about twice the matmul alone; a separate pass over the written dy costs
  less (docs/scaling.md, which also prices the places where it does not pay)."""
  if jax.default_backend() in UNFUSED_COTANGENT_BACKENDS:
    return jax.lax.optimization_barrier(ct)
  return ct


def bf16_kernels(dtype) -> bool:
  """Whether products in compute `dtype` take the CPU bf16 form (`_cpu_dot`) here."""
  return jnp.dtype(dtype) == BF16 and jax.default_backend() == 'cpu'


def row_major_f32(dtype) -> bool:
  """Whether float32 projections take the row-major form (`_cpu_dot` in float32) here."""
  return jnp.dtype(dtype) == jnp.float32 and jax.default_backend() == 'cpu'


def matmul(x_NxI: Array, w_IxO: Array, dtype, out_dtype=None) -> Array:
  """x @ w (2-D) in compute `dtype`; the result in `out_dtype` (default `dtype`).

  Accelerators (and float16): `jnp.dot(x.astype(dtype), w.astype(dtype),
  preferred_element_type=out_dtype)`; on CPU, bfloat16 and float32 alike: `_cpu_dot`, whose
  weight gradient x^T dy has a row-major left operand (module docstring)."""
  if bf16_kernels(dtype):
    return _cpu_dot(x_NxI, w_IxO, 0, False, jnp.dtype(out_dtype or dtype), BF16)
  if row_major_f32(dtype):
    return _cpu_dot(x_NxI, w_IxO, 0, False, jnp.dtype(out_dtype or dtype), jnp.dtype(F32))
  return jnp.dot(x_NxI.astype(dtype), w_IxO.astype(dtype), preferred_element_type=out_dtype)


def einsum(spec: str, a: Array, b: Array, dtype, out_dtype=None) -> Array:
  """A two-operand batched matmul `spec` in compute `dtype`, result in `out_dtype`.

  spec: '<batch><m...><k>,<batch><k><n>-><batch><m...><n>', or with the right operand
  '<batch><n><k>' (b transposed, e.g. q k^T): batch letters lead both operands and the
  output in the same order, one contracted letter k, one free letter n of b. float32 /
  accelerators: `jnp.einsum(spec, ...)` itself; bfloat16 on CPU: `_cpu_dot`.
  """
  if not bf16_kernels(dtype):
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=out_dtype)
  batch, rhs_t = parse_spec(spec)
  return _cpu_dot(a, b, batch, rhs_t, jnp.dtype(out_dtype or dtype), BF16)


def einsum_lhs_t(spec: str, a: Array, b: Array, dtype, out_dtype=None) -> Array:
  """`einsum` of a left operand contracted on its second-to-last axis: spec
  '<batch><k><m>,<batch><k><n>-><batch><m><n>' (a^T b, e.g. a weight or key gradient).
  bfloat16 on CPU: a^T is materialised (`_transposed`) and the product is `einsum`'s."""
  if not bf16_kernels(dtype):
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=out_dtype)
  (lhs, rhs), out = spec.replace(' ', '').split('->')[0].split(','), spec.split('->')[1].strip()
  batch = len(lhs) - 2
  flipped = f'{lhs[:batch]}{lhs[-1]}{lhs[-2]},{rhs}->{out}'
  return einsum(flipped, _transposed(a.astype(BF16), batch), b, dtype, out_dtype)


@functools.cache
def parse_spec(spec: str) -> tuple[int, bool]:
  """(batch axes, whether b is [batch, n, k]) of an `einsum` spec; ValueError otherwise."""
  ins, out = spec.replace(' ', '').split('->')
  lhs, rhs = ins.split(',')
  batch = 0
  while batch < min(len(lhs), len(rhs)) - 1 and lhs[batch] == rhs[batch] == out[batch]:
    batch += 1
  k = lhs[-1]
  m = lhs[batch:-1]
  tail = rhs[batch:]
  ok = len(rhs) == batch + 2 and k in tail and k not in out and len(m) >= 1
  n = tail.replace(k, '')
  if not ok or out != lhs[:batch] + m + n:
    raise ValueError(f'einsum spec {spec!r} is not a batched matmul of the form '
                     "'<batch><m...><k>,<batch><k><n>-><batch><m...><n>' (or b as <batch><n><k>)")
  return batch, tail[0] == n


def _dims(batch: int, lhs_rank: int, rhs_t: bool):
  """dot_general dimension numbers: a [batch, m..., k] with b [batch, k, n] / [batch, n, k]."""
  bd = tuple(range(batch))
  return (((lhs_rank - 1,), (batch + 1 if rhs_t else batch,)), (bd, bd))


def _fast(a: Array, b: Array, batch: int, rhs_t: bool, compute=BF16) -> Array:
  """The one fast form: compute x compute -> f32, a contracted on its last axis."""
  return jax.lax.dot_general(a.astype(compute), b.astype(compute), _dims(batch, a.ndim, rhs_t),
                             preferred_element_type=jnp.float32)


def _transposed(x: Array, batch: int) -> Array:
  """[batch, m..., c] -> [batch, c, prod(m)]: x^T for the left side of a dot.

  Written as reshape [.., m/8, 8, c] -> transpose -> reshape: XLA:CPU folds a plain transpose
  into the dot (a transposed left operand, off the bf16 kernels); this form it materialises
  as a copy and the dot's left operand stays row-major. (Rows not a multiple of 8: the plain
  transpose.)"""
  lead, c = x.shape[:batch], x.shape[-1]
  rows = x.size // (c * math.prod(lead))
  x = x.reshape(*lead, rows, c)
  if rows % 8:
    return jnp.swapaxes(x, -1, -2)
  perm = tuple(range(batch)) + (batch + 2, batch, batch + 1)
  return x.reshape(*lead, rows // 8, 8, c).transpose(perm).reshape(*lead, c, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _cpu_dot(a: Array, b: Array, batch: int, rhs_t: bool, out_dtype, compute) -> Array:
  """a [batch, m..., k] . b ([batch, k, n], or [batch, n, k] if rhs_t) in the bf16-kernel
  form (`_fast`), f32 accumulation; forward and both gradients (module docstring)."""
  return _fast(a, b, batch, rhs_t, compute).astype(out_dtype)


def _cpu_dot_fwd(a, b, batch, rhs_t, out_dtype, compute):
  a16, b16 = a.astype(compute), b.astype(compute)
  # the operands' dtypes ride along as empty arrays: the cotangents must match them
  like = (jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))
  return _fast(a16, b16, batch, rhs_t, compute).astype(out_dtype), (a16, b16, like)


def _cpu_dot_bwd(batch, rhs_t, out_dtype, compute, res, dy):
  a16, b16, (a_like, b_like) = res
  dy16 = dy.astype(compute)  # [batch, m..., n]
  # da = dy . b^T: dy is contracted on its last axis (n) already
  da = _fast(dy16, b16, batch, not rhs_t, compute)
  # With three or more free axes on a ([S, B, T, k]: a stack of activations), the first is
  # a batch axis of the gradient product, summed after it: merging S with the rows B that a
  # mesh shards into one contracted axis would make GSPMD gather a and dy whole on every
  # device (a reshape that merges a sharded axis below an unsharded one); S x B T keeps
  # each device's rows its own.
  lead = batch + (a16.ndim - batch >= 4)
  if rhs_t:  # db [batch, n, k] = dy^T a
    a2 = a16.reshape(*a16.shape[:lead], -1, a16.shape[-1])
    db = _fast(_transposed(dy16, lead), a2, lead, False, compute)
  else:  # db [batch, k, n] = a^T dy
    dy2 = dy16.reshape(*dy16.shape[:lead], -1, dy16.shape[-1])
    db = _fast(_transposed(a16, lead), dy2, lead, False, compute)
  if lead > batch:
    db = jnp.sum(db, axis=batch)
  # Behind a barrier: a transpose its consumer applies (a tied embedding's head weight is
  # the embedding's transpose) would otherwise be folded into the dot, as (dy^T a)^T =
  # a^T dy, putting the transpose back on the left operand and the dot on XLA:CPU's generic
  # dot, which has no bf16 x bf16 -> f32 kernel (UNIMPLEMENTED at run time).
  da, db = jax.lax.optimization_barrier((da, db))
  return da.astype(a_like.dtype), db.astype(b_like.dtype)


_cpu_dot.defvjp(_cpu_dot_fwd, _cpu_dot_bwd)
