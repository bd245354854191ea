"""The ablation sweep's tables: the per-run JSON of each group (OUT/lm.json, induction.json,
sized.json, names.json, bpe_names.json) aggregated over seeds, with Welch and paired tests
and Holm's correction within each family of tests, as OUT/summary.json and the markdown of
OUT/summary.md.

Numpy and scipy (and sentencepiece for the bpe_names group's chance level): `mtp-ablation
--no_run` tabulates without starting JAX.
"""
from __future__ import annotations

import json
import os

import numpy as np

import mtp_jax.research.design as design_lib
import mtp_jax.research.results as results_lib
import mtp_jax.research.stats as stats
from mtp_jax import config_files
from mtp_jax.data import induction

# The checkout this package is installed from (pip install -e .): configs/ lives there.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GROUPS = ('lm', 'induction', 'sized', 'names', 'bpe_names', 'drafter')
DEFAULT_GROUPS = ('lm', 'induction')
SIZED_BUDGETS = {'tokens': 'equal_tokens', 'flops': 'equal_flops'}  # variant suffix -> budget
BUDGETS = {'equal_flops': 'equal training FLOPs', 'equal_tokens': 'equal training tokens'}
TEMPS = ('T0', 'T1', 'T0.7')
TEMP_NAMES = {'T0': 'greedy', 'T1': 'T = 1', 'T0.7': 'T = 0.7'}


def load_config_module(name: str):
  return config_files.load_module(os.path.join(REPO, 'configs', f'{name}.py'))


ABLATION = load_config_module('ablation')
INDUCTION = load_config_module('induction')
NAMES = load_config_module('induction_names')
BPE_NAMES = load_config_module('induction_bpe')
DRAFTER = load_config_module('drafter')
DRAFTER_EVAL = 'end'  # a drafter run's one evaluation, at its last step
CONFIGS = {'lm': ABLATION, 'induction': INDUCTION, 'names': NAMES, 'bpe_names': BPE_NAMES,
           'drafter': DRAFTER}
# benchmarks/decode_speed.py's current result: what one verify iteration of the d 768 model
# (configs/decode_768.py) costs against one autoregressive step, measured while decoding
DECODE_SPEED = os.path.join(REPO, 'benchmarks', 'results', 'decode_speed.json')
D768 = {'d_model': 768, 'n_layers': 12}


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


def eval_se_of_difference(a: dict, b: dict, budget: str, corpus: str) -> float:
  """Standard error, from eval sampling alone, of bpb(a) - bpb(b): both runs are scored
  on the same batches, so the per-batch differences give it (stats.batch_bpb_se)."""
  ea, eb = a['evals'][budget][corpus], b['evals'][budget][corpus]
  diff = np.subtract(ea['batch_loss_sum_main'], eb['batch_loss_sum_main'])
  return stats.batch_bpb_se(diff, ea['batch_bytes_main'])


def aggregate(per_run: dict[int, dict]) -> dict:
  """{metric: {'per_seed': {seed: v}, 'mean', 'std'}} over the seeds (None-free metrics)."""
  seeds = sorted(per_run)
  keys = sorted({k for m in per_run.values() for k in m})
  out = {}
  for k in keys:
    vals = {s: per_run[s].get(k) for s in seeds}
    got = [v for v in vals.values() if v is not None]
    mean, std = stats.mean_std(got) if got else (None, None)
    out[k] = {'per_seed': vals, 'mean': mean, 'std': std, 'n': len(got)}
  return out


