"""The ablation sweep behind mtp-ablation: its runs (every group's variants x seeds), the
in-process Sweep that trains and evaluates them, the sized sweep's design, then the tables
(research/tables.py, written as markdown by research/markdown.py).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys

import mtp_jax.research.design as design_lib
import mtp_jax.research.heldout as heldout
import mtp_jax.research.markdown as markdown_lib
import mtp_jax.research.results as results_lib
import mtp_jax.research.studies as studies
import mtp_jax.research.sweep as research
import mtp_jax.research.tables as tables
from mtp_jax.data import checks as data_checks
from mtp_jax.data import induction
from mtp_jax.errors import RequestError
from mtp_jax.research.tables import DRAFTER_EVAL, SIZED_BUDGETS

# The groups' config modules: the sweep runner (imported by mtp-ablation once its flags
# parse) reads them from the checkout here; the tables take them as arguments.
ABLATION, INDUCTION, NAMES = studies.ABLATION, studies.INDUCTION, studies.NAMES
BPE_NAMES, DRAFTER, CONFIGS = studies.BPE_NAMES, studies.DRAFTER, studies.CONFIGS


def group_variants(args, group: str) -> list[str]:
  """The group's variants that --variants keeps; bpe_names: each at every size,
  `<variant>@<size>` (--variants names a variant, at every size, or one variant@size)."""
  allv = list(ABLATION.SIZED_VARIANTS if group == 'sized' else design_lib.COMPUTE_VARIANTS
              if group == 'compute' else CONFIGS[group].VARIANTS)
  if group == 'bpe_names':
    return [f'{v}@{size}' for size in BPE_NAMES.SIZES for v in allv
            if not args.variants or v in args.variants or f'{v}@{size}' in args.variants]
  return [v for v in allv if not args.variants or v in args.variants]


def sized_runs(steps: int, smoke: bool = False, variants=None,
               deep: bool = False) -> list[tuple[str, str, int]]:
  """One seed's runs of the sized sweep [(variant, budget, steps)] when an equal-token run
  takes `steps`: every variant at `steps`, each MTP variant again at its equal-FLOP steps
  (the most whose FLOPs do not exceed d0's run; M = 0's run serves both budgets). `deep`:
  on configs/ablation.py's ',deep' trunk (the compute study)."""
  opt = ',decay' + (',deep' if deep else '') + (',smoke' if smoke else '')
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
    raise RequestError(f'the sized group needs its design: run mtp-ablation --design '
                         f'--out {args.out} first (or pass --sized_steps)')
  with open(path) as f:
    return int(json.load(f)['steps'])


def drafter_runs(args, seed: int) -> list:
  """One seed of the drafter study: its trunk (kept at its end while an arm of the seed
  still needs it) and the arms --variants keeps, each started from that trunk."""
  opt = ',smoke' if args.smoke else ''
  trunk_dir = os.path.join(args.workdir, 'drafter', f'{DRAFTER.TRUNK}_s{seed}_final')
  every = 4 if args.smoke else 100

  def config(v):
    c = DRAFTER.get_config(v + opt)
    c.seed, c.data.shuffle_seed = seed, seed
    if args.data_dir:
      c.data.data_dir = args.data_dir
    return c

  arms = []
  production = [v for v in DRAFTER.PRODUCTION_ARMS if v in args.variants]  # only when named
  for v in [*DRAFTER.ARMS, *production]:
    if not args.variants or v in args.variants:
      c = config(v)
      arms.append(research.Run('drafter', v, seed, c, eval_at={DRAFTER_EVAL: int(c.train.steps)},
                               save_every=every, init_from=trunk_dir))
  c = config(DRAFTER.TRUNK)
  pending = any(results_lib.find_result(args.out, 'drafter', r.variant, seed) is None
                for r in arms)
  trunk = research.Run('drafter', DRAFTER.TRUNK, seed, c,
                       eval_at={DRAFTER_EVAL: int(c.train.steps)}, save_every=every,
                       keep_final=trunk_dir, final_needed=pending)
  return [trunk] + arms


