"""The weighted multi-depth loss and its per-depth metrics (docs/design.md sections 3-4).

  L = L_main + sum_k w_k L^k,   L^k = mean over valid i of -log P^k_{i+k+1}[t_{i+k+1}]

Every depth keeps the static length T; targets of depth k are tokens shifted left by
its target offset o_k (k + 1 unless model.mtp.target_offsets sets leap targets). Position
i is valid at depth k only when t_{i+o_k} exists and lies in t_i's document. The weights
w_k follow lambda's schedule and the depth curriculum (depth_weights): a function of the
step alone, so the compiled step is the same at every step. The loss reads no config: its
settings are a `LossArgs`, built once where the step is built (train/steps.py, loss_args).

loss_chunk = 0: every depth's logits in one [(M+1) B T, V] product (small vocabularies:
the fastest form, its logits all alive at once); loss_chunk > 0: depth by depth in
sequence chunks under `jax.checkpoint`, so the [M+1, B, T, V] logits never exist at once
(not even as saved residuals): the form for large vocabularies.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec as P

from mtp_jax.model import matmul, moe
from mtp_jax.model.mtp import MTPModel, shift_left, vocab_logits
from mtp_jax.runtime import sharding
from mtp_jax.train.metrics import metric_key

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class LossArgs:
  """The loss's settings: the resolved config.model.mtp, model.loss_chunk, loss and
  model.moe fields it reads (train/steps.py's loss_args builds them from a config; the
  config documents each field). Static: a step is traced with them as Python values."""
  mtp_depth: int = 0  # M
  weights: tuple[float, ...] = ()  # explicit w_1..w_M; () = lambda / M
  lambda_schedule: str = 'step'  # step | linear | cosine
  lambda_values: tuple[float, ...] = (0.3,)
  lambda_boundaries: tuple[int, ...] = ()
  curriculum: str = 'none'  # none | forward | reverse
  curriculum_phase_steps: int = 0  # P; 0 = total steps / (M + 1)
  steps: int = 0  # train.steps: the curriculum's S when no total_steps is passed
  mtp_target_offsets: tuple[int, ...] = ()  # o_1..o_M; () = k + 1
  chunk: int = 0  # model.loss_chunk
  mtp_targets: str = 'data'  # data | self | soft
  balance_weight: float = 0.0  # model.moe.balance_loss_weight

  def target_offsets(self) -> tuple[int, ...]:
    """(1, o_1, ..., o_M): how far ahead each head predicts, the main head first."""
    return (1,) + (self.mtp_target_offsets or tuple(range(2, self.mtp_depth + 2)))


def _offset(k: int, offsets) -> int:
  return k + 1 if offsets is None else int(offsets[k])


def valid_mask(segment_ids_BxT: Array, k: int, offsets=None) -> Array:
  """Positions of depth k whose target t_{i+o_k} (o_k = offsets[k], default k + 1) is inside
  the sequence and in t_i's document."""
  target_seg = shift_left(segment_ids_BxT, _offset(k, offsets), fill=0)
  return (segment_ids_BxT != 0) & (target_seg == segment_ids_BxT)


def targets(tokens_BxT: Array, k: int, offsets=None) -> Array:
  """t_{i+o_k} at i: depth k's targets (offsets as in valid_mask)."""
  return shift_left(tokens_BxT, _offset(k, offsets), fill=0)


def self_targets(pred0_BxT: Array, mtp_depth: int, offsets=None) -> Array:
  """[M, B, T] self-distillation targets: depth k at i gets the main model's argmax at
  i + o_k - 1 (o_k = k + 1 by default).

  pred0[i + o_k - 1] is the main model's choice for token i+o_k after the true prefix up
  to token i+o_k-1 (0-based): what the verifier picks, so what depth k's draft must
  match. valid_mask keeps i..i+o_k in one document, so the same positions are valid as
  for the data targets. No gradient flows through an argmax.
  """
  pred0_BxT = jax.lax.stop_gradient(pred0_BxT)
  return jnp.stack([shift_left(pred0_BxT, _offset(k, offsets) - 1, fill=0)
                    for k in range(1, mtp_depth + 1)])


