"""Sizing a sweep to the paired effect it must detect, before it runs.

The spread: from a committed sweep (OUT/sized.json, else OUT/lm.json), the per-seed paired
differences bpb(variant) - bpb(M = 0) of every MTP variant, on both evaluation corpora,
pooled into one standard deviation of a paired difference per budget (stats.pooled_sd; each
comparison about its own mean, so the effects themselves do not count as spread).

The design: seeds n and steps S per equal-token run (tokens per run = S x tokens per
step), with one run per (variant, budget) because a decayed learning rate makes every
budget its own run. `choose` takes the measured seconds per step of each variant and per
evaluation, and
1. the seeds n_needed whose minimum detectable paired effect (two-sided paired t, alpha,
   power; stats.min_detectable_effect) at the equal-token spread is <= the target;
2. if n_needed seeds at the minimum steps fit the time budget: n = n_needed, and S the
   most steps that still fit (more tokens per run);
3. else the most seeds that fit at the minimum steps (at least min_seeds), S likewise;
4. if not even min_seeds fit: min_seeds at the minimum steps, marked over budget, with
   its wall time.
The spread is assumed not to shrink with more tokens per run or the decayed schedule
(conservative: both are expected to reduce it), so the minimum detectable effects it
reports are upper bounds under that assumption; the sweep's own tables report the
ones its results support.

Standard library, numpy and scipy only (mtp_jax.research.stats).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from scipy import stats as scipy_stats

import mtp_jax.research.results as results_lib
import mtp_jax.research.stats as stats

# The families of paired tests of the sized sweep, declared before its runs: the tables
# apply Holm's correction within each family at each budget, over the family's tests whose
# two arms both have runs. A test is (variant, reference, metric); `mtp-ablation --design`
# writes them into OUT/design.json, which the tables then read.
MAIN_HEAD_METRICS = ('stdlib_bpb', 'heldout_bpb')
FAMILIES = {
    'main head against d0': [(v, 'd0', m) for v in ('d1', 'd3', 'd3f', 'd3r', 'd3p', 't1')
                             for m in MAIN_HEAD_METRICS],
    'curriculum against static d3': [(v, 'd3', m) for v in ('d3f', 'd3r')
                                     for m in MAIN_HEAD_METRICS + ('tau_T0', 'tau_T1')],
    'TOP against d1': [('t1', 'd1', m) for m in MAIN_HEAD_METRICS],
}
# The arms of the main-head question: the seeds added to the committed sweep run these at
# equal tokens (and equal FLOPs), until the minimum detectable effect is TARGET_MDE.
MAIN_HEAD_ARMS = ('d0', 'd1', 'd3', 'd3r', 't1')

# The drafter study (configs/drafter.py), declared before its runs: per seed one frozen
# next-token trunk and a drafter per arm on it. The primary endpoint is tau (tokens per
# verify step) of free-running self-speculative decoding at T = 1 from the held-out
# prompts, the secondary tau at T = 0.7; each is one Holm family of every arm against
# the reference drafter `ref`.
DRAFTER_REFERENCE = 'ref'
DRAFTER_ARMS = ('shared', 'self', 'lamdecay', 'fwd', 'rev', 'leap')
DRAFTER_ENDPOINTS = {'primary': 'tau_T1', 'secondary': 'tau_T0.7'}
DRAFTER_FAMILIES = {
    'drafter arms against the reference, tau at T = 1 (primary)': [
        (a, DRAFTER_REFERENCE, 'tau_T1') for a in DRAFTER_ARMS],
    'drafter arms against the reference, tau at T = 0.7 (secondary)': [
        (a, DRAFTER_REFERENCE, 'tau_T0.7') for a in DRAFTER_ARMS],
}
DRAFTER_TARGET_MDE = 0.1  # tokens per verify step: a tenth of a token a step
DRAFTER_MIN_SEEDS = 10
# The planning spread: the committed sized sweep's paired tau differences between its
# M = 3 sequential arms (each curriculum against static d3, equal tokens). Their trunks
# differ by arm; the study's arms share one frozen trunk, so its spread is expected to be
# smaller and the seeds below are an upper bound under that expectation.
DRAFTER_SPREAD_PAIRS = (('d3f', 'd3'), ('d3r', 'd3'))

TARGET_MDE = 0.05  # bits per byte
ALPHA, POWER = 0.05, 0.8

# Declared after the committed drafter, sized and induction results had been seen: what
# follows fixes how those results are read, not what was planned before them.
# Equivalence: a difference is called negligible only when its two one-sided tests against
# the declared margin (stats.equivalence) reject after the global Holm correction.
EQUIVALENCE_MARGINS = {'shared - ref tau_T1': 0.1, 'shared - ref tau_T0.7': 0.1}
EQUIVALENCE_REASON = (
    '0.1 tokens per verify step is DRAFTER_TARGET_MDE, the smallest tau difference the '
    'drafter study was sized to detect before its runs (about 4 % of ref\'s tau); the '
    'margin applies to the one arm whose question is "as good as three modules" (FastMTP\'s '
    'single shared module); it was chosen after the study\'s results were seen')
OUTLIER_RULE = {
    'rule': 'modified z-score 0.6745 |x - median| / MAD > 3.5 among one arm\'s per-seed '
            'values of an endpoint (Iglewicz & Hoaglin 1993)',
    'action': 'reported in summary.json (`outliers`) and in docs/research.md; no run is '
              'excluded from any test',
    'declared': 'after the runs'}
EXACT_RULE = 'paired tests of at most 10 seeds take the exact sign-flip p (stats.EXACT_MAX_N)'
GLOBAL_HOLM = ('one Holm correction over every difference and equivalence test summary.json '
               'holds (p_holm_global), beside the declared families\' own')

# Is MTP worth its compute? (not yet run) The sized sweep's trunk is 2 layers, where one
# MTP module is 38 % of a d1 step's training FLOPs; at configs/ablation.py's ',deep'
# (DEEP_LAYERS) the same module is 13.9 %. Arms on that trunk, one run per budget, seed s
# as in the sized sweep: d0, d1 at d0's tokens, d1 at d0's training FLOPs. The primary
# endpoint is held-out bits per byte of d1 at equal FLOPs minus d0, paired by seed; its
# seeds are those whose minimum detectable effect at the committed sized sweep's paired
# spread of exactly that comparison is at most TARGET_MDE (compute_design). Written into
# OUT/design.json (key `compute`) by `mtp-ablation --declare`; run by `--groups compute`.
COMPUTE_VARIANTS = ('d0', 'd1')
COMPUTE_STEPS = 1010  # an equal-token run: the sized sweep's 1.03 M tokens
COMPUTE_PRIMARY = ('d1', 'd0', 'heldout_bpb', 'equal_flops')
# one Holm family per budget, as the sized sweep's; the primary test is its first member
COMPUTE_FAMILIES = {'compute study, d1 against d0': [('d1', 'd0', 'heldout_bpb'),
                                                     ('d1', 'd0', 'stdlib_bpb')]}
COMPUTE_MIN_SEEDS = 10

# The production drafter recipe (not yet run): on the drafter study's frozen trunks, one
# shared module (FastMTP, DeepSeek-V3's one reused module) trained on the trunk's soft
# targets (loss.mtp_targets 'soft') and on text the trunk sampled (mtp-self-distill data);
# each against `shared` (corpus targets) and against `ref`, tau at T = 1 primary, T = 0.7
# secondary: one Holm family per endpoint, added to the study's seeds 0-19.
PRODUCTION_ARMS = {
    'shared_soft': {'model.mtp.share_modules': True, 'loss.mtp_targets': 'soft'},
    'shared_distill': {'model.mtp.share_modules': True, 'data': 'mtp-self-distill of trunk, '
                       'T = 1, as many tokens as an arm trains on'},
}
PRODUCTION_FAMILIES = {
    f'production drafters, {metric} ({role})': [
        (a, ref, metric) for a in PRODUCTION_ARMS for ref in ('shared', DRAFTER_REFERENCE)]
    for role, metric in DRAFTER_ENDPOINTS.items()}
PRODUCTION_SPEED = ('speed-up measured by decoding on the study\'s own models on the host '
                    'that trained them: autoregressive and speculative alternated in one '
                    'process per arm, beside tau')

# Induction powered (not yet run): bpe_names at 1.06 M, seeds 5-14 added to 0-4 (15 a
# variant). Primary endpoint, declared before these seeds: the area under the copy-accuracy
# curve over the scored steps (trapezoid, per step), n2 minus d0 paired by seed; secondary:
# the first scored step with copy accuracy >= 0.15 (censored at the last step: a run that
# never reaches it counts as the last step plus one evaluation interval). Exact sign-flip
# tests up to 10 seeds, paired t above; one Holm family of the two.
INDUCTION_SEEDS = tuple(range(5, 15))
INDUCTION_ENDPOINTS = {'primary': 'copy_acc_auc', 'secondary': 'steps_to_0.15'}
INDUCTION_THRESHOLD = 0.15
MIN_SEEDS = 5
TOKENS_FACTOR = 3  # tokens per run: at least this many times the committed sweep's
BUDGET_HOURS = 2.0
CORPORA = ('stdlib_val', 'heldout')


def committed_evals(out_dir: str) -> tuple[str, dict]:
  """A committed sweep's evaluations by (variant, budget, seed): the group it read (`sized`
  when there is a sized.json, else `lm`) and {(variant, budget, seed): run}. A sized run is
  one budget (`d1@tokens`, `d1@flops`) and is keyed by its variant alone; the baseline's
  one equal-token run serves both budgets, as in the tables."""
  for group in ('sized', 'lm'):
    runs = results_lib.load_results(out_dir, group)
    if runs:
      break
  else:
    raise FileNotFoundError(f'no sized.json or lm.json under {out_dir}: the spread comes from a '
                            'committed sweep')
  out = {}
  for r in runs:
    for budget in r['evals']:
      out[(r['variant'].split('@')[0], budget, r['seed'])] = r
  return group, out


def committed_spread(out_dir: str, baseline: str = 'd0', variants=None) -> dict:
  """The paired spread of a committed sweep, per budget: pooled sd, its dof, each
  comparison's sd, plus the sweep's seeds and tokens per run; `variants`: pool only
  these variants' comparisons (default: every variant). A difference pairs only runs
  scored on the same corpus (results.same_corpus)."""
  group, by = committed_evals(out_dir)
  base = {s: r for (v, _, s), r in by.items() if v == baseline}
  if not base:
    raise ValueError(f'{out_dir}/{group}.json has no {baseline} runs to pair against')
  any_base = next(iter(base.values()))
  out = {'group': group, 'seeds': sorted(base), 'steps': int(any_base['steps']),
         'tokens_per_step': int(any_base['tokens_per_step']),
         'tokens_per_run': int(any_base['steps']) * int(any_base['tokens_per_step']),
         'budgets': {}}
  variants = sorted({v for v, _, _ in by if v != baseline and (variants is None or v in variants)})
  budgets = sorted({b for _, b, _ in by})
  for budget in budgets:
    groups, each, pairs = [], {}, {}
    for v in variants:
      for corpus in CORPORA:
        diffs = []
        for s in sorted(base):
          run = by.get((v, budget, s))
          if run is None:
            continue
          if not results_lib.same_corpus(run, base[s], corpus):
            continue
          ref = base[s]['evals'].get(budget) or next(iter(base[s]['evals'].values()))
          diffs.append(run['evals'][budget][corpus]['bpb'][0] - ref[corpus]['bpb'][0])
        if len(diffs) > 1:
          groups.append(diffs)
          each[f'{v} - {baseline} {corpus}'] = stats.mean_std(diffs)[1]
          pairs[f'{v} - {baseline} {corpus}'] = len(diffs)
    sd, dof = stats.pooled_sd(groups)
    out['budgets'][budget] = {'pooled_sd': sd, 'dof': dof, 'comparisons': each, 'pairs': pairs}
  return out


def per_seed_seconds(runs: Sequence[tuple[str, str, int]], step_seconds: dict,
                     eval_seconds: dict) -> float:
  """Wall seconds of one seed's runs [(variant, budget, steps)]: steps x the variant's
  seconds per step, plus one evaluation per run."""
  return sum(step_seconds[v] * n + eval_seconds[v] for v, _, n in runs)


def choose(spread: dict, runs_for: Callable[[int], list], step_seconds: dict,
           eval_seconds: dict, *, budget_hours: float = BUDGET_HOURS,
           target: float = TARGET_MDE, min_seeds: int = MIN_SEEDS,
           tokens_factor: float = TOKENS_FACTOR, quantum: int = 10) -> dict:
  """The design (module docstring). runs_for(S): one seed's [(variant, budget, steps)]
  when the equal-token runs take S steps."""
  budget = budget_hours * 3600
  sd = spread['budgets']['equal_tokens']['pooled_sd']
  min_steps = int(math.ceil(tokens_factor * spread['steps'] / quantum) * quantum)
  per = lambda s: per_seed_seconds(runs_for(s), step_seconds, eval_seconds)  # noqa: E731
  needed = stats.seeds_for_effect(target, sd, ALPHA, POWER)
  fit = int(budget // per(min_steps))
  if fit >= max(needed, min_seeds):
    n, case = max(needed, min_seeds), 'target met within the budget'
  elif fit >= min_seeds:
    n, case = fit, 'the most seeds the budget allows; the target is not met'
  else:
    n, case = min_seeds, 'over budget: the minimum design does not fit'
  steps = min_steps
  if n * per(min_steps) <= budget:  # spend what is left on tokens per run
    while n * per(steps + quantum) <= budget:
      steps += quantum
  wall = n * per(steps)
  mde = {b: stats.min_detectable_effect(v['pooled_sd'], n, ALPHA, POWER)
         for b, v in spread['budgets'].items()}
  return {
      'seeds': n, 'steps': steps, 'tokens_per_run': steps * spread['tokens_per_step'],
      'tokens_factor': steps / spread['steps'], 'runs_per_seed': len(runs_for(steps)),
      'runs': runs_for(steps), 'wall_seconds': wall, 'per_seed_seconds': per(steps),
      'budget_seconds': budget, 'fits_budget': wall <= budget, 'case': case,
      'target_mde': target, 'alpha': ALPHA, 'power': POWER,
      'seeds_needed_for_target': needed,
      'wall_seconds_for_target': needed * per(min_steps),
      'min_detectable_effect': mde, 'spread': spread,
      'step_seconds': dict(step_seconds), 'eval_seconds': dict(eval_seconds)}


def main_head_design(spread: dict, arms=MAIN_HEAD_ARMS, target: float = TARGET_MDE,
                     step_seconds: dict | None = None, eval_seconds: dict | None = None,
                     runs_for: Callable[[int], list] | None = None) -> dict:
  """The seeds the main-head question needs: the arms' equal-token paired spread against
  the baseline (`spread`: committed_spread over these arms; pooled per corpus, the larger
  of the two), and the fewest seeds whose
  minimum detectable paired effect is <= `target`
  - at that spread (alpha ALPHA, power POWER: the stated criterion);
  - at the spread's one-sided 95 % upper confidence bound (chi-square, its dof): the seeds
    that still reach the target if the spread was estimated low;
  - at alpha / m (Holm's first step, m = the arms' tests against the baseline in the
    declared main-head family): the seeds that reach it family-wise.
  With step_seconds / eval_seconds per arm and runs_for(steps) (one seed's runs of these
  arms, ablation.sized_runs): the wall time of the seeds still to run."""
  tok = spread['budgets']['equal_tokens']
  # the larger corpus's pooled sd (each comparison has the same seeds: the root mean square)
  per_corpus = {c: math.sqrt(sum(v ** 2 for k, v in tok['comparisons'].items()
                                 if k.endswith(' ' + c))
                             / max(1, sum(k.endswith(' ' + c) for k in tok['comparisons'])))
                for c in CORPORA}
  sd, dof = max(per_corpus.values()), tok['dof'] // len(CORPORA)
  upper = sd * math.sqrt(dof / scipy_stats.chi2.ppf(0.05, dof)) if dof else math.inf
  family = FAMILIES['main head against d0']  # Holm runs over the whole declared family
  n = stats.seeds_for_effect(target, sd, ALPHA, POWER)
  out = {'arms': list(arms), 'target_mde': target, 'alpha': ALPHA, 'power': POWER,
         'committed_seeds': list(spread['seeds']), 'tokens_per_run': spread['tokens_per_run'],
         'pooled_sd_per_corpus': per_corpus, 'pooled_sd': sd, 'dof': dof,
         'pooled_sd_upper95': upper,
         'comparisons': tok['comparisons'],
         'mde_committed': stats.min_detectable_effect(sd, len(spread['seeds']), ALPHA, POWER),
         'seeds': n, 'mde_at_seeds': stats.min_detectable_effect(sd, n, ALPHA, POWER),
         'seeds_at_upper_sd': stats.seeds_for_effect(target, upper, ALPHA, POWER),
         'family_size': len(family),
         'seeds_familywise': stats.seeds_for_effect(target, sd, ALPHA / max(len(family), 1),
                                                    POWER)}
  if step_seconds and runs_for is not None:
    per = per_seed_seconds(runs_for(spread['steps']), step_seconds, eval_seconds)
    new_arm = [a for a in arms if a not in {c.split(' - ')[0] for c in tok['comparisons']}
               and a != 'd0']
    out['per_seed_seconds'] = per
    out['wall_seconds_to_add'] = (  # the committed arms need seeds n_committed..n-1 only
        max(0, n - len(spread['seeds'])) * per
        + len(spread['seeds']) * per_seed_seconds(
            [r for r in runs_for(spread['steps']) if r[0] in new_arm], step_seconds,
            eval_seconds))
  return out


def describe(design: dict) -> str:
  """The design as the lines the command prints."""
  sp = design['spread']
  tok = sp['budgets']['equal_tokens']
  lines = [
      f"Spread of the committed sweep (n = {len(sp['seeds'])}, {sp['tokens_per_run']:,} tokens "
      f"per run): sd of a paired bpb difference {tok['pooled_sd']:.4f} at equal tokens "
      f"(pooled, {tok['dof']} dof)" + ''.join(
          f", {v['pooled_sd']:.4f} at {b.replace('_', ' ')}"
          for b, v in sp['budgets'].items() if b != 'equal_tokens') + '.',
      f"Target: minimum detectable paired effect <= {design['target_mde']} bits per byte "
      f"(alpha {design['alpha']}, power {design['power']}): "
      f"{design['seeds_needed_for_target']} seeds at equal tokens, "
      f"{design['wall_seconds_for_target'] / 3600:.1f} h at the minimum tokens per run.",
      f"Chosen ({design['case']}): {design['seeds']} seeds x {design['runs_per_seed']} runs, "
      f"{design['steps']} steps = {design['tokens_per_run']:,} tokens per equal-token run "
      f"({design['tokens_factor']:.1f}x the committed sweep), estimated wall time "
      f"{design['wall_seconds'] / 3600:.2f} h (budget {design['budget_seconds'] / 3600:.1f} h).",
      'Minimum detectable paired effect of this design at the committed spread: ' + ', '.join(
          f"{b.replace('_', ' ')} {v:.3f}" for b, v in design['min_detectable_effect'].items())
      + ' bits per byte.',
      'Seconds per step (measured): ' + ', '.join(
          f'{v} {s:.3f}' for v, s in design['step_seconds'].items())
      + '; per evaluation: ' + ', '.join(
          f'{v} {s:.1f}' for v, s in design['eval_seconds'].items()) + '.']
  return '\n'.join(lines)


def describe_main_head(d: dict) -> str:
  """main_head_design's result as the lines the command prints."""
  wall = (f", about {d['wall_seconds_to_add'] / 3600:.1f} h of runs to add"
          if 'wall_seconds_to_add' in d else '')
  return '\n'.join([
      f"Main-head question ({', '.join(d['arms'])}, equal tokens): paired sd "
      f"{d['pooled_sd']:.4f} against {d['arms'][0]} (the larger corpus, {d['dof']} dof; 95 % "
      f"upper bound {d['pooled_sd_upper95']:.4f}); minimum detectable effect "
      f"{d['mde_committed']:.3f} at the committed {len(d['committed_seeds'])} seeds.",
      f"Minimum detectable effect <= {d['target_mde']}: {d['seeds']} seeds "
      f"({d['mde_at_seeds']:.4f}){wall}; {d['seeds_at_upper_sd']} if the spread is at its "
      f"upper bound; {d['seeds_familywise']} at alpha / {d['family_size']} (Holm's first "
      'step over the family).',
      f"Run: {d['command']}"])