def tabulate(out_dir: str, seeds=None) -> dict:
  """summary: per group, budget and variant the aggregated figures, plus the tests."""
  summary = {'lm': {}, 'induction': {}, 'tests': {}}
  lm = [r for r in results_lib.load_results(out_dir, 'lm') if seeds is None or r['seed'] in seeds]
  by_variant = {}
  for r in lm:
    by_variant.setdefault(r['variant'], []).append(r)
  order = [v for v in ABLATION.VARIANTS if v in by_variant]
  for budget in BUDGETS:
    table = {}
    for v in order:
      table[v] = {'depth': by_variant[v][0]['depth'], 'mtp_kind': by_variant[v][0]['mtp_kind'],
                  'seeds': sorted(r['seed'] for r in by_variant[v]),
                  'metrics': aggregate({r['seed']: lm_metrics(r, budget) for r in by_variant[v]})}
    summary['lm'][budget] = table
    tests = {}
    base = table.get(ABLATION.BASELINE)
    for v in order:
      if v == ABLATION.BASELINE or base is None:
        continue
      for metric, corpus in (('stdlib_bpb', 'stdlib_val'), ('heldout_bpb', 'heldout')):
        a, b = table[v]['metrics'][metric]['per_seed'], base['metrics'][metric]['per_seed']
        common = sorted(set(a) & set(b))
        if len(common) >= 2:
          runs_a = {r['seed']: r for r in by_variant[v]}
          runs_b = {r['seed']: r for r in by_variant[ABLATION.BASELINE]}
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
  base_runs = {r['seed']: r for r in ind_by.get(INDUCTION.BASELINE, [])}
  for v in [v for v in INDUCTION.VARIANTS if v in ind_by]:
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
  base = summary['induction'].get(INDUCTION.BASELINE)
  for v, row in summary['induction'].items():
    if v != INDUCTION.BASELINE and base:
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
    summary['sized'] = tabulate_sized(sized, *declared_design(out_dir))
  names = [r for r in results_lib.load_results(out_dir, 'names')
           if seeds is None or r['seed'] in seeds]
  if names:
    summary['names'] = tabulate_names(names)
  bpe = [r for r in results_lib.load_results(out_dir, 'bpe_names')
         if seeds is None or r['seed'] in seeds]
  if bpe:
    task = dict(bpe[0]['task'])
    kind = task.pop('kind')
    chance = induction.make_task(128, kind, **task).chance()
    summary['bpe_names'] = tabulate_names(bpe, BPE_NAMES, chance)
  drafter = [r for r in results_lib.load_results(out_dir, 'drafter')
             if seeds is None or r['seed'] in seeds]
  if drafter:
    summary['drafter'] = tabulate_drafter(drafter, declared_drafter_families(out_dir),
                                          d768_iteration_costs())
  return summary


def d768_iteration_costs(path: str = DECODE_SPEED) -> dict | None:
  """The cost of one verify iteration relative to one AR step of the d 768, 12-layer model,
  as decode_speed measured it at batch 1 in float32 with every draft taken:
  {'cost_ratio': {'T<t>': {'<drafts>': ratio}}, 'command', 'commit', 'date', 'machine'}
  from the first such run; None when the file or such a run is missing. tau over this ratio
  is the speed-up that run measured (up to prefill)."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    bench = json.load(f)
  for run in bench.get('runs', []):
    res = run.get('result', {})
    if any(res.get('model', {}).get(k) != v for k, v in D768.items()):
      continue
    ratios = {}
    for row in res.get('results', []):
      if (row['batch_size'], row['weight_dtype'], row.get('draft_threshold', 0)) == \
         (1, 'float32', 0):
        ratios.setdefault(f"T{row['temperature']:g}", {})[str(row['num_drafts'])] = \
            row['iteration_cost_ratio']
    if ratios:
      machine = run.get('machine', bench.get('machine', {}))
      return {'cost_ratio': ratios, 'command': run['command'], 'commit': run.get('commit'),
              'date': run.get('date'), 'machine': machine.get('description', machine.get('cpu')),
              'model': res['model']}
  return None


def declared_drafter_families(out_dir: str) -> dict:
  """The drafter study's test families: OUT/design.json's (`drafter`), as
  `mtp-ablation --design --groups drafter` wrote them before the runs, else design_lib's."""
  path = os.path.join(out_dir, 'design.json')
  declared = {}
  if os.path.isfile(path):
    with open(path) as f:
      declared = json.load(f).get('drafter', {})
  return {name: [tuple(t) for t in tests]
          for name, tests in declared.get('families', design_lib.DRAFTER_FAMILIES).items()}