def teacher_hiddens(h0_BxTxD: Array, mtp_depth: int, offsets=None) -> Array:
  """[M, B, T, D] the main model's final hidden state at i + k for depth k at i ('soft').

  Its logits are the main model's distribution of token i+k+1 after the true prefix up to
  token i+k: exactly the distribution speculative sampling verifies depth k's draft
  against (acceptance sum_v min(p_v, q_v) = 1 - TV(p, q)), so a cross-entropy against it
  trains q towards p itself rather than towards its argmax ('self'). No gradient flows
  into the teacher.
  """
  h0_BxTxD = jax.lax.stop_gradient(h0_BxTxD)
  return jnp.stack([shift_left(h0_BxTxD, _offset(k, offsets) - 1)
                    for k in range(1, mtp_depth + 1)])


def _nll(logits, targets, teacher_logits=None):
  """-log p[target] per position, or with teacher logits the cross-entropy against the
  teacher's softmax (its KL plus its entropy); the teacher gets no gradient."""
  if teacher_logits is None:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  p = jax.nn.softmax(jax.lax.stop_gradient(teacher_logits), axis=-1)
  return optax.softmax_cross_entropy(logits, p)


def valid_counts(segment_ids_BxT: Array, mtp_depth: int, offsets=None) -> Array:
  """[M+1] number of valid positions per head, the main one and depths 1..M (the loss
  normalisers)."""
  return jnp.stack([valid_mask(segment_ids_BxT, k, offsets).sum()
                    for k in range(mtp_depth + 1)])


def lambda_at(args: LossArgs, step) -> Array:
  """lambda at `step` under model.mtp.lambda_schedule (config_lib documents the forms)."""
  values = jnp.asarray(args.lambda_values, jnp.float32)
  bounds = jnp.asarray(args.lambda_boundaries, jnp.int32).reshape(-1)
  kind = args.lambda_schedule
  if kind == 'step':
    return values[jnp.searchsorted(bounds, step, side='right')]
  if len(values) == 1:
    return values[0]
  # segment j: bounds[j] <= step < bounds[j + 1]; clamp outside the knots
  j = jnp.clip(jnp.searchsorted(bounds, step, side='right') - 1, 0, len(values) - 2)
  lo, hi = bounds[j].astype(jnp.float32), bounds[j + 1].astype(jnp.float32)
  frac = jnp.clip((jnp.asarray(step, jnp.float32) - lo) / (hi - lo), 0.0, 1.0)
  if kind == 'cosine':
    frac = 0.5 * (1.0 - jnp.cos(jnp.pi * frac))
  return values[j] + (values[j + 1] - values[j]) * frac


def curriculum_phase(args: LossArgs) -> tuple[int, int]:
  """(P, k_max) of the depth curriculum: phase length in steps and heads counting the main
  one. P = model.mtp.curriculum_phase_steps, or train.steps / k_max when that is 0 (then
  the phase index floor(s / (S / k_max)) is computed as floor(s k_max / S), exactly)."""
  return args.curriculum_phase_steps, args.mtp_depth + 1


def active_depths(args: LossArgs, step, total_steps=None) -> Array:
  """The number a(s) of active MTP depths at step s (depths 1..a(s) are active).

  Aynetdinov & Akbik 2025, k(s) heads counting the main one, k_max = M + 1:
    forward  k(s) = min(k_max, floor(s / P) + 1)    a(s) = k(s) - 1
    reverse  k(s) = max(1, k_max - floor(s / P))
  none: a(s) = M. total_steps: train.steps as a traced value (default: args.steps).
  """
  mtp_depth, kind = args.mtp_depth, args.curriculum
  step = jnp.asarray(step, jnp.int32)
  if kind == 'none' or mtp_depth == 0:
    return jnp.full((), mtp_depth, jnp.int32)
  phase_steps, k_max = curriculum_phase(args)
  if phase_steps:
    phase = step // phase_steps
  else:
    total = args.steps if total_steps is None else total_steps
    phase = (step * k_max) // jnp.maximum(jnp.asarray(total, jnp.int32), 1)
  if kind == 'forward':
    heads = jnp.minimum(k_max, phase + 1)
  else:
    heads = jnp.maximum(1, k_max - phase)
  return (heads - 1).astype(jnp.int32)


