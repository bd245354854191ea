"""Multi-seed MTP ablations: every variant x seed, resumable, tabulated as mean ± std.

  mtp-ablation --seeds 0,1,2             # run what is missing, then the tables
  mtp-ablation --seeds 0,1,2 --no_run    # the tables of what is there
  mtp-plot --sweep runs/ablation             # the figures

Two groups of runs (mtp_jax/research/sweep.py trains them in this one process):
- `lm`: configs/ablation.py's D = 0 / 1 / 3 sequential / 3 parallel on the stdlib
  corpus; each run is evaluated at its equal-training-FLOP step and at the equal-token
  step (the schedule is constant after warmup, so both come from one run). Evaluation:
  bits per byte (with the standard error of the estimate) on the stdlib validation
  split and on a held-out corpus of third-party code (heldout.heldout_documents),
  teacher-forced agreement of each MTP depth with the main head, and free-running
  speculative decoding of held-out prompts, greedy and sampled at T = 1 and T = 0.7.
- `induction`: configs/induction.py's D = 0 / 1 / 3 at equal training FLOPs; accuracy
  on the second occurrence of a repeated random span vs training steps.
- `sized`: configs/ablation.py's `,decay` variants d0 / d1 / d3 / d3f / d3r / d3p with a
  learning rate decayed over each run, so every budget is its own run (`<variant>@tokens`
  at the design's steps, `<variant>@flops` at its equal-FLOP steps; d0@tokens is both);
  the seeds and steps come from `--design` (mtp_jax/research/design.py), which sizes the
  sweep to a minimum detectable paired effect and writes OUT/design.json. Every table
  prints the minimum detectable effect of the seeds it has.
- `names`: configs/induction_names.py's D = 0 / parallel n = 2 / sequential D = 1 on
  stories with random names (Gloeckle et al. 2024 section 4.1): accuracy on the second
  token of a name at its second mention vs steps, at equal steps and equal FLOPs.

Each run writes OUT/<group>/<variant>_s<seed>.json when it finishes; a run whose JSON
exists is skipped, an interrupted one resumes from its last checkpoint in WORKDIR. The
tables go to stdout and to OUT/summary.md, with their numbers in OUT/summary.json.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from mtp_jax import cli, config_files
from mtp_jax.research import stats  # numpy and scipy only

# The checkout this package is installed from (pip install -e .): configs/ lives there.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GROUPS = ('lm', 'induction', 'sized', 'names')
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
CONFIGS = {'lm': ABLATION, 'induction': INDUCTION, 'names': NAMES}


def parse(argv):
  p = cli.ArgumentParser(prog='mtp-ablation', description=__doc__.splitlines()[0])
  p.add_argument('--seeds', default='0,1,2', help='comma-separated integer seeds')
  p.add_argument('--groups', default=','.join(DEFAULT_GROUPS),
                 help=f'comma-separated, of {", ".join(GROUPS)}')
  p.add_argument('--variants', default='', help='subset of variants (default: all of a group)')
  p.add_argument('--workdir', default=os.path.join('runs', 'ablation', 'workdirs'),
                 help='checkpoints of unfinished runs')
  p.add_argument('--out', default=os.path.join('runs', 'ablation'),
                 help='lm.json and induction.json (every run), summary.json and summary.md')
  p.add_argument('--no_run', action='store_true', help='only tabulate what is there')
  p.add_argument('--smoke', action='store_true', help='tiny configs, a few steps (tests)')
  p.add_argument('--data_dir', default='', help='data.data_dir of the stdlib data set')
  p.add_argument('--temperatures', default='0,1,0.7',
                 help='decode temperatures of the lm runs (0 = greedy)')
  p.add_argument('--design', action='store_true',
                 help='size the sized sweep: measure step times briefly, print the design, '
                      'write OUT/design.json; trains nothing')
  p.add_argument('--spread_from', default=os.path.join(REPO, 'benchmarks', 'research'),
                 help='the committed sweep whose seed spread sizes the design')
  p.add_argument('--budget_hours', type=float, default=2.0, help='--design: the time budget')
  p.add_argument('--measure_steps', type=int, default=4,
                 help='--design: timed train steps per variant')
  p.add_argument('--sized_steps', type=int, default=0,
                 help='sized: steps of an equal-token run (default: OUT/design.json)')
  args = p.parse_args(argv)
  if args.budget_hours <= 0 or args.measure_steps < 1 or args.sized_steps < 0:
    p.error('--budget_hours must be > 0, --measure_steps >= 1 and --sized_steps >= 0')
  try:
    args.seeds = [int(s) for s in args.seeds.split(',')]
  except ValueError:
    p.error(f'--seeds must be comma-separated integers, got {args.seeds!r}')
  if len(set(args.seeds)) != len(args.seeds) or any(s < 0 for s in args.seeds):
    p.error(f'--seeds must be distinct non-negative integers, got {args.seeds}')
  try:
    args.temperatures = [float(t) for t in args.temperatures.split(',')]
  except ValueError:
    p.error(f'--temperatures must be comma-separated numbers, got {args.temperatures!r}')
  if any(not t >= 0 for t in args.temperatures):
    p.error(f'--temperatures must be >= 0, got {args.temperatures}')
  args.groups = args.groups.split(',')
  bad = [g for g in args.groups if g not in GROUPS]
  if bad:
    p.error(f'unknown group(s) {bad}; choose from {", ".join(GROUPS)}')
  args.variants = args.variants.split(',') if args.variants else []
  known = set(ABLATION.VARIANTS) | set(INDUCTION.VARIANTS) | set(ABLATION.SIZED_VARIANTS) \
      | set(NAMES.VARIANTS)
  bad = [v for v in args.variants if v not in known]
  if bad:
    p.error(f'unknown variant(s) {bad}; choose from {", ".join(sorted(known))}')
  return args


def group_variants(args, group: str) -> list[str]:
  allv = list(ABLATION.SIZED_VARIANTS if group == 'sized' else CONFIGS[group].VARIANTS)
  return [v for v in allv if not args.variants or v in args.variants]


def sized_runs(steps: int, smoke: bool = False, variants=None) -> list[tuple[str, str, int]]:
  """One seed's runs of the sized sweep [(variant, budget, steps)] when an equal-token run
  takes `steps`: every variant at `steps`, each MTP variant again at its equal-FLOP steps
  (the most whose FLOPs do not exceed d0's run; D = 0's run serves both budgets)."""
  opt = ',decay' + (',smoke' if smoke else '')
  base = ABLATION.get_config(ABLATION.BASELINE + opt)
  base.train.steps = steps
  out = []
  for v in variants or ABLATION.SIZED_VARIANTS:
    out.append((v, 'tokens', steps))
    if v != ABLATION.BASELINE:
      c = ABLATION.get_config(v + opt)
      c.train.steps = steps
      out.append((v, 'flops', ABLATION.equal_flop_steps(c, base)))
  return out


def design_path(out: str) -> str:
  return os.path.join(out, 'design.json')


def sized_steps(args) -> int:
  """The equal-token steps of the sized sweep: --sized_steps, else OUT/design.json's."""
  if args.sized_steps:
    return args.sized_steps
  if args.smoke:
    return ABLATION.SMOKE_STEPS
  path = design_path(args.out)
  if not os.path.isfile(path):
    raise cli.RequestError(f'the sized group needs its design: run mtp-ablation --design '
                         f'--out {args.out} first (or pass --sized_steps)')
  with open(path) as f:
    return int(json.load(f)['steps'])