# Figures that depend on the held-out corpus: its bits per byte and agreement, and every
# decoding figure (the decoding prompts are held-out documents). The corpus is built from
# the installed packages, so it can differ between the machines a sweep ran on; so can the
# stdlib validation split (the interpreter's standard library).
HELDOUT_METRICS = ('heldout_', 'tau_', 'accept_', 'distinct4_', 'speedup_')
STDLIB_METRICS = ('stdlib_',)


def metric_corpus(metric: str) -> str | None:
  """The corpus ('heldout', 'stdlib_val') a figure was measured on; None: neither."""
  if metric.startswith(HELDOUT_METRICS):
    return 'heldout'
  return 'stdlib_val' if metric.startswith(STDLIB_METRICS) else None


def family_tests(table: dict, families: dict, runs: dict | None = None
                 ) -> tuple[dict, dict]:
  """The paired test (paired_test) of every declared comparison (v, ref, metric) whose two
  variants have the metric, named 'v - ref metric' and Holm-adjusted within its family
  (p_holm, family_size); and per family the comparisons tested, as (v, ref, metric, v's
  per-seed values, ref's). With `runs` ({variant: {seed: run}}), a figure measured on a
  corpus (metric_corpus) pairs only seeds whose two runs were scored on the same one
  (results.same_corpus); the seeds left out are the test's `other_corpus_seeds`."""
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
      t = paired_test(a, b)
      if t is None:
        continue
      tests[f'{v} - {ref} {metric}'] = {**t, 'family': family,
                                        **({'other_corpus_seeds': other} if other else {})}
      rows.append((v, ref, metric, a, b))
    names = [f'{v} - {ref} {metric}' for v, ref, metric, _, _ in rows]
    for name, adj in zip(names, stats.holm([tests[n]['p'] for n in names])):
      tests[name].update(p_holm=adj, family_size=len(names))
  return tests, done


def tabulate_drafter(runs: list[dict], families: dict | None = None,
                     d768: dict | None = None) -> dict:
  """The drafter study: per run variant (the trunk, then every arm) the mean ± std over
  seeds of its figures at its end; per declared family (design_lib.DRAFTER_FAMILIES) the
  paired tests against the reference (same seed = same frozen trunk) with Holm's
  correction within the family; per endpoint the minimum detectable paired effect at the
  pooled sd of the family's differences and its fewest seeds. With `d768`
  (d768_iteration_costs), each run's speed-up at the d 768 shape, `speedup_d768_T<t>`: its
  tau at T over the d 768 model's measured iteration cost at T with as many drafts."""
  families = design_lib.DRAFTER_FAMILIES if families is None else families
  by = {}
  for r in runs:
    by.setdefault(r['variant'], []).append(r)
  table, by_seed = {}, {}
  for v in [v for v in DRAFTER.VARIANTS if v in by]:
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
  tests, done = family_tests(table, families, by_seed)
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
  """`m` plus speedup_d768_T<t> = tau_T<t> / the d 768 iteration cost at T and this run's
  number of drafts, where the benchmark measured that pair."""
  for temp, ratios in (d768 or {}).get('cost_ratio', {}).items():
    drafts = sum(1 for k in m if k.startswith(f'accept_{temp}_'))
    if m.get(f'tau_{temp}') is not None and str(drafts) in ratios:
      m[f'speedup_d768_{temp}'] = m[f'tau_{temp}'] / ratios[str(drafts)]
  return m


def declared_design(out_dir: str) -> tuple[dict, tuple]:
  """The sized sweep's test families and main-head arms: OUT/design.json's, as
  `mtp-ablation --design` wrote them before the runs, else design_lib's."""
  declared = {}
  path = os.path.join(out_dir, 'design.json')
  if os.path.isfile(path):
    with open(path) as f:
      declared = json.load(f)
  families = {name: [tuple(t) for t in tests]
              for name, tests in declared.get('families', design_lib.FAMILIES).items()}
  return families, tuple(declared.get('main_head', {}).get('arms', design_lib.MAIN_HEAD_ARMS))