def make_runs(args):
  """Every Run of the sweep, seed-major (a partial sweep has every variant's first seeds)."""
  opt = ',smoke' if args.smoke else ''
  runs = []
  sized = sized_runs(sized_steps(args), args.smoke,
                     group_variants(args, 'sized')) if 'sized' in args.groups else []
  compute = sized_runs(ABLATION.SMOKE_STEPS if args.smoke else design_lib.COMPUTE_STEPS,
                       args.smoke, group_variants(args, 'compute'), deep=True)
  for seed in args.seeds:
    for group in args.groups:
      if group == 'drafter':
        runs += drafter_runs(args, seed)
        continue
      if group in ('sized', 'compute'):  # compute: the sized runs on the ',deep' trunk
        deep = ',deep' if group == 'compute' else ''
        for v, budget, steps in (sized if group == 'sized' else compute):
          c = ABLATION.get_config(v + ',decay' + deep + opt)
          c.seed, c.data.shuffle_seed, c.train.steps = seed, seed, steps
          if args.data_dir:
            c.data.data_dir = args.data_dir
          runs.append(research.Run(group, f'{v}@{budget}', seed, c,
                                   eval_at={SIZED_BUDGETS[budget]: steps},
                                   save_every=4 if args.smoke else 100))
        continue
      mod = CONFIGS[group]
      base = mod.get_config(mod.BASELINE + opt)
      for v in group_variants(args, group):
        c = mod.get_config(v.split('@')[0] + opt)
        c.seed = seed
        c.data.shuffle_seed = seed
        if args.data_dir:
          c.data.data_dir = args.data_dir
        equal = ABLATION.equal_flop_steps(c, base)
        if group == 'lm':
          runs.append(research.Run('lm', v, seed, c, eval_at={
              'equal_flops': equal, 'equal_tokens': int(c.train.steps)},
              save_every=4 if args.smoke else 50))
        elif group == 'bpe_names':  # as names, one trunk size per variant@size
          v_name, size = v.split('@')
          c = BPE_NAMES.get_config(f'{v_name},{size}{opt}')
          c.seed, c.data.shuffle_seed = seed, seed
          every = BPE_NAMES.SMOKE_EVAL_EVERY if args.smoke else BPE_NAMES.EVAL_EVERY
          runs.append(research.Run('bpe_names', v, seed, c, kind='induction', eval_every=every,
                                   log_every=every, task=BPE_NAMES.SMOKE_TASK if args.smoke
                                   else BPE_NAMES.TASK, save_every=4 if args.smoke else 100))
        elif group == 'names':  # every variant the same steps; equal FLOPs from the curves
          every = NAMES.SMOKE_EVAL_EVERY if args.smoke else NAMES.EVAL_EVERY
          runs.append(research.Run('names', v, seed, c, kind='induction', eval_every=every,
                                   log_every=every, task=NAMES.SMOKE_TASK if args.smoke
                                   else NAMES.TASK, save_every=4 if args.smoke else 100))
        else:
          c.train.steps = equal  # equal compute: M = k trains fewer steps than M = 0
          every = INDUCTION.SMOKE_EVAL_EVERY if args.smoke else INDUCTION.EVAL_EVERY
          runs.append(research.Run('induction', v, seed, c, kind='induction',
                                   eval_every=every, log_every=every,
                                   task=INDUCTION.SMOKE_TASK if args.smoke else INDUCTION.TASK,
                                   save_every=4 if args.smoke else 100))
  return runs


def make_sweep(args, runs):
  sweep = research.Sweep(args.workdir, args.out,
                         log=lambda s: print(s, file=sys.stderr, flush=True))
  lm = [r for r in runs if r.kind == 'lm' and sweep.to_run(r)]
  if lm:
    data_checks.validate_data(lm[0].config)  # prepares the stdlib data set once
    rule = heldout.HeldoutRule(cap_bytes=200_000) if args.smoke else heldout.HeldoutRule()
    sweep.lm_eval = research.LMEvaluator(
        lm[0].config, eval_batches=2 if args.smoke else 32,
        num_prompts=2 if args.smoke else 16, prompt_len=16 if args.smoke else 64,
        new_tokens=8 if args.smoke else 64, heldout_rule=rule,
        temperatures=args.temperatures)
  for group in ('induction', 'names', 'bpe_names'):
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


def main_head_command(seeds: int, steps: int, out: str, workdir: str) -> str:
  """The command that runs the main-head arms' seeds 0..seeds-1, skipping every finished one."""
  return (f'mtp-ablation --groups sized --variants {",".join(design_lib.MAIN_HEAD_ARMS)} '
          f'--seeds {",".join(str(s) for s in range(seeds))} --sized_steps {steps} '
          f'--out {out} --workdir {workdir}')


