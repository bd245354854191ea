"""Sampling math of the decoder: temperature / top-k / top-p, and the speculative rule.

All functions are traced inside the decode program; per-row PRNG keys lead with the
batch axis. docs/design.md §5 has the acceptance rule and why it is lossless.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import mtp_jax

Array = jax.Array
PAD_ID = 0  # fills candidate slots past the committed ones


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Sampling:
  """Sampling parameters: the values are traced (changing them does not recompile); the
  switches are static, so a program pays for top-k / top-p only where they are on
  (benchmarks/sampling_cost.py: the two full-vocabulary sorts they needed then were 9-16x
  the rest of a T = 1 step when traced switches ran them on every step; their thresholds
  are now found without a sort, below).
  """
  temperature: Array  # > 0 when sampling
  top_k: Array  # 0: off
  top_p: Array  # 1.0: off
  draft_argmax: Array | bool = False  # drafts are argmax (q = one-hot), not sampled from q
  use_top_k: bool = dataclasses.field(default=True, metadata=dict(static=True))
  use_top_p: bool = dataclasses.field(default=True, metadata=dict(static=True))
  # the top-k / top-p thresholds by the bitwise search below; False: from full sorts (the
  # earlier form, kept for comparison: Decoder(bitwise_thresholds=False))
  bitwise: bool = dataclasses.field(default=True, metadata=dict(static=True))


# Top-k / top-p need a per-row threshold: the k-th largest logit, and the smallest
# probability the nucleus keeps. A full-vocabulary sort finds both but costs 2.1-2.3x a
# whole T = 1 AR step on XLA:CPU (benchmarks/results/peer_generate.json, V 4096). Both thresholds
# are instead found exactly, bit by bit, on an unsigned integer key with the float order:
# 32 rounds of one compare-and-reduce over the row, no sort.
_SIGN = 0x80000000


def _order_key(x):
  """uint32 keys whose unsigned order is float32 x's order (-0.0 folded into +0.0)."""
  b = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
  sign = jnp.uint32(_SIGN)
  return jnp.where(b >= sign, ~b, b | sign)


def _largest_key(holds, n_bits, shape):
  """Per row, the largest uint32 t < 2**n_bits with holds(t), where holds is true up to
  some t and false above it (and holds(0)): decided one bit at a time from the top."""
  t = jnp.zeros(shape, jnp.uint32)
  for bit in range(n_bits - 1, -1, -1):
    cand = t | jnp.uint32(1 << bit)
    t = jnp.where(holds(cand), cand, t)
  return t


def _top_k_mask(x, k):
  """x >= its k-th largest entry per row (ties kept), k in [1, V]."""
  key = _order_key(x)
  count = lambda t: jnp.sum(key >= t[..., None], axis=-1)  # noqa: E731
  return key >= _largest_key(lambda t: count(t) >= k, 32, x.shape[:-1])[..., None]


def _top_p_mask(probs, top_p):
  """The nucleus: probs >= v*, v* the largest value whose mass at or above it >= top_p
  (the fewest largest entries reaching top_p, ties kept; all of them if none does).
  Probabilities are >= 0, so their raw bits already sort as they do."""
  key = jax.lax.bitcast_convert_type(jnp.where(probs == 0, 0.0, probs), jnp.uint32)
  mass = lambda t: jnp.sum(jnp.where(key >= t[..., None], probs, 0.0), axis=-1)  # noqa: E731
  return key >= _largest_key(lambda t: mass(t) >= top_p, 31, probs.shape[:-1])[..., None]


def _sorted_top_k_mask(x, k):
  """_top_k_mask from a sort of the row (Sampling.bitwise False)."""
  return x >= jnp.take(-jnp.sort(-x, axis=-1), k - 1, axis=-1)[..., None]


def _sorted_top_p_mask(probs, top_p):
  """_top_p_mask from a sort of the row (Sampling.bitwise False)."""
  desc = -jnp.sort(-probs, axis=-1)
  before = jnp.cumsum(desc, axis=-1) - desc  # mass strictly above each sorted entry
  kept = jnp.sum(before < top_p, axis=-1, keepdims=True)  # >= 1
  return probs >= jnp.take_along_axis(desc, kept - 1, axis=-1)


def _adjusted_logits(logits, sampling: Sampling):
  """logits / temperature with the entries top-k / top-p leave out set to -inf."""
  x = logits.astype(jnp.float32) / sampling.temperature
  v = x.shape[-1]
  neg = jnp.array(-jnp.inf, x.dtype)
  if sampling.use_top_k:
    k = jnp.clip(sampling.top_k, 1, v)
    keep = (_top_k_mask if sampling.bitwise else _sorted_top_k_mask)(x, k)
    x = jnp.where((sampling.top_k > 0) & ~keep, neg, x)
  if sampling.use_top_p:
    probs = jax.nn.softmax(x, axis=-1)
    keep = (_top_p_mask if sampling.bitwise else _sorted_top_p_mask)(probs, sampling.top_p)
    x = jnp.where((sampling.top_p < 1.0) & ~keep, neg, x)
  return x


def adjusted_logprobs(logits: Array, sampling: Sampling) -> Array:
  """log of the distribution plain sampling draws from: temperature, then top-k, then top-p."""
  return jax.nn.log_softmax(_adjusted_logits(logits, sampling), axis=-1)


