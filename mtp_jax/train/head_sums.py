"""The heads' sums: per depth, the summed cross-entropy of OutHead on the hidden states, the
number of correct argmaxes and the argmax itself (train/loss.py weights and adds them up).

loss_chunk = 0 (`_batched`): every depth's logits in one [(M+1) B T, V] product, all alive
at once (small vocabularies: the fastest form). loss_chunk > 0 (`_chunked`): one lax.scan
over the depths and inside it one over sequence chunks, so a single [B, chunk, V] block of
logits is alive at a time whatever M is, and none is kept for the backward pass.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec as P

from mtp_jax.model import matmul
from mtp_jax.model.heads import vocab_logits
from mtp_jax.model.mtp import MTPModel
from mtp_jax.runtime import profiling, sharding

Array = jax.Array


@jax.named_scope(profiling.LOSS_SCOPE)
def head_sums(model: MTPModel, hiddens: list, targets_M1xBxT, mask_M1xBxT, chunk: int,
              first: int = 0, teacher_MxBxTxD: Array | None = None):
  """Per-depth (sum of -log p over valid positions [M1], number correct [M1], argmax
  [M1, B, T]).

  hiddens are depths first, first + 1, ...: the main head and the M depths (M1 of them),
  or with first = 1 the depths alone (the stacks then hold M); OutHead is detached for
  MTP depths (first > 0) under model.args.stop_gradient. teacher_MxBxTxD
  (loss.teacher_hiddens): the loss is then the cross-entropy against the main head's
  softmax of those hidden states (its final norm, OutHead, no gradient), computed chunk by
  chunk beside the logits; 'number correct' still counts targets_M1xBxT.
  """
  norms = [model.head_norm(k) for k in range(first, first + len(hiddens))]
  w_DxV = model.output_kernel()
  if first > 0 and model.args.stop_gradient:
    w_DxV = jax.lax.stop_gradient(w_DxV)
  teach = None
  if teacher_MxBxTxD is not None:  # the main head: final norm and OutHead, no gradient
    teacher_w = jax.lax.stop_gradient(model.output_kernel())
    teacher_norm = model.head_norm(0)
    teach = lambda h: vocab_logits(teacher_norm, h, teacher_w)  # noqa: E731
  if chunk in (0, None):
    teacher_logits = None if teach is None else jnp.stack([teach(h) for h in teacher_MxBxTxD])
    return _batched(norms, hiddens, w_DxV, targets_M1xBxT, mask_M1xBxT, teacher_logits)
  return _chunked(norms, hiddens, w_DxV, targets_M1xBxT, mask_M1xBxT, chunk, teach,
                  teacher_MxBxTxD)


def _nll(logits, targets, teacher_logits=None):
  """-log p[target] per position, or with teacher logits the cross-entropy against the
  teacher's softmax (its KL plus its entropy); the teacher gets no gradient."""
  if teacher_logits is None:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  p = jax.nn.softmax(jax.lax.stop_gradient(teacher_logits), axis=-1)
  return optax.softmax_cross_entropy(logits, p)


def cross_entropy_autodiff(logits_BTxV: Array, targets_BT: Array) -> tuple[Array, Array]:
  """(-log softmax(logits)[target], argmax) over the last axis: optax's loss, autodiff."""
  return (optax.softmax_cross_entropy_with_integer_labels(logits_BTxV, targets_BT),
          jnp.argmax(logits_BTxV, axis=-1).astype(jnp.int32))


# The cross-entropy _batched runs (custom VJPs were measured no faster).
cross_entropy = cross_entropy_autodiff