def main_head(args, step_s=None, eval_s=None) -> dict:
  """The seeds the main-head question needs at the committed sweep's spread of its arms
  (design_lib.main_head_design) and the command that adds them to the committed runs."""
  spread = design_lib.committed_spread(args.spread_from, ABLATION.BASELINE,
                                       design_lib.MAIN_HEAD_ARMS)
  out = design_lib.main_head_design(
      spread, step_seconds=step_s, eval_seconds=eval_s,
      runs_for=lambda n: sized_runs(n, args.smoke, design_lib.MAIN_HEAD_ARMS))
  out['command'] = main_head_command(out['seeds'], spread['steps'], args.out, args.workdir)
  return out


def make_design(args) -> dict:
  """--design: the committed spread, step times measured briefly, the chosen design."""
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
  design['families'] = design_lib.FAMILIES
  design['main_head'] = main_head(args, step_s, eval_s)
  design['names'] = names_estimate(args, research)
  design['load_average'] = {'before': list(load), 'after': list(os.getloadavg())}
  design['command'] = (f'mtp-ablation --groups sized --seeds '
                       f'{",".join(str(s) for s in range(design["seeds"]))} '
                       f'--sized_steps {design["steps"]}')
  return design


def drafter_command(seeds: int, out: str, workdir: str) -> str:
  return (f'mtp-ablation --groups drafter --seeds {",".join(str(s) for s in range(seeds))} '
          f'--out {out} --workdir {workdir}')


def make_drafter_design(args) -> dict:
  """--design --groups drafter: the study's seeds at its spread (its own runs once it has
  some, else the committed sweep's tau spread) and its wall time from step and evaluation
  times measured briefly (the trunk, and ref for every arm: they cost the same)."""
  design = design_lib.drafter_design(design_lib.drafter_spread(args.out, args.spread_from))
  opt = ',smoke' if args.smoke else ''
  load = os.getloadavg()
  step_s, eval_s = {}, {}
  for v in (DRAFTER.TRUNK, DRAFTER.BASELINE):
    c = DRAFTER.get_config(v + opt)
    print(f'measuring drafter {v} ...', file=sys.stderr, flush=True)
    step_s[v] = research.measure_step_seconds(c, args.measure_steps)
    eval_s[v] = research.measure_eval_seconds(
        c, eval_batches=2 if args.smoke else 32, sets=2, num_prompts=2 if args.smoke else 16,
        prompt_len=16 if args.smoke else 64, new_tokens=8 if args.smoke else 64,
        temperatures=args.temperatures)
  trunk, arm = DRAFTER.get_config(DRAFTER.TRUNK + opt), DRAFTER.get_config(DRAFTER.BASELINE + opt)
  per_seed = (trunk.train.steps * step_s[DRAFTER.TRUNK] + eval_s[DRAFTER.TRUNK]
              + len(DRAFTER.ARMS) * (arm.train.steps * step_s[DRAFTER.BASELINE]
                                     + eval_s[DRAFTER.BASELINE]))
  design.update(step_seconds=step_s, eval_seconds=eval_s, per_seed_seconds=per_seed,
                wall_seconds=design['seeds'] * per_seed,
                load_average={'before': list(load), 'after': list(os.getloadavg())},
                command=drafter_command(design['seeds'], args.out, args.workdir))
  return design


def write_drafter_design(args) -> int:
  """OUT/design.json gains (or replaces) its `drafter` key; every other key stays."""
  design = make_drafter_design(args)
  path = design_path(args.out)
  whole = {}
  if os.path.isfile(path):
    with open(path) as f:
      whole = json.load(f)
  whole['drafter'] = design
  os.makedirs(args.out, exist_ok=True)
  with open(path, 'w') as f:
    json.dump(whole, f, indent=1, default=tables.json_default)
  print(design_lib.describe_drafter(design))
  return 0