def adjusted_probs(logits: Array, sampling: Sampling) -> Array:
  """exp(adjusted_logprobs), computed directly."""
  return jax.nn.softmax(_adjusted_logits(logits, sampling), axis=-1)


def categorical(keys_B, weights_BxV):
  """One draw per row from the distribution proportional to weights_BxV (>= 0).

  Inverse CDF from one uniform per row: V times fewer random bits than Gumbel-max
  (jax.random.categorical), 3.5-5x cheaper a step (benchmarks/sampling_cost.py). Token
  j is drawn iff cdf[j-1] <= u * total < cdf[j], with probability w_j / total.
  """
  u_B = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys_B)
  cdf = jnp.cumsum(weights_BxV, axis=-1)
  tok = jnp.sum(cdf <= (u_B * cdf[:, -1])[:, None], axis=-1).astype(jnp.int32)
  tok = jnp.minimum(tok, weights_BxV.shape[-1] - 1)
  # A windowed cumsum need not be exactly monotone: never return a weight-0 token.
  ok = jnp.take_along_axis(weights_BxV, tok[:, None], -1)[:, 0] > 0
  return jnp.where(ok, tok, jnp.argmax(weights_BxV, -1).astype(jnp.int32))


def draw(greedy: bool, logits_BxV, sampling: Sampling, keys_B, may_argmax=True):
  """(token [B], q [B, V] the distribution it was drawn from; [B, 0] when greedy).

  Sampling with sampling.draft_argmax (and may_argmax): the argmax, drawn from the
  one-hot q; else a sample of the adjusted distribution q.
  """
  if greedy:
    return jnp.argmax(logits_BxV, -1).astype(jnp.int32), jnp.zeros(logits_BxV.shape[:1] + (0,))
  q = adjusted_probs(logits_BxV, sampling)
  tok = categorical(keys_B, q)
  if not may_argmax:
    return tok, q
  top = jnp.argmax(q, -1).astype(jnp.int32)
  one_hot = jax.nn.one_hot(top, q.shape[-1], dtype=jnp.float32)
  return (jnp.where(sampling.draft_argmax, top, tok),
          jnp.where(sampling.draft_argmax, one_hot, q))


def row_keys(keys_B, salt):
  """Per row, the row's key folded with `salt`: independent streams per use."""
  return jax.vmap(lambda k: jax.random.fold_in(k, salt))(keys_B)


def take_rows(x, idx_B):
  """x[b, idx_B[b]] for x of shape [B, T, ...]."""
  return x[jnp.arange(x.shape[0]), idx_B]


def accept(greedy: bool, logits_BxTxV, drafts_BxA, q_BxAxV, sampling: Sampling, keys_B,
           proposed_B=None):
  """(a [B] accepted drafts, candidates [B, A+1]: d_1..d_a, the bonus, then PAD_ID).

  Greedy: a draft is accepted while it equals the main model's argmax. Sampling: the
  speculative rule, draft d_j accepted with probability min(1, p(d_j) / q(d_j)), which
  leaves the committed tokens distributed exactly as plain sampling from p.
  proposed_B: only the first proposed_B[b] drafts of row b are proposals (an adaptive
  draft length, decided from the drafts' side alone); when all of them are accepted
  the bonus is drawn from p itself, as after a block of exactly that many drafts.
  """
  dn = drafts_BxA.shape[1]
  j = jnp.arange(dn + 1)
  proposed = jnp.full(drafts_BxA.shape[:1], dn, jnp.int32) if proposed_B is None else proposed_B
  if greedy:
    g = jnp.argmax(logits_BxTxV, -1).astype(jnp.int32)
    ok = ((drafts_BxA == g[:, :dn]) & (j[:dn] < proposed[:, None])).astype(jnp.int32)
    a = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)
    return a, jnp.where(j <= a[:, None], g, PAD_ID)  # d_j == g_{j-1} for j <= a
  p = adjusted_probs(logits_BxTxV, sampling)  # [B, A+1, V]
  p_d = jnp.take_along_axis(p[:, :dn], drafts_BxA[..., None], -1)[..., 0]
  q_d = jnp.take_along_axis(q_BxAxV, drafts_BxA[..., None], -1)[..., 0]
  u = jax.vmap(lambda k: jax.random.uniform(k, (dn,)))(row_keys(keys_B, 2))
  ok = ((u * q_d < p_d) & (j[:dn] < proposed[:, None])).astype(jnp.int32)  # min(1, p/q)
  a = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)
  # First rejection at j: sample normalize(max(0, p_j - q_{j+1})); all proposed accepted: p.
  residual = jnp.concatenate([jnp.maximum(p[:, :dn] - q_BxAxV, 0.0), p[:, dn:]], 1)
  r = jnp.where((a == proposed)[:, None], take_rows(p, a), take_rows(residual, a))
  r = jnp.where(jnp.sum(r, -1, keepdims=True) > 0, r, take_rows(p, a))  # p == q: never rejected
  bonus = categorical(row_keys(keys_B, 3), r)
  cand = jnp.concatenate([drafts_BxA, jnp.zeros_like(bonus)[:, None]], 1)
  cand = jnp.where(j < a[:, None], cand, jnp.where(j == a[:, None], bonus[:, None], PAD_ID))
  return a, cand


def __getattr__(name: str):  # a name an earlier release had here: mtp_jax.MOVED_NAMES
  return mtp_jax.moved_name(__name__, name)
