"""The statistics of a multi-seed sweep: means, Welch and paired t-tests, the exact
sign-flip test, equivalence (TOST), outliers by the modified z-score, standard errors,
Holm's family-wise correction, power."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import optimize, stats


def mean_std(xs: Sequence[float]) -> tuple[float, float]:
  """Mean and sample standard deviation (ddof 1; 0 for one value)."""
  a = np.asarray(xs, np.float64)
  return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def welch(a: Sequence[float], b: Sequence[float]) -> dict:
  """Welch's t test of mean(a) - mean(b): t, Welch-Satterthwaite dof, two-sided p."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
  se = math.sqrt(va + vb)
  diff = float(a.mean() - b.mean())
  if se == 0:
    return {'diff': diff, 't': math.inf if diff else 0.0, 'dof': None, 'p': 0.0 if diff else 1.0}
  dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
  t = diff / se
  return {'diff': diff, 't': t, 'dof': dof, 'p': float(2 * stats.t.sf(abs(t), dof))}


def paired(a: Sequence[float], b: Sequence[float]) -> dict:
  """Paired t test of a - b (same seeds: same data order and trunk initialisation), with the
  95 % confidence interval of the mean difference (t with n - 1 dof)."""
  d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  m, s = mean_std(d)
  if s == 0:
    return {'diff': m, 't': math.inf if m else 0.0, 'p': 0.0 if m else 1.0, 'ci95': [m, m]}
  se = s / math.sqrt(len(d))
  half = float(stats.t.ppf(0.975, len(d) - 1)) * se
  return {'diff': m, 't': m / se, 'p': float(2 * stats.t.sf(abs(m / se), len(d) - 1)),
          'ci95': [m - half, m + half]}


def batch_bpb_se(loss_sums: Sequence[float], bytes_: Sequence[float]) -> float:
  """Standard error of the corpus bpb from per-batch (loss, bytes) sums: ratio estimator
  over batches (contiguous packed text), so within-batch correlation is accounted for."""
  ls, by = np.asarray(loss_sums, np.float64), np.asarray(bytes_, np.float64)
  n = len(ls)
  r = ls.sum() / by.sum()
  resid = (ls - r * by) / by.mean()
  return float(math.sqrt((resid ** 2).sum() / (n * (n - 1))) / math.log(2)) if n > 1 else 0.0