def committed_tau_spread(out_dir: str, pairs=DRAFTER_SPREAD_PAIRS, metrics=None,
                         budget: str = 'equal_tokens') -> dict:
  """The paired spread of tau in a committed sweep (OUT/sized.json, else lm.json): see
  tau_spread."""
  group, by = committed_evals(out_dir)
  metrics = tuple(DRAFTER_ENDPOINTS.values()) if metrics is None else metrics
  return tau_spread(group, by, pairs, metrics, budget)


def drafter_spread(out_dir: str, spread_from: str, min_seeds: int = 3) -> dict:
  """The drafter study's own paired spread (OUT/drafter.json, every arm against the
  reference) once it has at least `min_seeds` seeds of the reference and an arm; before
  that the planning spread of the committed sweep under `spread_from`
  (committed_tau_spread)."""
  runs = results_lib.load_results(out_dir, 'drafter')
  by = {(r['variant'], budget, r['seed']): r for r in runs for budget in r['evals']}
  ref = {s for v, _, s in by if v == DRAFTER_REFERENCE}
  if any(len(ref & {s for v, _, s in by if v == a}) >= min_seeds for a in DRAFTER_ARMS):
    return tau_spread('drafter', by, [(a, DRAFTER_REFERENCE) for a in DRAFTER_ARMS],
                      tuple(DRAFTER_ENDPOINTS.values()), 'end')
  return committed_tau_spread(spread_from)