def depth_weights(args: LossArgs, step, total_steps=None) -> Array:
  """[M+1] weights: 1 for the main loss, then w_k (explicit, or lambda / M), times 1 for
  an active depth of the curriculum and 0 for an inactive one (total_steps: active_depths')."""
  mtp_depth = args.mtp_depth
  if mtp_depth == 0:
    return jnp.ones((1,), jnp.float32)
  if args.weights:
    w = jnp.asarray(args.weights, jnp.float32)
  else:
    w = jnp.full((mtp_depth,), lambda_at(args, step) / mtp_depth, jnp.float32)
  active = jnp.arange(1, mtp_depth + 1) <= active_depths(args, step, total_steps)
  return jnp.concatenate([jnp.ones((1,), jnp.float32), jnp.where(active, w, 0.0)])


def _head_sums(model: MTPModel, hiddens: list, targets_M1xBxT, mask_M1xBxT, chunk: int,
               first: int = 0, teacher_MxBxTxD: Array | None = None):
  """Per-depth (sum of -log p over valid positions [M1], number correct [M1], argmax
  [M1, B, T]).

  hiddens are depths first, first + 1, ...: the main head and the M depths (M1 of them),
  or with first = 1 the depths alone (the stacks then hold M); OutHead is detached for MTP depths (first > 0)
  under model.args.stop_gradient. teacher_MxBxTxD (teacher_hiddens): the loss is then the
  cross-entropy against the main head's softmax of those hidden states (its final norm,
  OutHead), computed chunk by chunk beside the logits; 'number correct' still counts
  targets_M1xBxT.

  chunk 0 (or None): _head_sums_batched, one product for all depths. chunk > 0: one
  lax.scan over the depths, and inside it one over sequence chunks whose body (head
  norm, vocab projection, cross-entropy) runs under jax.checkpoint: a single
  [B, chunk, V] block of logits is alive at a time, whatever M is, and none is kept
  for the backward pass. (Separate per-depth loops would each get their own
  temporaries in XLA's buffer assignment: peak memory then grows with M.)
  """
  num = len(hiddens)
  b, t, _ = hiddens[0].shape
  norms = [model.head_norm(k) for k in range(first, first + num)]
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
    return _head_sums_batched(norms, hiddens, w_DxV, targets_M1xBxT, mask_M1xBxT, teacher_logits)
  n = t // chunk
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
    in the same pass (heads_fwd)."""
    bl = h_M1.shape[1]  # this device's rows inside the shard_map
    zero = jnp.zeros((), jnp.float32)

    def split(x):  # [B, T, ...] -> [n, B, chunk, ...]
      return jnp.moveaxis(x.reshape((bl, n, chunk) + x.shape[2:]), 1, 0)

    def unsplit(x):  # [n, B, chunk, ...] -> [B, T, ...]
      return jnp.moveaxis(x, 0, 1).reshape((bl, t) + x.shape[3:])

    def depth_body(_, xs):
      h, tgt, m, norm_state, th = xs

      def chunk_body(carry, cxs):
        hc, tc, mc, thc = cxs
        if not grads:
          loss_c, (correct_c, pred) = chunk_stats(norm_state, w, hc, tc, mc, thc)
          return (carry[0] + loss_c, carry[1] + correct_c), pred
        f = lambda ns, w, hc: chunk_stats(ns, w, hc, tc, mc, thc)  # noqa: E731
        loss_c, vjp, (correct_c, pred) = jax.vjp(f, norm_state, w, hc, has_aux=True)
        d_norm, d_w, d_h = vjp(jnp.ones((), loss_c.dtype))
        carry = (carry[0] + loss_c, carry[1] + correct_c,
                 jax.tree.map(jnp.add, carry[2], d_norm), carry[3] + d_w)
        return carry, (pred, d_h)

      init = (zero, zero)
      if grads:
        init += (jax.tree.map(jnp.zeros_like, norm_state), jnp.zeros_like(w))
      carry, ys = jax.lax.scan(chunk_body, init, (split(h), split(tgt), split(m), split(th)))
      if not grads:
        return None, (carry[0], carry[1], unsplit(ys))
      return None, (carry[0], carry[1], unsplit(ys[0]), unsplit(ys[1]), carry[2], carry[3])

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
      return (g.astype(jnp.float32) * ct_M1.reshape((-1,) + (1,) * (g.ndim - 1))).astype(g.dtype)

    float0 = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
    return (scaled(d_h), float0(tgt_M1), float0(m_M1), jax.tree.map(scaled, d_norm),
            jnp.zeros_like(th_M1), jnp.einsum('k,kdv->dv', ct_M1, d_w).astype(d_w.dtype))

  heads.defvjp(heads_fwd, heads_bwd)

  def chunked(*a):
    if teach is None:
      return heads(*a)
    # with a teacher (its head closed over): each chunk under jax.checkpoint instead
    bl = a[0].shape[1]

    def split(x):
      return jnp.moveaxis(x.reshape((bl, n, chunk) + x.shape[2:]), 1, 0)

    def depth_body(_, xs):
      h, tgt, m, norm_state, th = xs

      def chunk_body(carry, cxs):
        hc, tc, mc, thc = cxs
        loss_c, (correct_c, pred) = chunk_stats(norm_state, a[5], hc, tc, mc, thc)
        return (carry[0] + loss_c, carry[1] + correct_c), pred

      zero = jnp.zeros((), jnp.float32)
      (loss_sum, correct), pred = jax.lax.scan(jax.checkpoint(chunk_body), (zero, zero),
                                               (split(h), split(tgt), split(m), split(th)))
      return None, (loss_sum, correct, jnp.moveaxis(pred, 0, 1).reshape(bl, t))

    _, out = jax.lax.scan(depth_body, None, a[:5])
    return out

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


def top_targets(tokens_BxT: Array, segment_ids_BxT: Array, window: int, vocab_size: int) -> Array:
  """[B, T, V] token-order targets (Zuhri et al. 2025): at position i, token v scores
  W - d + 1 where d in 1..W is the distance to v's first occurrence among t_(i+1)..t_(i+W)
  in t_i's document (the next token scores W), and -inf where v does not occur there.

  Built from the farthest offset to the nearest, so a token seen twice keeps its nearest
  occurrence's score.
  """
  score_BxTxV = jnp.zeros(tokens_BxT.shape + (vocab_size,), jnp.float32)
  for d in range(window, 0, -1):
    hit = jax.nn.one_hot(shift_left(tokens_BxT, d), vocab_size, dtype=jnp.bool_)
    hit = hit & valid_mask(segment_ids_BxT, 0, (d,))[..., None]
    score_BxTxV = jnp.where(hit, float(window - d + 1), score_BxTxV)
  return jnp.where(score_BxTxV > 0, score_BxTxV, -jnp.inf)


def top_sums(model: MTPModel, h0_BxTxD: Array, tokens_BxT: Array, segment_ids_BxT: Array,
             mask_BxT: Array):
  """The TOP head's (ListNet loss summed over valid positions, number of positions whose
  top-ranked token is t_(i+1), argmax [B, T]).

  ListNet (Cao et al. 2007) with the target's softmax as the reference distribution:
  -sum_v softmax(top_targets)_v log softmax(U_top^T norm(h^0))_v per position. Tokens
  absent from the window get probability 0. The whole [B, T, V] block at once (no
  loss_chunk): the form for the small vocabularies it is swept at.
  """
  args = model.args
  logits_BxTxV = vocab_logits(model.head_norm(0), h0_BxTxD, model.mtp[0].unembed[...])
  target_BxTxV = top_targets(tokens_BxT, segment_ids_BxT, args.top_window, args.vocab_size)
  # a masked position may have no token in its window (all -inf): give it a finite row
  p_BxTxV = jax.nn.softmax(jnp.where(mask_BxT[..., None], target_BxTxV, 0.0), axis=-1)
  nll_BxT = optax.softmax_cross_entropy(logits_BxTxV, p_BxTxV)
  pred_BxT = jnp.argmax(logits_BxTxV, axis=-1).astype(jnp.int32)
  mf = mask_BxT.astype(jnp.float32)
  nxt = targets(tokens_BxT, 0)
  return jnp.sum(nll_BxT * mf), jnp.sum((pred_BxT == nxt) * mf), pred_BxT


def cross_entropy_autodiff(logits_BTxV: Array, targets_BT: Array) -> tuple[Array, Array]:
  """(-log softmax(logits)[target], argmax) over the last axis: optax's loss, autodiff."""
  return (optax.softmax_cross_entropy_with_integer_labels(logits_BTxV, targets_BT),
          jnp.argmax(logits_BTxV, axis=-1).astype(jnp.int32))