def _batched(norms, hiddens, w_DxV, targets_M1xBxT, mask_M1xBxT, teacher_logits=None):
  """head_sums over the whole length (loss_chunk = 0): every depth's vocab projection in
  one [M1*B*T, D] x [D, V] product and one cross-entropy over [M1, B, T, V] logits.

  One large GEMM (and one for each of its two gradients) instead of K small ones inside a
  scan: the MaxText-shape train step (V 1024) ran 1.04x faster at M = 0 and 1.10x at
  M = 3 (docs/benchmarks.md). The logits of every depth then exist at once
  and stay as residuals for the backward pass (4 K B T V bytes): the form for small
  vocabularies; loss_chunk > 0 keeps one [B, chunk, V] block alive.
  """
  # Stacked on a new leading axis, not concatenated along B*T: the batch axis stays where
  # the mesh shards it, so data parallel needs no all-to-all (the concatenate of [B*T, D]
  # rows resharded every depth's rows, and the logits back: 0.05 of the 2-device step).
  x_M1xBxTxD = jnp.stack([norm(h) for norm, h in zip(norms, hiddens)])
  logits_M1xBxTxV = matmul.einsum('kbtd,dv->kbtv', x_M1xBxTxD, w_DxV, x_M1xBxTxD.dtype,
                                  jnp.float32)
  if teacher_logits is None:
    nll, pred_M1xBxT = cross_entropy(logits_M1xBxTxV, targets_M1xBxT)
  else:
    nll = _nll(logits_M1xBxTxV, targets_M1xBxT, teacher_logits)
    pred_M1xBxT = jnp.argmax(logits_M1xBxTxV, axis=-1).astype(jnp.int32)
  mf = mask_M1xBxT.astype(jnp.float32)
  return (jnp.sum(nll * mf, axis=(1, 2)),
          jnp.sum((pred_M1xBxT == targets_M1xBxT) * mf, axis=(1, 2)), pred_M1xBxT)


def _split(x, n: int, chunk: int):
  """[B, T, ...] -> [n, B, chunk, ...] (T = n chunks)."""
  return jnp.moveaxis(x.reshape((x.shape[0], n, chunk) + x.shape[2:]), 1, 0)


def _unsplit(x):
  """[n, B, chunk, ...] -> [B, T, ...]."""
  return jnp.moveaxis(x, 0, 1).reshape((x.shape[1], x.shape[0] * x.shape[2]) + x.shape[3:])