def tau_spread(group: str, by: dict, pairs, metrics, budget: str) -> dict:
  """Per metric (tau_<temperature>), the sd of the per-seed paired differences of each pair
  (variant, reference) at `budget` in `by` {(variant, budget, seed): run}, pooled
  (stats.pooled_sd); runs scored on different held-out corpora (whose documents are the
  prompts) are not paired."""
  out = {'group': group, 'pairs': [list(p) for p in pairs], 'budget': budget, 'metrics': {}}
  for metric in metrics:
    temp = metric.split('_', 1)[1]
    groups, each = [], {}
    for v, ref in pairs:
      diffs = []
      for (name, b, seed), run in sorted(by.items(), key=lambda kv: kv[0][2]):
        other = by.get((ref, b, seed))
        if name != v or b != budget or other is None:
          continue
        if not results_lib.same_corpus(run, other, 'heldout'):
          continue  # the prompts are held-out documents
        diffs.append(run['evals'][b]['decode'][temp]['tau']
                     - other['evals'][b]['decode'][temp]['tau'])
      if len(diffs) > 1:
        groups.append(diffs)
        each[f'{v} - {ref}'] = stats.mean_std(diffs)[1]
    sd, dof = stats.pooled_sd(groups)
    out['metrics'][metric] = {'pooled_sd': sd, 'dof': dof, 'comparisons': each,
                              'seeds': max((len(g) for g in groups), default=0)}
  return out


