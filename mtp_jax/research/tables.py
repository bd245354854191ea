"""The ablation sweep's tables: the per-run JSON of each group (OUT/lm.json, induction.json,
sized.json, names.json, bpe_names.json, drafter.json) aggregated over seeds, with the paired
tests of each declared family and Holm's correction within it (research/families.py), as
the dictionary OUT/summary.json holds; research/markdown.py writes it as OUT/summary.md.

Numpy and scipy (and sentencepiece for the bpe_names group's chance level): `mtp-ablation
--no_run` tabulates without starting JAX. The config modules of the groups come in as
arguments (`configs`, from research/studies.py), read by the caller.
"""
from __future__ import annotations

import json
import os

import numpy as np

import mtp_jax.research.design as design_lib
import mtp_jax.research.results as results_lib
import mtp_jax.research.stats as stats
import mtp_jax.research.studies as studies  # config modules load on first use, not here
from mtp_jax.data import induction
from mtp_jax.research.families import (
  aggregate,
  eval_se_of_difference,
  family_tests,
  holm_family,
  holm_global,
  holm_within,
  paired_test,
)

SIZED_BUDGETS = {'tokens': 'equal_tokens', 'flops': 'equal_flops'}  # variant suffix -> budget
BUDGETS = {'equal_flops': 'equal training FLOPs', 'equal_tokens': 'equal training tokens'}
TEMPS = ('T0', 'T1', 'T0.7')
TEMP_NAMES = {'T0': 'greedy', 'T1': 'T = 1', 'T0.7': 'T = 0.7'}
DRAFTER_EVAL = 'end'  # a drafter run's one evaluation, at its last step


def lm_metrics(r: dict, budget: str) -> dict:
  """The figures of one lm run at one budget, flat (lists per depth become _k keys)."""
  ev = r['evals'][budget]
  out = {'steps': ev['step'], 'train_tflop': ev['flops'] / 1e12,
         'stdlib_bpb': ev['stdlib_val']['bpb'][0], 'heldout_bpb': ev['heldout']['bpb'][0],
         'stdlib_bpb_se': ev['stdlib_val']['bpb_se_main'],
         'heldout_bpb_se': ev['heldout']['bpb_se_main']}
  for k, a in enumerate(ev['heldout']['agree'], 1):
    out[f'heldout_agree_{k}'] = a
  for k, a in enumerate(ev['stdlib_val']['agree'], 1):
    out[f'stdlib_agree_{k}'] = a
  for temp, d in ev.get('decode', {}).items():
    out[f'tau_{temp}'] = d['tau']
    out[f'distinct4_{temp}'] = d['distinct_4grams']
    for k, a in enumerate(d['acceptance_per_depth'], 1):
      out[f'accept_{temp}_{k}'] = a
  return out


def induction_metrics(r: dict) -> dict:
  curve = [p for p in r['curve'] if 'copy_acc' in p]
  out = {'steps': r['steps'], 'train_tflop': r['steps'] * r['flops_per_step'] / 1e12,
         'copy_acc_final': curve[-1]['copy_acc'], 'other_acc_final': curve[-1]['other_acc']}
  # Speed of learning at equal compute: the accuracy after a quarter and a half of the
  # budget (the last evaluation at or before that step).
  for name, frac in (('copy_acc_quarter', 0.25), ('copy_acc_half', 0.5)):
    out[name] = [p for p in curve if p['step'] <= frac * r['steps']][-1]['copy_acc']
  return out


