"""The weighted multi-depth loss and its per-depth metrics (docs/design.md sections 3-4).

  L = L_main + sum_k w_k L^k,   L^k = mean over valid i of -log P^k_{i+k+1}[t_{i+k+1}]

Every depth keeps the static length T; targets of depth k are tokens shifted left by
its target offset o_k (k + 1 unless model.mtp.target_offsets sets leap targets). Position
i is valid at depth k only when t_{i+o_k} exists and lies in t_i's document. The weights
w_k follow lambda's schedule and the depth curriculum (depth_weights): a function of the
step alone, so the compiled step is the same at every step. The loss reads no config: its
settings are a `LossArgs`, built once where the step is built (train/steps.py, loss_args).

The heads' cross-entropy sums (whole, or in sequence chunks under loss_chunk) are
head_sums.py's.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

import mtp_jax
from mtp_jax.config import kinds
from mtp_jax.model import context as context_lib
from mtp_jax.model import moe
from mtp_jax.model.heads import vocab_logits
from mtp_jax.model.mtp import MTPModel, shift_left
from mtp_jax.runtime import profiling
from mtp_jax.train.head_sums import head_sums
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
  mtp_kind: str = 'sequential'  # model.mtp.kind: whether its heads predict tokens at offsets
  mtp_target_offsets: tuple[int, ...] = ()  # o_1..o_M; () = k + 1
  chunk: int = 0  # model.loss_chunk
  mtp_targets: str = 'data'  # data | self | soft
  balance_weight: float = 0.0  # model.moe.balance_loss_weight

  def target_offsets(self) -> tuple[int, ...]:
    """(1, o_1, ..., o_M): how far ahead each head predicts, the main head first."""
    return kinds.target_offsets(self.mtp_kind, self.mtp_depth, self.mtp_target_offsets)


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


@jax.named_scope(profiling.LOSS_SCOPE)
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


@context_lib.in_balanced_layout
def loss_and_metrics(model: MTPModel, batch: dict, weights_M1: Array,
                     counts_M1: Array | None = None, chunk: int = 0, mtp_targets: str = 'data',
                     balance_weight: float = 0.0):
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
  if num > 1 and not model.args.head_facts().predicts_tokens:  # main head, then the ranking
    loss_0, correct_0, pred_0 = head_sums(model, hiddens[:1], targets_M1xBxT[:1],
                                           mask_M1xBxT[:1], chunk)
    loss_t, correct_t, pred_t = top_sums(model, hiddens[1], tokens, seg, mask_M1xBxT[1])
    loss_M1 = jnp.concatenate([loss_0, loss_t[None]])
    correct_M1 = jnp.concatenate([correct_0, correct_t[None].astype(correct_0.dtype)])
    pred_M1xBxT = jnp.concatenate([pred_0, pred_t[None]])
  elif num == 1 or (mtp_targets == 'data' and not model.args.stop_gradient):
    loss_M1, correct_M1, pred_M1xBxT = head_sums(model, hiddens, targets_M1xBxT, mask_M1xBxT, chunk)
  else:  # depth 0 first: its argmax gives the 'self' targets; OutHead differs under stop_gradient
    loss_0, correct_0, pred_0 = head_sums(model, hiddens[:1], targets_M1xBxT[:1],
                                           mask_M1xBxT[:1], chunk)
    mtp_tgt, teacher = targets_M1xBxT[1:], None
    if mtp_targets == 'self':
      mtp_tgt = self_targets(pred_0[0], num - 1, offsets)
    elif mtp_targets == 'soft':
      teacher = teacher_hiddens(hiddens[0], num - 1, offsets)
    loss_k, _, pred_k = head_sums(model, hiddens[1:], mtp_tgt, mask_M1xBxT[1:], chunk, first=1,
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


def __getattr__(name: str):  # a name an earlier release had here: mtp_jax.MOVED_NAMES
  return mtp_jax.moved_name(__name__, name)