def drafter_design(spread: dict, target: float = DRAFTER_TARGET_MDE,
                   min_seeds: int = DRAFTER_MIN_SEEDS, families=None) -> dict:
  """The seeds of the drafter study, per endpoint at the planning spread (`spread`:
  committed_tau_spread): the fewest whose minimum detectable paired effect in tau is <=
  `target` at alpha ALPHA (power POWER) and at alpha / m (Holm's first step over the m arms
  of the endpoint's family), at the spread and at its one-sided 95 % upper bound; the
  chosen seeds (the primary endpoint's at alpha, at least min_seeds: the criterion
  main_head_design states) and the minimum detectable effect at them, at alpha and at
  alpha / m."""
  families = DRAFTER_FAMILIES if families is None else families
  out = {'reference': DRAFTER_REFERENCE, 'arms': list(DRAFTER_ARMS),
         'endpoints': dict(DRAFTER_ENDPOINTS), 'families': families, 'target_mde': target,
         'alpha': ALPHA, 'power': POWER, 'min_seeds': min_seeds, 'spread': spread,
         'per_endpoint': {}}
  for role, metric in DRAFTER_ENDPOINTS.items():
    sp = spread['metrics'][metric]
    sd, dof = sp['pooled_sd'], sp['dof']
    upper = sd * math.sqrt(dof / scipy_stats.chi2.ppf(0.05, dof)) if dof else math.inf
    m = max(1, sum(1 for tests in families.values() for t in tests if t[2] == metric))
    out['per_endpoint'][metric] = {
        'role': role, 'pooled_sd': sd, 'dof': dof, 'pooled_sd_upper95': upper,
        'family_size': m,
        'seeds_for_target': stats.seeds_for_effect(target, sd, ALPHA, POWER),
        'seeds_familywise': stats.seeds_for_effect(target, sd, ALPHA / m, POWER),
        'seeds_at_upper_sd': stats.seeds_for_effect(target, upper, ALPHA / m, POWER)}
  primary = out['per_endpoint'][DRAFTER_ENDPOINTS['primary']]
  n = max(min_seeds, primary['seeds_for_target'])  # the stated criterion, as main_head_design
  out['seeds'] = n
  for v in out['per_endpoint'].values():
    v['mde_at_seeds'] = stats.min_detectable_effect(v['pooled_sd'], n, ALPHA, POWER)
    v['mde_at_seeds_familywise'] = stats.min_detectable_effect(
        v['pooled_sd'], n, ALPHA / v['family_size'], POWER)
  return out