def make_runs(args):
  """Every Run of the sweep, seed-major (a partial sweep has every variant's first seeds)."""
  from mtp_jax.research import sweep as research  # deferred: JAX starts here, after the argument checks
  opt = ',smoke' if args.smoke else ''
  runs = []
  sized = sized_runs(sized_steps(args), args.smoke,
                     group_variants(args, 'sized')) if 'sized' in args.groups else []
  for seed in args.seeds:
    for group in args.groups:
      if group == 'sized':
        for v, budget, steps in sized:
          c = ABLATION.get_config(v + ',decay' + opt)
          c.seed, c.data.shuffle_seed, c.train.steps = seed, seed, steps
          if args.data_dir:
            c.data.data_dir = args.data_dir
          runs.append(research.Run('sized', f'{v}@{budget}', seed, c,
                                   eval_at={SIZED_BUDGETS[budget]: steps},
                                   save_every=4 if args.smoke else 100))
        continue
      mod = CONFIGS[group]
      base = mod.get_config(mod.BASELINE + opt)
      for v in group_variants(args, group):
        c = mod.get_config(v + opt)
        c.seed = seed
        c.data.shuffle_seed = seed
        if args.data_dir:
          c.data.data_dir = args.data_dir
        equal = ABLATION.equal_flop_steps(c, base)
        if group == 'lm':
          runs.append(research.Run('lm', v, seed, c, eval_at={
              'equal_flops': equal, 'equal_tokens': int(c.train.steps)},
              save_every=4 if args.smoke else 50))
        elif group == 'names':  # every variant the same steps; equal FLOPs from the curves
          every = NAMES.SMOKE_EVAL_EVERY if args.smoke else NAMES.EVAL_EVERY
          runs.append(research.Run('names', v, seed, c, kind='induction', eval_every=every,
                                   log_every=every, task=NAMES.SMOKE_TASK if args.smoke
                                   else NAMES.TASK, save_every=4 if args.smoke else 100))
        else:
          c.train.steps = equal  # equal compute: D = k trains fewer steps than D = 0
          every = INDUCTION.SMOKE_EVAL_EVERY if args.smoke else INDUCTION.EVAL_EVERY
          runs.append(research.Run('induction', v, seed, c, kind='induction',
                                   eval_every=every, log_every=every,
                                   task=INDUCTION.SMOKE_TASK if args.smoke else INDUCTION.TASK,
                                   save_every=4 if args.smoke else 100))
  return runs


