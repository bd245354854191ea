"""The statistics of a multi-seed sweep: means, Welch and paired t-tests, standard errors."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats


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
  """Paired t test of a - b (same seeds: same data order and trunk initialisation)."""
  d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  m, s = mean_std(d)
  if s == 0:
    return {'diff': m, 't': math.inf if m else 0.0, 'p': 0.0 if m else 1.0}
  t = m / (s / math.sqrt(len(d)))
  return {'diff': m, 't': t, 'p': float(2 * stats.t.sf(abs(t), len(d) - 1))}


def batch_bpb_se(loss_sums: Sequence[float], bytes_: Sequence[float]) -> float:
  """Standard error of the corpus bpb from per-batch (loss, bytes) sums: ratio estimator
  over batches (contiguous packed text), so within-batch correlation is accounted for."""
  ls, by = np.asarray(loss_sums, np.float64), np.asarray(bytes_, np.float64)
  n = len(ls)
  r = ls.sum() / by.sum()
  resid = (ls - r * by) / by.mean()
  return float(math.sqrt((resid ** 2).sum() / (n * (n - 1))) / math.log(2)) if n > 1 else 0.0