def tabulate(out_dir: str, seeds=None, configs: dict | None = None,
             d768: dict | None = None) -> dict:
  """summary: per group, budget and variant the aggregated figures, plus the tests.
  `configs`: {group: its config module} (default studies.group_configs(), read now);
  `d768`: studies.d768_iteration_costs(), for the drafters' projected speed-ups (none
  without it)."""
  if configs is None:
    configs = studies.group_configs()
  lm_mod, ind_mod = configs['lm'], configs['induction']
  summary = {'lm': {}, 'induction': {}, 'tests': {}}
  lm = [r for r in results_lib.load_results(out_dir, 'lm') if seeds is None or r['seed'] in seeds]
  by_variant = {}
  for r in lm:
    by_variant.setdefault(r['variant'], []).append(r)
  order = [v for v in lm_mod.VARIANTS if v in by_variant]
  for budget in BUDGETS:
    table = {}
    for v in order:
      table[v] = {'depth': by_variant[v][0]['depth'], 'mtp_kind': by_variant[v][0]['mtp_kind'],
                  'seeds': sorted(r['seed'] for r in by_variant[v]),
                  'metrics': aggregate({r['seed']: lm_metrics(r, budget) for r in by_variant[v]})}
    summary['lm'][budget] = table
    tests = {}
    base = table.get(lm_mod.BASELINE)
    for v in order:
      if v == lm_mod.BASELINE or base is None:
        continue
      for metric, corpus in (('stdlib_bpb', 'stdlib_val'), ('heldout_bpb', 'heldout')):
        a, b = table[v]['metrics'][metric]['per_seed'], base['metrics'][metric]['per_seed']
        common = sorted(set(a) & set(b))
        if len(common) >= 2:
          runs_a = {r['seed']: r for r in by_variant[v]}
          runs_b = {r['seed']: r for r in by_variant[lm_mod.BASELINE]}
          tests[f'{v} - d0 {metric}'] = {
              'welch': stats.welch([a[s] for s in a], [b[s] for s in b]),
              'paired': stats.paired([a[s] for s in common], [b[s] for s in common]),
              'n': len(common),
              'eval_se_of_difference': float(np.mean([eval_se_of_difference(
                  runs_a[s], runs_b[s], budget, corpus) for s in common]))}
    if 'd3' in table and 'd3p' in table:
      for metric in ('heldout_bpb', 'heldout_agree_1', 'heldout_agree_3'):
        a = table['d3']['metrics'][metric]['per_seed']
        b = table['d3p']['metrics'][metric]['per_seed']
        if len(a) >= 2 and len(b) >= 2:
          tests[f'd3 - d3p {metric}'] = {'welch': stats.welch(list(a.values()),
                                                                 list(b.values()))}
    holm_family(tests, f'lm, {BUDGETS[budget]}')
    summary['tests'][budget] = tests
  ind = [r for r in results_lib.load_results(out_dir, 'induction')
         if seeds is None or r['seed'] in seeds]
  ind_by = {}
  for r in ind:
    ind_by.setdefault(r['variant'], []).append(r)
  base_runs = {r['seed']: r for r in ind_by.get(ind_mod.BASELINE, [])}
  for v in [v for v in ind_mod.VARIANTS if v in ind_by]:
    per = {}
    for r in ind_by[v]:
      per[r['seed']] = induction_metrics(r)
      if r['seed'] in base_runs:  # equal steps (= tokens): M = 0's accuracy at this run's end
        curve = [p for p in base_runs[r['seed']]['curve'] if 'copy_acc' in p]
        per[r['seed']]['d0_copy_acc_same_step'] = [
            p for p in curve if p['step'] <= r['steps']][-1]['copy_acc']
    summary['induction'][v] = {
        'depth': ind_by[v][0]['depth'], 'seeds': sorted(r['seed'] for r in ind_by[v]),
        'metrics': aggregate(per)}
  if ind:
    summary['induction_task'] = ind[0].get('task', {})
  base = summary['induction'].get(ind_mod.BASELINE)
  for v, row in summary['induction'].items():
    if v != ind_mod.BASELINE and base:
      for metric in ('copy_acc_half', 'copy_acc_final'):
        a = list(row['metrics'][metric]['per_seed'].values())
        b = list(base['metrics'][metric]['per_seed'].values())
        if len(a) >= 2 and len(b) >= 2:
          summary['tests'].setdefault('induction', {})[f'{v} - d0 {metric} (equal FLOPs)'] = {
              'welch': stats.welch(a, b)}
      a = row['metrics']['copy_acc_final']['per_seed']
      b = row['metrics']['d0_copy_acc_same_step']['per_seed']
      common = [s for s in a if b.get(s) is not None]
      if len(common) >= 2:
        summary['tests'].setdefault('induction', {})[
            f'{v} - d0 copy accuracy at {v}\'s last step (equal steps and tokens)'] = {
                'welch': stats.welch([a[s] for s in common], [b[s] for s in common]),
                'paired': stats.paired([a[s] for s in common], [b[s] for s in common])}
  if summary['tests'].get('induction'):
    holm_family(summary['tests']['induction'], 'induction')
  sized = [r for r in results_lib.load_results(out_dir, 'sized')
           if seeds is None or r['seed'] in seeds]
  if sized:
    summary['sized'] = tabulate_sized(sized, *declared_design(out_dir), mod=lm_mod)
  compute = [r for r in results_lib.load_results(out_dir, 'compute')
             if seeds is None or r['seed'] in seeds]
  if compute:  # the sized runs on the ',deep' trunk, under the compute study's family
    summary['compute'] = tabulate_sized(compute, design_lib.COMPUTE_FAMILIES,
                                        design_lib.COMPUTE_VARIANTS, lm_mod)
  names = [r for r in results_lib.load_results(out_dir, 'names')
           if seeds is None or r['seed'] in seeds]
  if names:
    summary['names'] = tabulate_names(names, configs['names'])
  bpe = [r for r in results_lib.load_results(out_dir, 'bpe_names')
         if seeds is None or r['seed'] in seeds]
  if bpe:
    task = dict(bpe[0]['task'])
    kind = task.pop('kind')
    chance = induction.make_task(128, kind, **task).chance()
    summary['bpe_names'] = tabulate_names(bpe, configs['bpe_names'], chance)
  drafter = [r for r in results_lib.load_results(out_dir, 'drafter')
             if seeds is None or r['seed'] in seeds]
  if drafter:
    families = {**declared_drafter_families(out_dir),
                **_design_file(out_dir).get('production_drafters', {}).get('families', {})}
    summary['drafter'] = tabulate_drafter(drafter, families, d768,
                                          configs['drafter'], declared_margins(out_dir))
  summary['global_holm'] = holm_global(summary)
  return summary