def _chunked(norms, hiddens, w_DxV, targets_M1xBxT, mask_M1xBxT, chunk: int, teach,
             teacher_MxBxTxD):
  """head_sums chunk by chunk (loss_chunk > 0).

  Without a teacher the chunks' gradients are made in the forward pass (a custom VJP,
  below); with one (its head closed over, so no custom VJP) each chunk runs under
  jax.checkpoint instead. (Separate per-depth loops would each get their own temporaries
  in XLA's buffer assignment: peak memory then grows with M.)
  """
  num = len(hiddens)
  b, t, _ = hiddens[0].shape
  h_M1xBxTxD = jnp.stack(hiddens)
  norm_def, _ = nnx.split(norms[0])
  norm_M1 = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(m) for m in norms])
  # without a teacher a zero-size stand-in rides along in the scans (no work, same code)
  teacher = (jnp.zeros((num, b, t, 0), hiddens[0].dtype) if teach is None
             else teacher_MxBxTxD)

  def chunk_stats(norm_state, w, hc, tc, mc, thc):
    """(sum of -log p over the chunk's valid positions, (number correct, argmax))."""
    logits = vocab_logits(nnx.merge(norm_def, norm_state), hc, w)
    nll = _nll(logits, tc, None if teach is None else teach(thc))
    pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    mf = mc.astype(jnp.float32)
    return jnp.sum(nll * mf), (jnp.sum((pred == tc) * mf), pred)

  def scan_heads(h_M1, tgt_M1, m_M1, norm_state_M1, th_M1, w, grads=False):
    """Every depth's sums, chunk by chunk; with grads also the gradients of each depth's
    loss sum for h [M1, B, T, D], its norm and OutHead [M1, D, V], made chunk by chunk
    in the same pass (heads_fwd); with a teacher each chunk under jax.checkpoint."""
    zero = jnp.zeros((), jnp.float32)

    def chunk_body(carry, cxs):
      norm_state, hc, tc, mc, thc = cxs[0], *cxs[1]
      if not grads:
        loss_c, (correct_c, pred) = chunk_stats(norm_state, w, hc, tc, mc, thc)
        return (carry[0] + loss_c, carry[1] + correct_c), pred
      f = lambda ns, w, hc: chunk_stats(ns, w, hc, tc, mc, thc)  # noqa: E731
      loss_c, vjp, (correct_c, pred) = jax.vjp(f, norm_state, w, hc, has_aux=True)
      d_norm, d_w, d_h = vjp(jnp.ones((), loss_c.dtype))
      carry = (carry[0] + loss_c, carry[1] + correct_c,
               jax.tree.map(jnp.add, carry[2], d_norm), carry[3] + d_w)
      return carry, (pred, d_h)

    def depth_body(_, xs):
      h, tgt, m, norm_state, th = xs
      init = (zero, zero)
      if grads:
        init += (jax.tree.map(jnp.zeros_like, norm_state), jnp.zeros_like(w))
      body = lambda carry, cxs: chunk_body(carry, (norm_state, cxs))  # noqa: E731
      if teach is not None:
        body = jax.checkpoint(body)
      # this device's own positions (a context shard holds T / context of them)
      carry, ys = jax.lax.scan(body, init, tuple(_split(x, x.shape[1] // chunk, chunk)
                                                 for x in (h, tgt, m, th)))
      if not grads:
        return None, (carry[0], carry[1], _unsplit(ys))
      return None, (carry[0], carry[1], _unsplit(ys[0]), _unsplit(ys[1]), carry[2], carry[3])

    _, out = jax.lax.scan(depth_body, None, (h_M1, tgt_M1, m_M1, norm_state_M1, th_M1))
    return out

  # The loss sums are linear in their cotangents (one scalar per depth): the forward pass of
  # a differentiated step makes each chunk's gradients for a unit cotangent right after its
  # logits, and the backward pass only scales them. The logits are computed once per step,
  # not again in the backward pass (as jax.checkpoint of each chunk would), and none is kept.
  @jax.custom_vjp
  def heads(h_M1, tgt_M1, m_M1, norm_state_M1, th_M1, w):
    return scan_heads(h_M1, tgt_M1, m_M1, norm_state_M1, th_M1, w)

  def heads_fwd(h_M1, tgt_M1, m_M1, norm_state_M1, th_M1, w):
    loss, correct, pred, d_h, d_norm, d_w = scan_heads(h_M1, tgt_M1, m_M1, norm_state_M1,
                                                       th_M1, w, grads=True)
    return (loss, correct, pred), (d_h, d_norm, d_w, tgt_M1, m_M1, th_M1)

  def heads_bwd(res, cts):
    d_h, d_norm, d_w, tgt_M1, m_M1, th_M1 = res
    ct_M1 = cts[0].astype(jnp.float32)

    def scaled(g):  # depth k's gradient times its cotangent, in float32, in g's dtype
      g32 = g.astype(jnp.float32)
      return (g32 * ct_M1.reshape((-1,) + (1,) * (g.ndim - 1))).astype(g.dtype)

    float0 = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
    return (scaled(d_h), float0(tgt_M1), float0(m_M1), jax.tree.map(scaled, d_norm),
            jnp.zeros_like(th_M1), jnp.einsum('k,kdv->dv', ct_M1, d_w).astype(d_w.dtype))

  heads.defvjp(heads_fwd, heads_bwd)
  chunked = heads if teach is None else scan_heads

  args = (h_M1xBxTxD, targets_M1xBxT, mask_M1xBxT, norm_M1, teacher, w_DxV)
  spec = None if teach is not None else _per_device_rows()  # the teacher's head: GSPMD's
  if spec is None:
    return chunked(*args)
  # Per device: OutHead enters whole (gathered once per step, not once per chunk inside the
  # scans, where GSPMD would put the gather) and its gradient leaves by one reduction over
  # the devices (shard_map's transpose of a replicated input), not one per chunk.
  rows, rows3 = P(None, *spec, None), P(None, *spec)
  axes = [x for a in spec if a is not None for x in ((a,) if isinstance(a, str) else a)]
  sums = P(tuple(axes) or None)

  def local(*a):
    loss_sum, correct, pred = chunked(*a)
    return loss_sum[None], correct[None], pred

  loss_XxM1, correct_XxM1, pred_M1xBxT = jax.shard_map(
      local, in_specs=(rows, rows3, rows3, P(), rows, P()), out_specs=(sums, sums, rows3),
      check_vma=False)(*args)
  return jnp.sum(loss_XxM1, axis=0), jnp.sum(correct_XxM1, axis=0), pred_M1xBxT


def _per_device_rows():
  """The (batch, length) mesh axes of the active rules when the chunked head can run per
  device on its own rows, else None: no mesh, or a mesh axis of more than one device that
  splits neither rows nor positions (a vocab / model-dim split: GSPMD keeps the head)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not flax_spmd.get_logical_axis_rules():
    return None
  spec = tuple(sharding.logical_spec(('batch', 'length')))
  spec = spec + (None,) * (2 - len(spec))
  used = set()
  for a in spec:
    used.update(() if a is None else (a,) if isinstance(a, str) else a)
  if any(size > 1 and name not in used for name, size in mesh.shape.items()):
    return None
  return spec