def make_sweep(args, runs):
  from mtp_jax.research import heldout
  from mtp_jax.research import sweep as research
  from mtp_jax.data import induction
  sweep = research.Sweep(args.workdir, args.out,
                         log=lambda s: print(s, file=sys.stderr, flush=True))
  lm = [r for r in runs if r.kind == 'lm' and not sweep.finished(r)]
  if lm:
    from mtp_jax.data import checks as data_checks
    data_checks.validate_data(lm[0].config)  # prepares the stdlib data set once
    rule = heldout.HeldoutRule(cap_bytes=200_000) if args.smoke else heldout.HeldoutRule()
    sweep.lm_eval = research.LMEvaluator(
        lm[0].config, eval_batches=2 if args.smoke else 32,
        num_prompts=2 if args.smoke else 16, prompt_len=16 if args.smoke else 64,
        new_tokens=8 if args.smoke else 64, heldout_rule=rule,
        temperatures=args.temperatures)
  for group in ('induction', 'names'):
    ind = [r for r in runs if r.group == group]
    if ind:
      mod = CONFIGS[group]
      rows = mod.SMOKE_EVAL_ROWS if args.smoke else mod.EVAL_ROWS
      task = induction.make_task(ind[0].config.data.seq_len, **ind[0].task)
      sweep.induction_evals[group] = research.InductionEvaluator(task, rows)
  sweep.induction_eval = sweep.induction_evals.get('induction')
  return sweep