def describe_drafter(d: dict) -> str:
  """drafter_design's result as the lines the command prints."""
  lines = []
  for metric, v in d['per_endpoint'].items():
    lines.append(
        f"Drafter study, {v['role']} endpoint {metric}: paired sd {v['pooled_sd']:.4f} "
        f"({v['dof']} dof, 95 % upper bound {v['pooled_sd_upper95']:.4f}); minimum "
        f"detectable effect <= {d['target_mde']} tokens per verify step: "
        f"{v['seeds_for_target']} seeds at alpha {d['alpha']}, {v['seeds_familywise']} at "
        f"alpha / {v['family_size']}, {v['seeds_at_upper_sd']} at the upper bound; at "
        f"{d['seeds']} seeds: {v['mde_at_seeds']:.3f} ({v['mde_at_seeds_familywise']:.3f} "
        'family-wise).')
  if 'wall_seconds' in d:
    lines.append(f"Estimated {d['wall_seconds'] / 3600:.1f} h ({d['per_seed_seconds']:.0f} s a "
                 'seed: the trunk and every arm, with their evaluations).')
  lines.append(f"Run: {d['command']}")
  return '\n'.join(lines)


def compute_design(spread: dict, target: float = TARGET_MDE,
                   min_seeds: int = COMPUTE_MIN_SEEDS) -> dict:
  """The seeds of the compute study (COMPUTE_PRIMARY): the paired sd of exactly its primary
  comparison in the committed sized sweep (`spread`: committed_spread over d1, its
  equal-FLOP held-out comparison), and the fewest seeds whose minimum detectable paired
  effect at that sd is <= `target` at alpha ALPHA (at least min_seeds), at the sd's
  one-sided 95 % upper bound, and at alpha / m over the declared family."""
  v, ref, metric, budget = COMPUTE_PRIMARY
  corpus = 'heldout' if metric.startswith('heldout') else 'stdlib_val'
  name = f'{v} - {ref} {corpus}'
  part = spread['budgets'][budget]
  sd, dof = part['comparisons'][name], part['pairs'][name] - 1
  upper = sd * math.sqrt(dof / scipy_stats.chi2.ppf(0.05, dof))
  m = sum(len(f) for f in COMPUTE_FAMILIES.values())
  n = max(min_seeds, stats.seeds_for_effect(target, sd, ALPHA, POWER))
  return {'primary': list(COMPUTE_PRIMARY), 'families': COMPUTE_FAMILIES,
          'variants': list(COMPUTE_VARIANTS), 'target_mde': target, 'alpha': ALPHA,
          'power': POWER, 'planning_sd': sd, 'planning_dof': dof, 'planning_sd_upper95': upper,
          'spread_from': f"committed sized sweep, {v} - {ref} {corpus} at {budget}",
          'seeds': n, 'mde_at_seeds': stats.min_detectable_effect(sd, n, ALPHA, POWER),
          'seeds_at_upper_sd': stats.seeds_for_effect(target, upper, ALPHA, POWER),
          'seeds_familywise': stats.seeds_for_effect(target, sd, ALPHA / m, POWER),
          'family_size': m,
          'stopping_rule': 'run seeds 0..seeds-1; the minimum detectable effect is then '
                           'recomputed at the study\'s own paired sd of the primary '
                           'comparison, and seeds are added in blocks of 5 until it is <= '
                           'the target (the spread alone decides, never the effect)'}


