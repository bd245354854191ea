"""The statistics of a multi-seed sweep: means, Welch and paired t-tests, standard errors,
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