def _design_file(out_dir: str) -> dict:
  path = os.path.join(out_dir, 'design.json')
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def declared_margins(out_dir: str) -> dict:
  """The equivalence margins {'v - ref metric': margin}: OUT/design.json's (`reading`, as
  `mtp-ablation --declare` wrote them), else design_lib's."""
  reading = _design_file(out_dir).get('reading', {})
  return dict(reading.get('equivalence_margins', design_lib.EQUIVALENCE_MARGINS))


def declared_drafter_families(out_dir: str) -> dict:
  """The drafter study's test families: OUT/design.json's (`drafter`), as
  `mtp-ablation --design --groups drafter` wrote them before the runs, else design_lib's."""
  declared = _design_file(out_dir).get('drafter', {})
  return {name: [tuple(t) for t in tests]
          for name, tests in declared.get('families', design_lib.DRAFTER_FAMILIES).items()}


def tabulate_drafter(runs: list[dict], families: dict | None = None,
                     d768: dict | None = None, mod=None, margins: dict | None = None) -> dict:
  """The drafter study: per run variant (the trunk, then every arm) the mean ± std over
  seeds of its figures at its end; per declared family (design_lib.DRAFTER_FAMILIES) the
  paired tests against the reference (same seed = same frozen trunk) with Holm's
  correction within the family; per endpoint the minimum detectable paired effect at the
  pooled sd of the family's differences and its fewest seeds. With `d768`
  (studies.d768_iteration_costs), each run's speed-up projected onto the d 768 model,
  `projected_speedup_d768_T<t>`: its tau at T over that other model's measured iteration
  cost at T with as many drafts (a projection: this run's own model was not timed).
  `margins`: the declared equivalence margins (design_lib.EQUIVALENCE_MARGINS)."""
  families = design_lib.DRAFTER_FAMILIES if families is None else families
  by = {}
  for r in runs:
    by.setdefault(r['variant'], []).append(r)
  table, by_seed = {}, {}
  if mod is None:
    mod = studies.DRAFTER
  for v in [v for v in [*mod.VARIANTS, *getattr(mod, 'PRODUCTION_ARMS', {})] if v in by]:
    rs = by[v]
    by_seed[v] = {r['seed']: r for r in rs}
    mtp = rs[0]['config']['model']['mtp']
    table[v] = {'depth': rs[0]['depth'], 'mtp_kind': rs[0]['mtp_kind'],
                'share_modules': bool(mtp.get('share_modules', False)),
                'target_offsets': list(mtp.get('target_offsets', [])),
                'curriculum': mtp.get('curriculum', 'none'),
                'mtp_targets': rs[0]['config'].get('loss', {}).get('mtp_targets', 'data'),
                'lambda': [mtp.get('lambda_schedule', 'step'), list(mtp['lambda_values'])],
                'seeds': sorted(r['seed'] for r in rs),
                'metrics': aggregate({r['seed']: _with_d768_speedup(lm_metrics(r, DRAFTER_EVAL),
                                                                    d768) for r in rs})}
  tests, done = family_tests(table, families, by_seed, margins)
  mde = {}
  for family, rows in done.items():
    diffs = [[a[s] - b[s] for s in a if a[s] is not None and b.get(s) is not None]
             for *_, a, b in rows]
    sd, dof = stats.pooled_sd(diffs)
    if dof:
      n = min(len(d) for d in diffs)
      mde[family] = {'metric': families[family][0][2], 'pooled_sd': sd, 'dof': dof, 'n': n,
                     'mde': stats.min_detectable_effect(sd, n),
                     'mde_familywise': stats.min_detectable_effect(sd, n, 0.05 / len(rows))}
  out = {'table': table, 'tests': tests, 'mde': mde,
         'endpoints': dict(design_lib.DRAFTER_ENDPOINTS)}
  if d768:
    out['d768'] = d768
  return out