def paired_power(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
  """Power of the two-sided paired t test (n pairs, sd of the paired differences) to find a
  true mean difference `effect`: P(|T| > t_(1-alpha/2, n-1)) with T noncentral t of
  n - 1 degrees of freedom and noncentrality effect sqrt(n) / sd."""
  if n < 2:
    return 0.0
  if sd <= 0:
    return 1.0 if effect else alpha
  dof, ncp = n - 1, abs(effect) * math.sqrt(n) / sd
  crit = stats.t.ppf(1 - alpha / 2, dof)
  p = float(stats.nct.sf(crit, dof, ncp) + stats.nct.cdf(-crit, dof, ncp))
  # scipy's noncentral t can fail far in the tail (1 dof, large ncp): the power is ~1 there
  return p if math.isfinite(p) else float(stats.norm.sf(crit - ncp))


def min_detectable_effect(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
  """The smallest true mean paired difference the two-sided paired t test of n pairs
  detects with probability `power` at level `alpha` (exact, noncentral t); inf for n < 2."""
  if n < 2:
    return math.inf
  if sd <= 0:
    return 0.0
  hi = sd
  while paired_power(hi, sd, n, alpha) < power:
    hi *= 2
  return float(optimize.brentq(lambda e: paired_power(e, sd, n, alpha) - power, 0.0, hi,
                               xtol=1e-10))


def seeds_for_effect(effect: float, sd: float, alpha: float = 0.05, power: float = 0.8,
                     max_seeds: int = 10_000) -> int:
  """The fewest pairs (seeds) whose paired t test detects `effect` (min_detectable_effect
  <= effect); max_seeds + 1 when none up to max_seeds does."""
  n = 2
  while n <= max_seeds and min_detectable_effect(sd, n, alpha, power) > effect:
    n += 1
  return n


def pooled_sd(groups: Sequence[Sequence[float]]) -> tuple[float, int]:
  """(pooled sample sd, degrees of freedom) of several samples, each about its own mean."""
  ss, dof = 0.0, 0
  for g in groups:
    a = np.asarray(g, np.float64)
    if len(a) > 1:
      ss += float(((a - a.mean()) ** 2).sum())
      dof += len(a) - 1
  return (math.sqrt(ss / dof) if dof else 0.0), dof


def holm(ps: Sequence[float]) -> list[float]:
  """Holm's step-down adjusted p-values of one family of m tests, in the input order.

  Sorted ascending p_(1) <= ... <= p_(m): adjusted p_(j) = max over i <= j of
  min(1, (m - i + 1) p_(i)). Rejecting where the adjusted p < alpha holds the family-wise
  error rate at alpha whatever the dependence between the tests (Holm 1979).
  """
  m = len(ps)
  order = sorted(range(m), key=lambda i: ps[i])
  out, running = [0.0] * m, 0.0
  for rank, i in enumerate(order):
    running = max(running, min(1.0, (m - rank) * float(ps[i])))
    out[i] = running
  return out


EXACT_MAX_N = 10  # paired tests of at most this many pairs use the exact sign-flip test


def sign_flip(d: Sequence[float], shift: float = 0.0, alternative: str = 'two-sided') -> float:
  """Exact sign-flip (paired permutation) p of the mean of d - shift against 0: under the
  null the differences are symmetric about `shift`, so each of the 2^n sign patterns of
  d - shift is equally likely. 'two-sided': P(|sum| >= |observed|); 'greater': P(sum >=
  observed) (evidence the mean exceeds `shift`); 'less': P(sum <= observed). n pairs can
  give no p below 2 / 2^n (two-sided) or 1 / 2^n (one-sided)."""
  x = np.asarray(d, np.float64) - shift
  n = len(x)
  signs = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)
  sums, obs = signs @ x, float(x.sum())
  tol = 1e-12 * max(1.0, float(np.abs(x).sum()))
  if alternative == 'two-sided':
    hits = np.abs(sums) >= abs(obs) - tol
  elif alternative == 'greater':
    hits = sums >= obs - tol
  elif alternative == 'less':
    hits = sums <= obs + tol
  else:
    raise ValueError(f'alternative must be two-sided, greater or less, got {alternative!r}')
  return float(hits.mean())


def equivalence(d: Sequence[float], margin: float) -> dict:
  """Two one-sided tests (TOST) that the mean paired difference lies within (-margin,
  +margin): p is the larger of the two one-sided p (exact sign-flip for at most
  EXACT_MAX_N pairs, else t); equivalence at level alpha when p < alpha, which is the 90 %
  interval (`ci90`, t) lying inside the margin when the t test is used."""
  x = np.asarray(d, np.float64)
  n = len(x)
  m, s = mean_std(x)
  se = s / math.sqrt(n) if n > 1 else math.inf
  half = float(stats.t.ppf(0.95, n - 1)) * se if n > 1 else math.inf
  if n <= EXACT_MAX_N:
    p_lo = sign_flip(x, -margin, 'greater')
    p_hi = sign_flip(x, margin, 'less')
    test = 'sign-flip (exact)'
  elif se == 0:
    p_lo = p_hi = 0.0 if -margin < m < margin else 1.0
    test = 'paired t'
  else:
    p_lo = float(stats.t.sf((m + margin) / se, n - 1))
    p_hi = float(stats.t.cdf((m - margin) / se, n - 1))
    test = 'paired t'
  return {'margin': margin, 'p': max(p_lo, p_hi), 'p_lower': p_lo, 'p_upper': p_hi,
          'ci90': [m - half, m + half], 'test': test, 'n': n}


def outliers(values: dict, threshold: float = 3.5) -> dict:
  """{key: value} of the values whose modified z-score 0.6745 |x - median| / MAD exceeds
  `threshold` (Iglewicz & Hoaglin 1993); {} with fewer than 5 values or a MAD of 0."""
  keys = [k for k, v in values.items() if v is not None]
  if len(keys) < 5:
    return {}
  x = np.asarray([values[k] for k in keys], np.float64)
  med = float(np.median(x))
  mad = float(np.median(np.abs(x - med)))
  if mad == 0:
    return {}
  return {k: values[k] for k, z in zip(keys, 0.6745 * np.abs(x - med) / mad) if z > threshold}