def holm_family(tests: dict, family: str) -> None:
  """Holm-adjust one family of tests in place: each gets `holm` {'p', 'family', 'size'},
  over its paired p where it has one, else its Welch p."""
  names = list(tests)
  ps = [tests[n]['paired']['p'] if 'paired' in tests[n] else tests[n]['welch']['p']
        for n in names]
  for name, adj in zip(names, stats.holm(ps)):
    tests[name]['holm'] = {'p': adj, 'family': family, 'size': len(names)}


def paired_test(a: dict, b: dict) -> dict | None:
  """Paired t test of per-seed values a - b over their common seeds, with the minimum
  detectable effect (alpha 0.05, power 0.8) at the observed sd of the differences."""
  common = sorted(s for s in a if s in b and a[s] is not None and b[s] is not None)
  if len(common) < 2:
    return None
  diffs = [a[s] - b[s] for s in common]
  out = stats.paired([a[s] for s in common], [b[s] for s in common])
  sd = stats.mean_std(diffs)[1]
  return {**out, 'n': len(common), 'sd': sd, 'mde': stats.min_detectable_effect(sd, len(common))}


def tabulate_sized(runs: list[dict], families: dict | None = None, arms=None) -> dict:
  """The sized sweep per budget: variant rows (mean ± std), the paired tests of each
  declared family (design_lib.FAMILIES, or the design file's) with Holm-adjusted p
  within the family, and the minimum detectable main-head effect: pooled over the
  main-head arms' paired differences against d0 (design_lib.MAIN_HEAD_ARMS, or the
  design file's), at the fewest seeds any of them has."""
  families = design_lib.FAMILIES if families is None else families
  arms = design_lib.MAIN_HEAD_ARMS if arms is None else arms
  by = {}
  for r in runs:
    v, suffix = r['variant'].split('@')
    by.setdefault((v, SIZED_BUDGETS[suffix]), []).append(r)
  out = {}
  for budget in BUDGETS:
    table, by_seed = {}, {}
    for v in ABLATION.SIZED_VARIANTS:
      rs = by.get((v, budget)) or (by.get((v, 'equal_tokens')) if v == ABLATION.BASELINE
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
        if ref == ABLATION.BASELINE and metric in pooled and v in arms:
          pooled[metric].append([a[s] - b[s] for s in a if s in b])
    design = {}
    for metric, groups in pooled.items():
      sd, dof = stats.pooled_sd(groups)
      n = min((len(g) for g in groups), default=0)
      if dof:
        design[metric] = {'arms': [v for v in table if v in arms and v != ABLATION.BASELINE],
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


def tabulate_names(runs: list[dict], mod=None, chance: float | None = None) -> dict:
  """Name-story induction (configs/induction_names.py, or `mod`): per variant the curve's
  landmarks, equal steps and equal FLOPs against M = 0 of the same size, paired by seed
  (same task batches and trunk initialisation). Holm's correction runs over each size's
  tests."""
  mod = NAMES if mod is None else mod
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
           'steps_to_half': next((p['step'] for p in curve if p['copy_acc'] >= 0.5), None)}
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
    for name, adj in zip(names, stats.holm([tests[n]['p'] for n in names])):
      tests[name].update(p_holm=adj, family=family, family_size=len(names))
  task = next(iter(runs))['task']
  return {'table': table, 'tests': tests, 'task': task,
          'chance': mod.CHANCE if chance is None else chance}


def _pm(m: dict, fmt: str = '{:.3f}') -> str:
  if m is None or m['mean'] is None:
    return 'n.a.'
  if m['n'] < 2:
    return fmt.format(m['mean'])
  return f'{fmt.format(m["mean"])} ± {fmt.format(m["std"])}'


def _seeds(m: dict, fmt: str = '{:.3f}') -> str:
  return ' / '.join('n.a.' if v is None else fmt.format(v) for v in m['per_seed'].values())


def markdown(summary: dict) -> str:
  out = []
  for budget, title in BUDGETS.items():
    table = summary['lm'].get(budget, {})
    if not table:
      continue
    ns = sorted({len(row['seeds']) for row in table.values()})
    out += [f'**{title[0].upper() + title[1:]}** (mean ± std over seeds, '
            f'n = {"/".join(map(str, ns))}; '
            'bpb = bits per byte of the main head; agreement = teacher-forced agreement of '
            'MTP depth k with the main head, held-out; tau = tokens per verify step)', '',
            '| variant | steps | train TFLOP | stdlib val bpb | held-out bpb | '
            'agreement per depth | tau greedy | tau T = 1 | tau T = 0.7 | '
            'distinct 4-grams, greedy / T = 1 |',
            '|---|---|---|---|---|---|---|---|---|---|']
    for v, row in table.items():
      m = row['metrics']
      agree = ' / '.join(_pm(m[f'heldout_agree_{k}'], '{:.2f}')
                         for k in range(1, row['depth'] + 1)) or 'n.a.'
      taus = [_pm(m.get(f'tau_{t}'), '{:.2f}') if row['depth'] else '1 (n.a.)' for t in TEMPS]
      distinct = ' / '.join(f'{m[f"distinct4_{t}"]["mean"]:.2f}' for t in ('T0', 'T1')
                            if f'distinct4_{t}' in m) or 'n.a.'
      out.append(f'| {_label(v, row)} | {_pm(m["steps"], "{:.0f}")} | '
                 f'{_pm(m["train_tflop"], "{:.2f}")} | {_pm(m["stdlib_bpb"])} | '
                 f'{_pm(m["heldout_bpb"])} | {agree} | {" | ".join(taus)} | {distinct} |')
    se = [row['metrics'][k]['mean'] for row in table.values()
          for k in ('stdlib_bpb_se', 'heldout_bpb_se')]
    out += ['', f'Standard error of one run\'s bpb estimate (eval sampling, batch-level): '
            f'{min(se):.3f}-{max(se):.3f} bits; every run is scored on the same batches.', '',
            'Each seed (seeds ' + ', '.join(str(s) for s in next(iter(table.values()))['seeds'])
            + '):', '', '| variant | stdlib val bpb | held-out bpb | tau greedy | tau T = 1 | '
            'tau T = 0.7 | acceptance per depth, T = 1 (mean) |', '|---|---|---|---|---|---|---|']
    for v, row in table.items():
      m = row['metrics']
      taus = [_seeds(m[f'tau_{t}'], '{:.2f}') if f'tau_{t}' in m else 'n.a.' for t in TEMPS]
      acc = ' / '.join(f'{m[f"accept_T1_{k}"]["mean"]:.2f}' for k in range(1, row['depth'] + 1)
                       if f'accept_T1_{k}' in m) or 'n.a.'
      out.append(f'| {_label(v, row)} | {_seeds(m["stdlib_bpb"])} | {_seeds(m["heldout_bpb"])} | '
                 f'{" | ".join(taus)} | {acc} |')
    tests = summary['tests'].get(budget, {})
    if tests:
      out += ['', 'Differences (negative bpb = better than M = 0): Welch t over seeds, and '
              'paired t over seeds (same seed = same data order and trunk init):', '']
      for name, t in tests.items():
        w = t['welch']
        line = f'- {name}: {w["diff"]:+.4f}, Welch t = {w["t"]:.2f}, p = {w["p"]:.3f}'
        if 'paired' in t:
          line += (f'; paired t = {t["paired"]["t"]:.2f}, p = {t["paired"]["p"]:.3f}; eval '
                   f'SE of one seed\'s difference {t["eval_se_of_difference"]:.4f}')
        out.append(line + _holm_note(t))
    out.append('')
  ind = summary['induction']
  if ind:
    alphabet = ind_alphabet(summary)
    out += ['**Induction** (equal training FLOPs; copy accuracy = top-1 accuracy of the main '
            'head on the second occurrence of the repeated span, after its first token; '
            f'chance 1/{alphabet})', '',
            '| variant | steps | train TFLOP | copy accuracy after 1/4 of the FLOPs | '
            'after 1/2 | at the end | at the end, each seed | M = 0 at the same step |',
            '|---|---|---|---|---|---|---|---|']
    for v, row in ind.items():
      m = row['metrics']
      out.append(f'| {v} (M = {row["depth"]}) | {_pm(m["steps"], "{:.0f}")} | '
                 f'{_pm(m["train_tflop"], "{:.3f}")} | {_pm(m["copy_acc_quarter"])} | '
                 f'{_pm(m["copy_acc_half"])} | {_pm(m["copy_acc_final"])} | '
                 f'{_seeds(m["copy_acc_final"])} | '
                 f'{_pm(m.get("d0_copy_acc_same_step")) if row["depth"] else "-"} |')
    out.append('')
    for name, t in summary['tests'].get('induction', {}).items():
      w = t['welch']
      line = f'- {name}: {w["diff"]:+.3f}, Welch t = {w["t"]:.2f}, p = {w["p"]:.3f}'
      if 'paired' in t:
        line += f'; paired t = {t["paired"]["t"]:.2f}, p = {t["paired"]["p"]:.3f}'
      out.append(line + _holm_note(t))
  if summary.get('sized'):
    out += [''] + markdown_sized(summary['sized'])
  if summary.get('names'):
    out += [''] + markdown_names(summary['names'])
  if summary.get('bpe_names'):
    out += [''] + markdown_names(summary['bpe_names'], BPE_TITLE)
  if summary.get('drafter'):
    out += [''] + markdown_drafter(summary['drafter'])
  return '\n'.join(out)


def _drafter_label(v: str, row: dict) -> str:
  """What a drafter row is: its heads and what it changes against the reference."""
  if not row['depth']:
    return f'{v} (the frozen next-token trunk)'
  parts = [f"M = {row['depth']} {row['mtp_kind']}"]
  if row.get('share_modules'):
    parts.append('one shared module')
  if row.get('target_offsets'):
    parts.append('leap offsets ' + '/'.join(map(str, row['target_offsets'])))
  if row.get('mtp_targets', 'data') != 'data':
    parts.append(f"{row['mtp_targets']} targets")
  if row.get('lambda', ['step'])[0] != 'step':
    parts.append('lambda ' + ' -> '.join(f'{x:g}' for x in row['lambda'][1]))
  if row.get('curriculum', 'none') != 'none':
    parts.append(f"{row['curriculum']} curriculum")
  return f"{v} ({', '.join(parts)})"


def markdown_drafter(drafter: dict) -> list[str]:
  table = drafter['table']
  ns = sorted({len(row['seeds']) for row in table.values()})
  ep = drafter['endpoints']
  out = [f'**Drafters on a frozen verifier** (one next-token trunk per seed, every arm\'s '
         f'MTP modules trained on it; mean ± std over seeds, n = {"/".join(map(str, ns))}; '
         f"primary endpoint {ep['primary']}, secondary {ep['secondary']}; tau = tokens per "
         'verify step from the held-out prompts)', '',
         '| arm | steps | held-out bpb (main head) | agreement per depth | tau greedy | '
         'tau T = 1 | tau T = 0.7 | acceptance per depth, T = 1 | speed-up at d 768, '
         'T = 1 / T = 0.7 |',
         '|---|---|---|---|---|---|---|---|---|']
  for v, row in table.items():
    m = row['metrics']
    agree = ' / '.join(_pm(m[f'heldout_agree_{k}'], '{:.2f}')
                       for k in range(1, row['depth'] + 1) if f'heldout_agree_{k}' in m)
    taus = [_pm(m.get(f'tau_{t}'), '{:.2f}') if f'tau_{t}' in m else 'n.a.' for t in TEMPS]
    acc = ' / '.join(f'{m[f"accept_T1_{k}"]["mean"]:.2f}' for k in range(1, 9)
                     if f'accept_T1_{k}' in m)
    speed = ' / '.join(_pm(m[f'speedup_d768_{t}'], '{:.2f}') for t in ('T1', 'T0.7')
                       if f'speedup_d768_{t}' in m)
    out.append(f'| {_drafter_label(v, row)} | {_pm(m["steps"], "{:.0f}")} | '
               f'{_pm(m["heldout_bpb"])} | {agree or "n.a."} | {" | ".join(taus)} | '
               f'{acc or "n.a."} | {speed or "n.a."} |')
  out.append('')
  if drafter.get('d768'):
    d = drafter['d768']
    costs = '; '.join(f'{TEMP_NAMES[t]}: ' + ', '.join(
        f'{r:.2f} ({k} draft{"s" if k != "1" else ""})'
        for k, r in sorted(d['cost_ratio'][t].items()))
        for t in ('T1', 'T0.7') if t in d['cost_ratio'])
    out += ['Speed-up at d 768: each run\'s tau over the cost of one verify iteration relative '
            'to one autoregressive step of configs/decode_768.py (d 768, 12 layers, batch 1, '
            'float32) at the same temperature and number of drafts, as benchmarks/'
            f"decode_speed.py measured it while decoding ({costs}; {d['machine']}, commit "
            f"{d['commit']}). It assumes drafters at d 768 accept as these do; prefill is left "
            'out.', '']
  for family, d in drafter['mde'].items():
    out.append(f"Minimum detectable paired effect on {d['metric']}, family \"{family}\" "
               f"(alpha 0.05, power 0.8, n = {d['n']}): {d['mde']:.3f} tokens per verify step "
               f"({d['mde_familywise']:.3f} at Holm's first step; pooled sd "
               f"{d['pooled_sd']:.4f}, {d['dof']} dof).")
  families = {}
  for name, t in drafter['tests'].items():
    families.setdefault(t['family'], []).append(name)
  for family, names in families.items():
    out += ['', f'Paired differences, family "{family}" (Holm\'s correction over its '
            f'{len(names)} tests; positive tau = more tokens per verify step than ref):', '']
    out += [_test_line(name, drafter['tests'][name], '{:+.3f}') for name in names]
  out.append('')
  return out


ALPHA = 0.05  # the family-wise level the tables judge Holm-adjusted p against


def _verdict(t: dict, fmt: str) -> str:
  """Significant after Holm's correction within its family, or the interval the effect
  lies in: a null is a range, not a zero."""
  lo, hi = (fmt.format(x) for x in t['ci95'])
  if t['p_holm'] < ALPHA:
    return 'significant after Holm'
  return f'not established after Holm: the effect lies between {lo} and {hi} (95 % CI)'


def _test_line(name: str, t: dict, fmt: str = '{:+.4f}') -> str:
  ci = (f' (95 % CI {fmt.format(t["ci95"][0])} to {fmt.format(t["ci95"][1])})'
        if 'ci95' in t else '')
  holm = (f', Holm p = {t["p_holm"]:.3f} (family of {t["family_size"]}); {_verdict(t, fmt)}'
          if 'p_holm' in t else '')
  other = t.get('other_corpus_seeds')
  corpus = {'heldout': 'held-out corpora', 'stdlib_val': 'stdlib validation splits'}.get(
      metric_corpus(name.rsplit(' ', 1)[-1]), 'corpora')
  left_out = (f'; seeds {", ".join(map(str, other))} left out (their two runs were scored on '
              f'different {corpus})' if other else '')
  return (f'- {name}: {fmt.format(t["diff"])}{ci}, paired t = {t["t"]:.2f}, p = {t["p"]:.3f}'
          f'{holm}; n = {t["n"]}, minimum detectable effect {t["mde"]:.3f} (sd of the '
          f'differences {t["sd"]:.4f}){left_out}')


def _holm_note(t: dict) -> str:
  """The legacy groups' Holm-adjusted p (holm_family)."""
  h = t.get('holm')
  return f'; Holm p = {h["p"]:.3f} (family of {h["size"]})' if h else ''


def markdown_sized(sized: dict) -> list[str]:
  out = []
  for budget, title in BUDGETS.items():
    part = sized.get(budget)
    if not part or not part['table']:
      continue
    table = part['table']
    ns = sorted({len(row['seeds']) for row in table.values()})
    out += [f'**Sized sweep, {title}** (decayed learning rate, one run per budget; mean ± std '
            f'over seeds, n = {"/".join(map(str, ns))})', '',
            '| variant | steps | train TFLOP | stdlib val bpb | held-out bpb | '
            'agreement per depth | tau greedy | tau T = 1 |', '|---|---|---|---|---|---|---|---|']
    for v, row in table.items():
      m = row['metrics']
      agree = ' / '.join(_pm(m[f'heldout_agree_{k}'], '{:.2f}')
                         for k in range(1, row['depth'] + 1)) or 'n.a.'
      taus = [_pm(m.get(f'tau_{t}'), '{:.2f}') if row['depth'] else '1 (n.a.)'
              for t in ('T0', 'T1')]
      label = _label(v, row) + (f', {row["curriculum"]} curriculum'
                                if row.get('curriculum', 'none') != 'none' else '')
      out.append(f'| {label} | {_pm(m["steps"], "{:.0f}")} | {_pm(m["train_tflop"], "{:.2f}")} '
                 f'| {_pm(m["stdlib_bpb"])} | {_pm(m["heldout_bpb"])} | {agree} | '
                 f'{" | ".join(taus)} |')
    out.append('')
    for metric, d in part['mde'].items():
      out.append(f'Minimum detectable paired effect on {metric} (alpha 0.05, power 0.8, '
                 f'n = {d["n"]}): {d["mde"]:.3f} bits per byte (pooled sd of the paired '
                 f'differences of {", ".join(d["arms"])} against d0: {d["pooled_sd"]:.4f}, '
                 f'{d["dof"]} dof).')
    families = {}
    for name, t in part['tests'].items():
      families.setdefault(t.get('family', ''), []).append(name)
    for family, names in families.items():
      out += ['', f'Paired differences, family "{family}" (Holm\'s correction over its '
              f'{len(names)} tests; negative bpb = better than the reference):', '']
      out += [_test_line(name, part['tests'][name]) for name in names]
    out.append('')
  return out


NAMES_TITLE = ('Induction on stories with random names', 'a name')
BPE_TITLE = ('Induction as Gloeckle et al. ran it: trained on ordinary names, tested on random '
             'two-token names of the run\'s own BPE', 'a test name')


def markdown_names(names: dict, title=NAMES_TITLE) -> list[str]:
  table = names['table']
  out = [f'**{title[0]}** (copy accuracy = main-head top-1 '
         f'accuracy on the second token of {title[1]} at its second mention; chance '
         f'{names["chance"]:.3f}; mean ± std over seeds)', '',
         '| variant | steps | after 1/4 of the steps | after 1/2 | at the end (equal steps) | '
         'at equal FLOPs | steps to 50 % | at the end, each seed |',
         '|---|---|---|---|---|---|---|---|']
  for v, row in table.items():
    m = row['metrics']
    reach = m['steps_to_half']
    reached = f'{reach["n"]}/{len(row["seeds"])} seeds' + (
        f', {reach["mean"]:.0f}' if reach['n'] else '')
    eqf = _pm(m.get('copy_acc_equal_flops')) if row['depth'] else '(= at the end)'
    label = f'{v} (M = 0)' if not row['depth'] else f'{v} (M = {row["depth"]} {row["mtp_kind"]})'
    out.append(f'| {label} | {_pm(m["steps"], "{:.0f}")} | {_pm(m["copy_acc_quarter"])} | '
               f'{_pm(m["copy_acc_half"])} | {_pm(m["copy_acc_final"])} | {eqf} | {reached} | '
               f'{_seeds(m["copy_acc_final"])} |')
  out.append('')
  out += [_test_line(name, t, '{:+.3f}') for name, t in names['tests'].items()]
  out.append('')
  return out


def ind_alphabet(summary: dict):
  return summary.get('induction_task', {}).get('alphabet', '?')


def _label(v: str, row: dict) -> str:
  if not row['depth']:
    return f'{v} (M = 0)'
  return f'{v} (M = {row["depth"]} {row["mtp_kind"]})'


def write_summary(out_dir: str, seeds=None) -> str:
  """Tabulate OUT_DIR's runs into OUT_DIR/summary.json and summary.md; the markdown."""
  summary = tabulate(out_dir, seeds)
  text = markdown(summary)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=1, default=json_default)
  with open(os.path.join(out_dir, 'summary.md'), 'w') as f:
    f.write(text + '\n')
  return text


def json_default(x):
  if isinstance(x, np.generic):
    return x.item()
  raise TypeError(type(x))