def _with_d768_speedup(m: dict, d768: dict | None) -> dict:
  """`m` plus projected_speedup_d768_T<t> = tau_T<t> / the d 768 model's iteration cost
  at T and this run's number of drafts, where the benchmark measured that pair."""
  for temp, ratios in (d768 or {}).get('cost_ratio', {}).items():
    drafts = sum(1 for k in m if k.startswith(f'accept_{temp}_'))
    if m.get(f'tau_{temp}') is not None and str(drafts) in ratios:
      m[f'projected_speedup_d768_{temp}'] = m[f'tau_{temp}'] / ratios[str(drafts)]
  return m


def declared_design(out_dir: str) -> tuple[dict, tuple]:
  """The sized sweep's test families and main-head arms: OUT/design.json's, as
  `mtp-ablation --design` wrote them before the runs, else design_lib's."""
  declared = _design_file(out_dir)
  families = {name: [tuple(t) for t in tests]
              for name, tests in declared.get('families', design_lib.FAMILIES).items()}
  return families, tuple(declared.get('main_head', {}).get('arms', design_lib.MAIN_HEAD_ARMS))


def tabulate_sized(runs: list[dict], families: dict | None = None, arms=None, mod=None) -> dict:
  """The sized sweep per budget: variant rows (mean ± std), the paired tests of each
  declared family (design_lib.FAMILIES, or the design file's) with Holm-adjusted p
  within the family, and the minimum detectable main-head effect: pooled over the
  main-head arms' paired differences against d0 (design_lib.MAIN_HEAD_ARMS, or the
  design file's), at the fewest seeds any of them has. `mod`: configs/ablation.py's module
  (its SIZED_VARIANTS and BASELINE)."""
  if mod is None:
    mod = studies.ABLATION
  families = design_lib.FAMILIES if families is None else families
  arms = design_lib.MAIN_HEAD_ARMS if arms is None else arms
  by = {}
  for r in runs:
    v, suffix = r['variant'].split('@')
    by.setdefault((v, SIZED_BUDGETS[suffix]), []).append(r)
  out = {}
  for budget in BUDGETS:
    table, by_seed = {}, {}
    for v in mod.SIZED_VARIANTS:
      rs = by.get((v, budget)) or (by.get((v, 'equal_tokens')) if v == mod.BASELINE
                                   else None)  # M = 0's one run serves both budgets
      if not rs:
        continue
      cfg = rs[0]['config']['model']['mtp']
      by_seed[v] = {r['seed']: r for r in rs}
      table[v] = {'depth': rs[0]['depth'], 'mtp_kind': rs[0]['mtp_kind'],
                  'curriculum': cfg.get('curriculum', 'none'),
                  'seeds': sorted(r['seed'] for r in rs),
                  'metrics': aggregate({r['seed']: lm_metrics(r, next(iter(r['evals'])))
                                        for r in rs})}
    tests, done = family_tests(table, families, by_seed)
    pooled = {'stdlib_bpb': [], 'heldout_bpb': []}
    for rows in done.values():
      for v, ref, metric, a, b in rows:
        if ref == mod.BASELINE and metric in pooled and v in arms:
          pooled[metric].append([a[s] - b[s] for s in a if s in b])
    design = {}
    for metric, groups in pooled.items():
      sd, dof = stats.pooled_sd(groups)
      n = min((len(g) for g in groups), default=0)
      if dof:
        design[metric] = {'arms': [v for v in table if v in arms and v != mod.BASELINE],
                          'pooled_sd': sd, 'dof': dof,
                          'n': n,
                          'mde': stats.min_detectable_effect(sd, n)}
    out[budget] = {'table': table, 'tests': tests, 'mde': design}
  return out


