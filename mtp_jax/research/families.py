"""The statistics of the sweep's tables: per-seed figures aggregated over seeds, the paired
test of each declared comparison, and Holm's correction within each family of tests.

Numpy and scipy only (mtp_jax.research.stats): the tables run without JAX.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import mtp_jax.research.results as results_lib
import mtp_jax.research.stats as stats

# Figures that depend on the held-out corpus: its bits per byte and agreement, and every
# decoding figure (the decoding prompts are held-out documents). The corpus is built from
# the installed packages, so it can differ between the machines a sweep ran on; so can the
# stdlib validation split (the interpreter's standard library).
HELDOUT_METRICS = ('heldout_', 'tau_', 'accept_', 'distinct4_', 'projected_speedup_')
STDLIB_METRICS = ('stdlib_',)


def metric_corpus(metric: str) -> str | None:
  """The corpus ('heldout', 'stdlib_val') a figure was measured on; None: neither."""
  if metric.startswith(HELDOUT_METRICS):
    return 'heldout'
  return 'stdlib_val' if metric.startswith(STDLIB_METRICS) else None


# The endpoints whose per-seed values are screened for outliers (stats.outliers, the rule
# design.OUTLIER_RULE declares): flagged in the summary, never excluded from a test.
OUTLIER_METRICS = ('stdlib_bpb', 'heldout_bpb', 'tau_T1', 'tau_T0.7', 'copy_acc_final',
                   'copy_acc_equal_flops', 'copy_acc_half')


def aggregate(per_run: dict[int, dict]) -> dict:
  """{metric: {'per_seed': {seed: v}, 'mean', 'std', 'n'}} over the seeds (None-free
  metrics); an endpoint (OUTLIER_METRICS) with outlying seeds also has `outliers`."""
  seeds = sorted(per_run)
  keys = sorted({k for m in per_run.values() for k in m})
  out = {}
  for k in keys:
    vals = {s: per_run[s].get(k) for s in seeds}
    got = [v for v in vals.values() if v is not None]
    mean, std = stats.mean_std(got) if got else (None, None)
    out[k] = {'per_seed': vals, 'mean': mean, 'std': std, 'n': len(got)}
    far = stats.outliers(vals) if k in OUTLIER_METRICS else {}
    if far:  # reported beside the figures, never left out of them
      out[k]['outliers'] = far
  return out


def eval_se_of_difference(a: dict, b: dict, budget: str, corpus: str) -> float:
  """Standard error, from eval sampling alone, of bpb(a) - bpb(b): both runs are scored
  on the same batches, so the per-batch differences give it (stats.batch_bpb_se)."""
  ea, eb = a['evals'][budget][corpus], b['evals'][budget][corpus]
  diff = np.subtract(ea['batch_loss_sum_main'], eb['batch_loss_sum_main'])
  return stats.batch_bpb_se(diff, ea['batch_bytes_main'])


def holm_within(tests: dict, names: Sequence[str], family: str,
                ps: Sequence[float] | None = None) -> None:
  """Holm-adjust one family of `tests` in place: each named test gets p_holm, family and
  family_size; over `ps` (default: each test's p)."""
  ps = [tests[n]['p'] for n in names] if ps is None else ps
  for name, adj in zip(names, stats.holm(ps)):
    tests[name].update(p_holm=adj, family=family, family_size=len(names))


def holm_family(tests: dict, family: str) -> None:
  """The legacy groups' family (lm, induction): Holm over each test's paired p where it has
  one, else its Welch p."""
  names = list(tests)
  holm_within(tests, names, family, [tests[n]['paired']['p'] if 'paired' in tests[n]
                                     else tests[n]['welch']['p'] for n in names])


def paired_test(a: dict, b: dict, margin: float | None = None) -> dict | None:
  """The paired test of per-seed values a - b over their common seeds: its p from the exact
  sign-flip test at up to stats.EXACT_MAX_N pairs (`test` says which; `p_min` is the least
  p that many pairs can give), else from the paired t test; the t statistic, the 95 % t
  interval of the mean difference, and the minimum detectable effect (paired t, alpha
  0.05, power 0.8) at the observed sd of the differences. With a declared `margin`, its
  equivalence test (stats.equivalence) as `equivalence`."""
  common = sorted(s for s in a if s in b and a[s] is not None and b[s] is not None)
  if len(common) < 2:
    return None
  diffs = [a[s] - b[s] for s in common]
  out = stats.paired([a[s] for s in common], [b[s] for s in common])
  n, sd = len(common), stats.mean_std(diffs)[1]
  if n <= stats.EXACT_MAX_N:
    out = {**out, 'p_t': out['p'], 'p': stats.sign_flip(diffs), 'test': 'sign-flip (exact)',
           'p_min': 2 / 2 ** n}
  else:
    out['test'] = 'paired t'
  out.update(n=n, sd=sd, mde=stats.min_detectable_effect(sd, n))
  if margin is not None:
    out['equivalence'] = stats.equivalence(diffs, margin)
  return out


def family_tests(table: dict, families: dict, runs: dict | None = None,
                 margins: dict | None = None) -> tuple[dict, dict]:
  """The paired test (paired_test) of every declared comparison (v, ref, metric) whose two
  variants have the metric, named 'v - ref metric' and Holm-adjusted within its family
  (p_holm, family_size); and per family the comparisons tested, as (v, ref, metric, v's
  per-seed values, ref's). With `runs` ({variant: {seed: run}}), a figure measured on a
  corpus (metric_corpus) pairs only seeds whose two runs were scored on the same one
  (results.same_corpus); the seeds left out are the test's `other_corpus_seeds`.
  `margins` {'v - ref metric': margin}: the declared equivalence margins (a test named
  there also gets its equivalence test)."""
  tests, done = {}, {}
  for family, members in families.items():
    rows = done.setdefault(family, [])
    for v, ref, metric in members:
      if v not in table or ref not in table:
        continue
      a, b = table[v]['metrics'].get(metric), table[ref]['metrics'].get(metric)
      if not (a and b):
        continue
      a, b, other = a['per_seed'], b['per_seed'], []
      corpus = metric_corpus(metric)
      if runs is not None and corpus is not None:
        other = sorted(s for s in a if s in b and not results_lib.same_corpus(
            runs[v][s], runs[ref][s], corpus))
        a, b = ({s: x for s, x in d.items() if s not in other} for d in (a, b))
      t = paired_test(a, b, (margins or {}).get(f'{v} - {ref} {metric}'))
      if t is None:
        continue
      tests[f'{v} - {ref} {metric}'] = {**t, 'family': family,
                                        **({'other_corpus_seeds': other} if other else {})}
      rows.append((v, ref, metric, a, b))
    holm_within(tests, [f'{v} - {ref} {metric}' for v, ref, metric, _, _ in rows], family)
  return tests, done


def every_test(summary: dict):
  """(where, name, test) of every test in a summary, in document order: the sized sweep and
  the compute study per budget, the drafter study, name-story and BPE induction, and the
  legacy groups."""
  for group in ('sized', 'compute'):
    for budget, part in (summary.get(group) or {}).items():
      for name, t in part['tests'].items():
        yield f'{group}, {budget}', name, t
  for group in ('drafter', 'names', 'bpe_names'):
    for name, t in (summary.get(group) or {}).get('tests', {}).items():
      yield group, name, t
  for key, tests in summary.get('tests', {}).items():
    for name, t in tests.items():
      yield f'legacy {key}', name, t


def holm_global(summary: dict) -> dict:
  """One Holm correction over every test the summary holds, difference and equivalence
  tests together: each test gets p_holm_global (and its `equivalence`, where declared, its
  own); returns {'size', 'alpha', 'tests': [[where, name, kind], ...]}."""
  entries = []
  for where, name, t in every_test(summary):
    p = t['p'] if 'p' in t else (t['paired'] if 'paired' in t else t['welch'])['p']
    entries.append((where, name, 'difference', t, p))
    if 'equivalence' in t:
      entries.append((where, name, 'equivalence', t['equivalence'], t['equivalence']['p']))
  for (*_, target, _), adj in zip(entries, stats.holm([e[-1] for e in entries])):
    target['p_holm_global'] = adj
  return {'size': len(entries), 'alpha': 0.05,
          'tests': [[where, name, kind] for where, name, kind, _, _ in entries]}