# The cross-entropy _head_sums_batched runs (custom VJPs were measured no faster).
cross_entropy = cross_entropy_autodiff


def _head_sums_batched(norms, hiddens, w_DxV, targets_M1xBxT, mask_M1xBxT, teacher_logits=None):
  """_head_sums over the whole length (loss_chunk = 0): every depth's vocab projection in
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
  return (jnp.sum(nll * mf, axis=(1, 2)), jnp.sum((pred_M1xBxT == targets_M1xBxT) * mf, axis=(1, 2)),
          pred_M1xBxT)


def loss_and_metrics(model: MTPModel, batch: dict, weights_M1: Array, counts_M1: Array | None = None,
                     chunk: int = 0, mtp_targets: str = 'data', balance_weight: float = 0.0):
  """The weighted loss and summed per-depth statistics of one (micro)batch.

  mtp_targets: 'data' (the true tokens), 'self' (self_targets: the main model's argmax) or
  'soft' (teacher_hiddens: the main model's whole distribution), config.loss.mtp_targets;
  'correct' counts the true tokens either way.

  counts_M1: the valid-position counts that normalise each depth's mean; pass the full
  batch's counts when this is one microbatch of an accumulated step, so the summed
  gradients equal one large batch exactly. Defaults to this batch's own counts.
  Returns (loss, sums) where sums maps 'loss_sum', 'correct', 'agree', 'count' to [M+1]
  arrays (agree[0] is unused and 0).

  A model with MoE layers adds balance_weight x the sum over its MoE layers of the
  sequence-wise balance loss (moe.balance_loss), scaled by this microbatch's share of the
  valid positions so accumulated microbatches add up to one batch's; sums then also hold
  'moe_load' [L, E] (tokens per expert) and 'moe_balance' [L] (that scaled L_bal / alpha).
  """
  tokens, seg = batch['tokens'], batch['segment_ids']
  hiddens = model(tokens, batch.get('positions'), seg)
  routing = moe.collect(model)
  num = len(hiddens)
  offsets = model.args.target_offsets()
  mask_M1xBxT = jnp.stack([valid_mask(seg, k, offsets) for k in range(num)])
  targets_M1xBxT = jnp.stack([targets(tokens, k, offsets) for k in range(num)])
  if num > 1 and model.args.mtp_kind == 'top':  # the main head, then the ranking head
    loss_0, correct_0, pred_0 = _head_sums(model, hiddens[:1], targets_M1xBxT[:1],
                                           mask_M1xBxT[:1], chunk)
    loss_t, correct_t, pred_t = top_sums(model, hiddens[1], tokens, seg, mask_M1xBxT[1])
    loss_M1 = jnp.concatenate([loss_0, loss_t[None]])
    correct_M1 = jnp.concatenate([correct_0, correct_t[None].astype(correct_0.dtype)])
    pred_M1xBxT = jnp.concatenate([pred_0, pred_t[None]])
  elif num == 1 or (mtp_targets == 'data' and not model.args.stop_gradient):
    loss_M1, correct_M1, pred_M1xBxT = _head_sums(model, hiddens, targets_M1xBxT, mask_M1xBxT, chunk)
  else:  # depth 0 first: its argmax gives the 'self' targets; OutHead differs under stop_gradient
    loss_0, correct_0, pred_0 = _head_sums(model, hiddens[:1], targets_M1xBxT[:1],
                                           mask_M1xBxT[:1], chunk)
    mtp_tgt, teacher = targets_M1xBxT[1:], None
    if mtp_targets == 'self':
      mtp_tgt = self_targets(pred_0[0], num - 1, offsets)
    elif mtp_targets == 'soft':
      teacher = teacher_hiddens(hiddens[0], num - 1, offsets)
    loss_k, _, pred_k = _head_sums(model, hiddens[1:], mtp_tgt, mask_M1xBxT[1:], chunk, first=1,
                                   teacher_MxBxTxD=teacher)
    correct_k = jnp.sum((pred_k == targets_M1xBxT[1:]) & mask_M1xBxT[1:], axis=(1, 2))
    loss_M1 = jnp.concatenate([loss_0, loss_k])
    correct_M1 = jnp.concatenate([correct_0, correct_k.astype(correct_0.dtype)])
    pred_M1xBxT = jnp.concatenate([pred_0, pred_k])
  # does depth k's argmax at i equal the main model's argmax at i + o_k - 1 (its choice of
  # the same token t_{i+o_k})?
  agree = [jnp.zeros((), jnp.float32)] + [
      jnp.sum((pred_M1xBxT[k] == shift_left(pred_M1xBxT[0], offsets[k] - 1, fill=-1))
              & mask_M1xBxT[k])
      .astype(jnp.float32) for k in range(1, num)]
  sums = {'loss_sum': loss_M1, 'correct': correct_M1, 'agree': jnp.stack(agree),
          'count': mask_M1xBxT.sum(axis=(1, 2)).astype(jnp.float32)}
  denom = sums['count'] if counts_M1 is None else counts_M1.astype(jnp.float32)
  per_depth = sums['loss_sum'] / jnp.maximum(denom, 1.0)  # empty mask -> 0, never NaN
  loss = jnp.sum(weights_M1[:num] * per_depth)
  if routing:
    share = 1.0 if counts_M1 is None else sums['count'][0] / jnp.maximum(counts_M1[0], 1)
    routing['moe_balance'] = routing['moe_balance'] * share
    loss = loss + balance_weight * jnp.sum(routing['moe_balance'])
    sums.update(routing)
  return loss, sums


def summarize(sums: dict, prefix: str = 'train') -> dict:
  """Per-depth means from summed statistics: loss_main, loss_mtp_k, acc_*, agree_mtp_k."""
  count = jnp.maximum(sums['count'], 1.0)
  loss_k = sums['loss_sum'] / count
  acc_k = sums['correct'] / count
  out = {metric_key(prefix, 'loss', 0): loss_k[0], metric_key(prefix, 'acc', 0): acc_k[0]}
  for k in range(1, loss_k.shape[0]):
    out[metric_key(prefix, 'loss', k)] = loss_k[k]
    out[metric_key(prefix, 'acc', k)] = acc_k[k]
    out[metric_key(prefix, 'agree', k)] = sums['agree'][k] / count[k]
  return out