def _names_equal_flop_step(r: dict, base: dict) -> int:
  return max(1, int(base['steps'] * base['flops_per_step'] // r['flops_per_step']))


def _at_step(curve: list[dict], step: int) -> float:
  """Copy accuracy at the last evaluation at or before `step`."""
  return [p for p in curve if p['step'] <= step][-1]['copy_acc']


def _size_of(variant: str) -> str:
  """The size suffix of a sized-model variant ('n2@1m' -> '@1m'; '' without one)."""
  return variant[variant.index('@'):] if '@' in variant else ''


def _induction_endpoints(curve: list[dict]) -> dict:
  """The declared endpoints of the powered induction study (design_lib.INDUCTION_ENDPOINTS)
  of one run's scored curve: the area under copy accuracy against steps over the scored
  span, per step (the mean accuracy over training), and the first scored step with copy
  accuracy >= design_lib.INDUCTION_THRESHOLD, censored at the last step plus one interval."""
  steps = [p['step'] for p in curve]
  acc = [p['copy_acc'] for p in curve]
  span = steps[-1] - steps[0]
  auc = (float(np.sum((np.diff(steps)) * (np.asarray(acc[1:]) + acc[:-1]) / 2)) / span
         if span > 0 else acc[-1])
  reach = next((s for s, a in zip(steps, acc) if a >= design_lib.INDUCTION_THRESHOLD), None)
  if reach is None:
    reach = steps[-1] + (steps[-1] - steps[-2] if len(steps) > 1 else 0)
  return {design_lib.INDUCTION_ENDPOINTS['primary']: auc,
          design_lib.INDUCTION_ENDPOINTS['secondary']: reach}


def _powered_induction_tests(table: dict, mod) -> dict:
  """The powered induction study's family (design_lib.INDUCTION_*), once every declared
  seed has run: n2 minus d0 at 1.06 M on its two endpoints, paired by seed."""
  if 'n2@1m' not in table or 'd0@1m' not in table or not hasattr(mod, 'SIZES'):
    return {}
  want = set(range(max(design_lib.INDUCTION_SEEDS) + 1))
  if not want <= set(table['n2@1m']['seeds']) & set(table['d0@1m']['seeds']):
    return {}
  tests = {}
  for role, metric in design_lib.INDUCTION_ENDPOINTS.items():
    t = paired_test(table['n2@1m']['metrics'][metric]['per_seed'],
                    table['d0@1m']['metrics'][metric]['per_seed'])
    tests[f'n2@1m - d0@1m {metric} ({role})'] = t
  holm_within(tests, list(tests), 'powered induction at 1m, declared endpoints')
  return tests


def tabulate_names(runs: list[dict], mod=None, chance: float | None = None) -> dict:
  """Name-story induction (configs/induction_names.py, or `mod`): per variant the curve's
  landmarks, equal steps and equal FLOPs against M = 0 of the same size, paired by seed
  (same task batches and trunk initialisation). Holm's correction runs over each size's
  tests."""
  if mod is None:
    mod = studies.NAMES
  by = {}
  for r in runs:
    by.setdefault(r['variant'], {})[r['seed']] = r
  sizes = list(getattr(mod, 'SIZES', {'': None}))
  order = [v + (f'@{s}' if s else '') for s in sizes for v in mod.VARIANTS]
  table = {}
  for v in [v for v in order if v in by]:
    base = by.get(mod.BASELINE + _size_of(v), {})
    per = {}
    for seed, r in by[v].items():
      curve = [p for p in r['curve'] if 'copy_acc' in p]
      m = {'steps': r['steps'], 'copy_acc_final': curve[-1]['copy_acc'],
           'other_acc_final': curve[-1]['other_acc'],
           'copy_acc_quarter': _at_step(curve, r['steps'] // 4),
           'copy_acc_half': _at_step(curve, r['steps'] // 2),
           'steps_to_half': next((p['step'] for p in curve if p['copy_acc'] >= 0.5), None),
           **_induction_endpoints(curve)}
      b = base.get(seed)
      if b is not None:  # equal FLOPs: this run at the most steps within M = 0's FLOPs
        eq = _names_equal_flop_step(r, b)
        m['equal_flop_step'] = eq
        m['copy_acc_equal_flops'] = _at_step(curve, eq)
      per[seed] = m
    table[v] = {'depth': next(iter(by[v].values()))['depth'],
                'mtp_kind': next(iter(by[v].values()))['mtp_kind'],
                'seeds': sorted(by[v]), 'metrics': aggregate(per)}
  tests = {}
  for v in table:
    ref = mod.BASELINE + _size_of(v)
    if v == ref or ref not in table:
      continue
    m, b = table[v]['metrics'], table[ref]['metrics']
    for name, metric in (('equal steps', 'copy_acc_final'),
                         ('equal FLOPs', 'copy_acc_equal_flops'),
                         ('half the steps', 'copy_acc_half')):
      other = b['copy_acc_half' if metric == 'copy_acc_half' else 'copy_acc_final']['per_seed']
      t = paired_test(m[metric]['per_seed'], other) if metric in m else None
      if t is not None:
        tests[f'{v} - {ref} copy accuracy, {name}'] = {**t, 'size': _size_of(v)}
  by_size = {}  # one Holm family per trunk size
  for name, t in tests.items():
    by_size.setdefault(t.pop('size'), []).append(name)
  for size, names in sorted(by_size.items()):
    family = 'name-story induction against d0' + (f', {size[1:]}' if size else '')
    holm_within(tests, names, family)
  tests.update(_powered_induction_tests(table, mod))
  task = next(iter(runs))['task']
  return {'table': table, 'tests': tests, 'task': task,
          'chance': mod.CHANCE if chance is None else chance}


def json_default(x):
  if isinstance(x, np.generic):
    return x.item()
  raise TypeError(type(x))