def write_declarations(args) -> int:
  """--declare: OUT/design.json gains (or replaces) the keys design_lib.declarations
  writes; every other key stays. The compute study's key also gets its training seconds
  per step on this host (measured briefly) and the wall time of its seeds from them."""
  declared = design_lib.declarations(args.spread_from)
  compute = declared['compute']
  load = os.getloadavg()
  step_s = {}
  for _ in range(2):  # alternated rounds, the fastest of each: a shared host's pauses hit one
    for v in design_lib.COMPUTE_VARIANTS:
      c = ABLATION.get_config(v + ',decay,deep' + (',smoke' if args.smoke else ''))
      print(f'measuring compute {v} ...', file=sys.stderr, flush=True)
      step_s[v] = min(step_s.get(v, math.inf),
                      research.measure_step_seconds(c, args.measure_steps))
  compute['runs'] = [list(r) for r in sized_runs(
      ABLATION.SMOKE_STEPS if args.smoke else design_lib.COMPUTE_STEPS, args.smoke,
      design_lib.COMPUTE_VARIANTS, deep=True)]
  per_seed = sum(step_s[v] * steps for v, _, steps in compute['runs'])
  compute.update(step_seconds=step_s, per_seed_train_seconds=per_seed,
                 wall_train_seconds=per_seed * compute['seeds'],
                 load_average={'before': list(load), 'after': list(os.getloadavg())},
                 host=research.host_record(),
                 command=(f'mtp-ablation --groups compute --seeds '
                          f'{",".join(str(s) for s in range(compute["seeds"]))} '
                          f'--out {args.out} --workdir {args.workdir}'))
  path = design_path(args.out)
  whole = {}
  if os.path.isfile(path):
    with open(path) as f:
      whole = json.load(f)
  whole.update(declared)
  os.makedirs(args.out, exist_ok=True)
  with open(path, 'w') as f:
    json.dump(whole, f, indent=1, default=tables.json_default)
  print(f"Declared in {path}: {', '.join(declared)}.\nCompute study: {compute['seeds']} seeds "
        f"(minimum detectable effect {compute['mde_at_seeds']:.3f} at the planning sd "
        f"{compute['planning_sd']:.4f}), {per_seed:.0f} s of training steps a seed here, "
        f"{compute['wall_train_seconds'] / 3600:.1f} h in all.\nRun: {compute['command']}")
  return 0


def remove_spent_trunks(args) -> None:
  """The drafter trunks' kept final states once every arm of their seed has finished."""
  if 'drafter' not in args.groups:
    return
  for seed in args.seeds:
    trunk = drafter_runs(args, seed)[0]
    done = all(results_lib.find_result(args.out, 'drafter', v, seed) is not None
               for v in DRAFTER.ARMS)  # every arm, not only those --variants keeps
    if done and research.has_final(trunk):
      shutil.rmtree(trunk.keep_final, ignore_errors=True)


def run(args) -> int:
  """mtp-ablation after its flags parse: --design, else the runs (unless --no_run), then the
  tables."""
  if getattr(args, 'declare', False):
    return write_declarations(args)
  if args.design and 'drafter' in args.groups:
    return write_drafter_design(args)
  if args.design:
    design = make_design(args)
    os.makedirs(args.out, exist_ok=True)
    with open(design_path(args.out), 'w') as f:
      json.dump(design, f, indent=1, default=tables.json_default)
    print(design_lib.describe(design))
    la = design['load_average']
    nm = design['names']
    print(f"Measured at load average {la['before'][0]:.1f} (1 min) on {os.cpu_count()} cores; "
          f"the estimate scales with the load.\nRun: {design['command']}\n"
          f"Names induction: {nm['seeds']} seeds x {len(nm['step_seconds'])} variants x "
          f"{nm['steps']} steps, estimated {nm['wall_seconds'] / 3600:.2f} h (seconds per step "
          + ', '.join(f'{v} {t:.3f}' for v, t in nm['step_seconds'].items())
          + f").\nRun: {nm['command']}")
    print(design_lib.describe_main_head(design['main_head']))
    return 0
  if not args.no_run:
    runs = make_runs(args)
    sweep = make_sweep(args, runs)
    for run in runs:
      sweep.run(run)
    remove_spent_trunks(args)
  print(write_summary(args.out, args.table_seeds))
  return 0


def write_summary(out_dir: str, seeds=None) -> str:
  """Tabulate OUT_DIR's runs into OUT_DIR/summary.json and summary.md; the markdown."""
  summary = tables.tabulate(out_dir, seeds, CONFIGS, studies.d768_iteration_costs())
  text = markdown_lib.markdown(summary)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=1, default=tables.json_default)
  with open(os.path.join(out_dir, 'summary.md'), 'w') as f:
    f.write(text + '\n')
  return text