def names_estimate(args, research) -> dict:
  """Wall time of the names group at design_lib.MIN_SEEDS seeds, from measured step and
  evaluation times (every variant trains the same steps and evaluates every EVAL_EVERY)."""
  from mtp_jax.data import induction
  from mtp_jax.research import design as design_lib
  opt = ',smoke' if args.smoke else ''
  steps = NAMES.SMOKE_STEPS if args.smoke else NAMES.STEPS
  every = NAMES.SMOKE_EVAL_EVERY if args.smoke else NAMES.EVAL_EVERY
  rows = NAMES.SMOKE_EVAL_ROWS if args.smoke else NAMES.EVAL_ROWS
  step_s, eval_s = {}, {}
  for v in NAMES.VARIANTS:
    c = NAMES.get_config(v + opt)
    print(f'measuring names {v} ...', file=sys.stderr, flush=True)
    step_s[v] = research.measure_step_seconds(c, args.measure_steps)
    task = induction.make_task(c.data.seq_len, **(NAMES.SMOKE_TASK if args.smoke else NAMES.TASK))
    eval_s[v] = research.measure_induction_eval_seconds(c, research.InductionEvaluator(task, rows))
  per_seed = sum(steps * step_s[v] + (steps // every + 1) * eval_s[v] for v in NAMES.VARIANTS)
  seeds = design_lib.MIN_SEEDS
  return {'seeds': seeds, 'steps': steps, 'per_seed_seconds': per_seed,
          'wall_seconds': seeds * per_seed, 'step_seconds': step_s, 'eval_seconds': eval_s,
          'command': f'mtp-ablation --groups names --seeds {",".join(map(str, range(seeds)))}'}


def make_design(args) -> dict:
  """--design: the committed spread, step times measured briefly, the chosen design."""
  from mtp_jax.research import design as design_lib
  from mtp_jax.research import sweep as research  # deferred: JAX starts here
  spread = design_lib.committed_spread(args.spread_from, ABLATION.BASELINE)
  opt = ',decay' + (',smoke' if args.smoke else '')
  load = os.getloadavg()
  step_s, eval_s = {}, {}
  measured = {}  # variants of one shape cost the same (the curriculum only sets weights)
  for v in ABLATION.SIZED_VARIANTS:
    c = ABLATION.get_config(v + opt)
    key = (c.model.mtp.depth, c.model.mtp.kind)
    if key not in measured:
      print(f'measuring {v} ...', file=sys.stderr, flush=True)
      measured[key] = (
          research.measure_step_seconds(c, args.measure_steps),
          research.measure_eval_seconds(
              c, eval_batches=2 if args.smoke else 32, sets=2,
              num_prompts=2 if args.smoke else 16, prompt_len=16 if args.smoke else 64,
              new_tokens=8 if args.smoke else 64, temperatures=args.temperatures))
    step_s[v], eval_s[v] = measured[key]
  design = design_lib.choose(spread, lambda n: sized_runs(n, args.smoke), step_s, eval_s,
                             budget_hours=args.budget_hours)
  design['names'] = names_estimate(args, research)
  design['load_average'] = {'before': list(load), 'after': list(os.getloadavg())}
  design['command'] = (f'mtp-ablation --groups sized --seeds '
                       f'{",".join(str(s) for s in range(design["seeds"]))} '
                       f'--sized_steps {design["steps"]}')
  return design


# -- tables -------------------------------------------------------------------------------------
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
  from mtp_jax.research import sweep as research
  summary = {'lm': {}, 'induction': {}, 'tests': {}}
  lm = [r for r in research.load_results(out_dir, 'lm') if seeds is None or r['seed'] in seeds]
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
        a, b = table['d3']['metrics'][metric]['per_seed'], table['d3p']['metrics'][metric]['per_seed']
        if len(a) >= 2 and len(b) >= 2:
          tests[f'd3 - d3p {metric}'] = {'welch': stats.welch(list(a.values()),
                                                                 list(b.values()))}
    summary['tests'][budget] = tests
  ind = [r for r in research.load_results(out_dir, 'induction')
         if seeds is None or r['seed'] in seeds]
  ind_by = {}
  for r in ind:
    ind_by.setdefault(r['variant'], []).append(r)
  base_runs = {r['seed']: r for r in ind_by.get(INDUCTION.BASELINE, [])}
  for v in [v for v in INDUCTION.VARIANTS if v in ind_by]:
    per = {}
    for r in ind_by[v]:
      per[r['seed']] = induction_metrics(r)
      if r['seed'] in base_runs:  # equal steps (= tokens): D = 0's accuracy at this run's end
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
  sized = [r for r in research.load_results(out_dir, 'sized')
           if seeds is None or r['seed'] in seeds]
  if sized:
    summary['sized'] = tabulate_sized(sized)
  names = [r for r in research.load_results(out_dir, 'names')
           if seeds is None or r['seed'] in seeds]
  if names:
    summary['names'] = tabulate_names(names)
  return summary


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


def tabulate_sized(runs: list[dict]) -> dict:
  """The sized sweep per budget: variant rows (mean ± std), paired tests against d0 (and
  the curricula against static d3), and the minimum detectable effect of the design."""
  by = {}
  for r in runs:
    v, suffix = r['variant'].split('@')
    by.setdefault((v, SIZED_BUDGETS[suffix]), []).append(r)
  out = {}
  for budget in BUDGETS:
    table = {}
    for v in ABLATION.SIZED_VARIANTS:
      rs = by.get((v, budget)) or (by.get((v, 'equal_tokens')) if v == ABLATION.BASELINE
                                   else None)  # D = 0's one run serves both budgets
      if not rs:
        continue
      cfg = rs[0]['config']['model']['mtp']
      table[v] = {'depth': rs[0]['depth'], 'mtp_kind': rs[0]['mtp_kind'],
                  'curriculum': cfg.get('curriculum', 'none'),
                  'seeds': sorted(r['seed'] for r in rs),
                  'metrics': aggregate({r['seed']: lm_metrics(r, next(iter(r['evals'])))
                                        for r in rs})}
    tests, pooled = {}, {'stdlib_bpb': [], 'heldout_bpb': []}
    pairs = [(v, ABLATION.BASELINE) for v in table if v != ABLATION.BASELINE]
    pairs += [(v, 'd3') for v in ('d3f', 'd3r') if v in table and 'd3' in table]
    for v, ref in pairs:
      if ref not in table:
        continue
      for metric in ('stdlib_bpb', 'heldout_bpb') + (('tau_T0', 'tau_T1') if ref == 'd3'
                                                     else ()):
        if metric not in table[v]['metrics'] or metric not in table[ref]['metrics']:
          continue
        t = paired_test(table[v]['metrics'][metric]['per_seed'],
                        table[ref]['metrics'][metric]['per_seed'])
        if t is not None:
          tests[f'{v} - {ref} {metric}'] = t
          if ref == ABLATION.BASELINE:
            a, b = table[v]['metrics'][metric]['per_seed'], table[ref]['metrics'][metric]['per_seed']
            pooled[metric].append([a[s] - b[s] for s in a if s in b])
    design = {}
    for metric, groups in pooled.items():
      sd, dof = stats.pooled_sd(groups)
      n = min((len(g) for g in groups), default=0)
      if dof:
        design[metric] = {'pooled_sd': sd, 'dof': dof, 'n': n,
                          'mde': stats.min_detectable_effect(sd, n)}
    out[budget] = {'table': table, 'tests': tests, 'mde': design}
  return out


def _names_equal_flop_step(r: dict, base: dict) -> int:
  return max(1, int(base['steps'] * base['flops_per_step'] // r['flops_per_step']))


def _at_step(curve: list[dict], step: int) -> float:
  """Copy accuracy at the last evaluation at or before `step`."""
  return [p for p in curve if p['step'] <= step][-1]['copy_acc']


def tabulate_names(runs: list[dict]) -> dict:
  """Name-story induction: per variant the curve's landmarks, equal steps and equal FLOPs
  against D = 0, paired by seed (same task batches and trunk initialisation)."""
  by = {}
  for r in runs:
    by.setdefault(r['variant'], {})[r['seed']] = r
  base = by.get(NAMES.BASELINE, {})
  table = {}
  for v in [v for v in NAMES.VARIANTS if v in by]:
    per = {}
    for seed, r in by[v].items():
      curve = [p for p in r['curve'] if 'copy_acc' in p]
      m = {'steps': r['steps'], 'copy_acc_final': curve[-1]['copy_acc'],
           'other_acc_final': curve[-1]['other_acc'],
           'copy_acc_quarter': _at_step(curve, r['steps'] // 4),
           'copy_acc_half': _at_step(curve, r['steps'] // 2),
           'steps_to_half': next((p['step'] for p in curve if p['copy_acc'] >= 0.5), None)}
      b = base.get(seed)
      if b is not None:  # equal FLOPs: this run at the most steps within D = 0's FLOPs
        eq = _names_equal_flop_step(r, b)
        m['equal_flop_step'] = eq
        m['copy_acc_equal_flops'] = _at_step(curve, eq)
      per[seed] = m
    table[v] = {'depth': next(iter(by[v].values()))['depth'],
                'mtp_kind': next(iter(by[v].values()))['mtp_kind'],
                'seeds': sorted(by[v]), 'metrics': aggregate(per)}
  tests = {}
  if NAMES.BASELINE in table:
    b = table[NAMES.BASELINE]['metrics']['copy_acc_final']['per_seed']
    for v in table:
      if v == NAMES.BASELINE:
        continue
      m = table[v]['metrics']
      for name, metric in (('equal steps', 'copy_acc_final'),
                           ('equal FLOPs', 'copy_acc_equal_flops'),
                           ('half the steps', 'copy_acc_half')):
        other = b if metric != 'copy_acc_half' else \
            table[NAMES.BASELINE]['metrics']['copy_acc_half']['per_seed']
        t = paired_test(m[metric]['per_seed'], other) if metric in m else None
        if t is not None:
          tests[f'{v} - d0 copy accuracy, {name}'] = t
  task = next(iter(runs))['task']
  return {'table': table, 'tests': tests, 'task': task, 'chance': NAMES.CHANCE}


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
    out += [f'**{title[0].upper() + title[1:]}** (mean ± std over seeds, n = {"/".join(map(str, ns))}; '
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
      out += ['', 'Differences (negative bpb = better than D = 0): Welch t over seeds, and '
              'paired t over seeds (same seed = same data order and trunk init):', '']
      for name, t in tests.items():
        w = t['welch']
        line = f'- {name}: {w["diff"]:+.4f}, Welch t = {w["t"]:.2f}, p = {w["p"]:.3f}'
        if 'paired' in t:
          line += (f'; paired t = {t["paired"]["t"]:.2f}, p = {t["paired"]["p"]:.3f}; eval '
                   f'SE of one seed\'s difference {t["eval_se_of_difference"]:.4f}')
        out.append(line)
    out.append('')
  ind = summary['induction']
  if ind:
    alphabet = ind_alphabet(summary)
    out += ['**Induction** (equal training FLOPs; copy accuracy = top-1 accuracy of the main '
            'head on the second occurrence of the repeated span, after its first token; '
            f'chance 1/{alphabet})', '',
            '| variant | steps | train TFLOP | copy accuracy after 1/4 of the FLOPs | '
            'after 1/2 | at the end | at the end, each seed | D = 0 at the same step |',
            '|---|---|---|---|---|---|---|---|']
    for v, row in ind.items():
      m = row['metrics']
      out.append(f'| {v} (D = {row["depth"]}) | {_pm(m["steps"], "{:.0f}")} | '
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
      out.append(line)
  if summary.get('sized'):
    out += [''] + markdown_sized(summary['sized'])
  if summary.get('names'):
    out += [''] + markdown_names(summary['names'])
  return '\n'.join(out)


def _test_line(name: str, t: dict, fmt: str = '{:+.4f}') -> str:
  return (f'- {name}: {fmt.format(t["diff"])}, paired t = {t["t"]:.2f}, p = {t["p"]:.3f}, '
          f'n = {t["n"]}; minimum detectable effect {t["mde"]:.3f} (sd of the differences '
          f'{t["sd"]:.4f})')


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
                 f'differences against d0: {d["pooled_sd"]:.4f}, {d["dof"]} dof).')
    if part['tests']:
      out += ['', 'Paired differences (negative bpb = better than the reference):', '']
      out += [_test_line(name, t) for name, t in part['tests'].items()]
    out.append('')
  return out


def markdown_names(names: dict) -> list[str]:
  table = names['table']
  out = [f'**Induction on stories with random names** (copy accuracy = main-head top-1 '
         f'accuracy on the second token of a name at its second mention; chance '
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
    label = f'{v} (D = 0)' if not row['depth'] else f'{v} (D = {row["depth"]} {row["mtp_kind"]})'
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
    return f'{v} (D = 0)'
  return f'{v} (D = {row["depth"]} {row["mtp_kind"]})'


def main(argv=None) -> int:
  try:
    return _main(argv)
  except cli.RequestError as e:
    return cli.report_expected(e)


def _main(argv=None) -> int:
  args = parse(argv)
  if args.design:
    from mtp_jax.research import design as design_lib
    design = make_design(args)
    os.makedirs(args.out, exist_ok=True)
    with open(design_path(args.out), 'w') as f:
      json.dump(design, f, indent=1, default=_json_default)
    print(design_lib.describe(design))
    la = design['load_average']
    nm = design['names']
    print(f"Measured at load average {la['before'][0]:.1f} (1 min) on {os.cpu_count()} cores; "
          f"the estimate scales with the load.\nRun: {design['command']}\n"
          f"Names induction: {nm['seeds']} seeds x {len(nm['step_seconds'])} variants x "
          f"{nm['steps']} steps, estimated {nm['wall_seconds'] / 3600:.2f} h (seconds per step "
          + ', '.join(f'{v} {t:.3f}' for v, t in nm['step_seconds'].items())
          + f").\nRun: {nm['command']}")
    return 0
  if not args.no_run:
    runs = make_runs(args)
    sweep = make_sweep(args, runs)
    for run in runs:
      sweep.run(run)
  summary = tabulate(args.out, set(args.seeds))
  text = markdown(summary)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=1, default=_json_default)
  with open(os.path.join(args.out, 'summary.md'), 'w') as f:
    f.write(text + '\n')
  print(text)
  return 0


def _json_default(x):
  if isinstance(x, np.generic):
    return x.item()
  raise TypeError(type(x))


if __name__ == '__main__':
  sys.exit(main())