def declarations(spread_from: str) -> dict:
  """What `mtp-ablation --declare` adds to OUT/design.json: the reading rules declared after
  the committed results (equivalence margins, outliers, exact tests, the global Holm), and
  the studies declared but not yet run (compute, production drafters, induction seeds)."""
  compute = compute_design(committed_spread(spread_from, 'd0', ('d1',)))
  return {
      'reading': {'equivalence_margins': EQUIVALENCE_MARGINS,
                  'equivalence_reason': EQUIVALENCE_REASON, 'outliers': OUTLIER_RULE,
                  'exact_tests': EXACT_RULE, 'global_holm': GLOBAL_HOLM,
                  'declared': 'after the committed results had been seen'},
      'compute': compute,
      'production_drafters': {'arms': PRODUCTION_ARMS, 'families': PRODUCTION_FAMILIES,
                              'seeds': list(range(20)), 'speed': PRODUCTION_SPEED},
      'induction_seeds': {'group': 'bpe_names', 'variants': ['d0@1m', 'n2@1m'],
                          'seeds': list(INDUCTION_SEEDS), 'endpoints': INDUCTION_ENDPOINTS,
                          'threshold': INDUCTION_THRESHOLD,
                          'declared': 'before seeds 5-14 run; seeds 0-4 were seen'},
  }
