"""Multi-seed MTP ablations: every variant x seed, resumable, tabulated as mean ± std.

  mtp-ablation --seeds 0,1,2             # run what is missing, then the tables
  mtp-ablation --no_run                  # the tables of every finished run in --out
  mtp-ablation --seeds 0,1,2 --no_run    # the tables of these seeds only
  mtp-plot --sweep runs/ablation             # the figures

Two groups of runs (mtp_jax/research/sweep.py trains them in this one process):
- `lm`: configs/ablation.py's M = 0 / 1 / 3 sequential / 3 parallel on the stdlib
  corpus; each run is evaluated at its equal-training-FLOP step and at the equal-token
  step (the schedule is constant after warmup, so both come from one run). Evaluation:
  bits per byte (with the standard error of the estimate) on the stdlib validation
  split and on a held-out corpus of third-party code (heldout.heldout_documents),
  teacher-forced agreement of each MTP depth with the main head, and free-running
  speculative decoding of held-out prompts, greedy and sampled at T = 1 and T = 0.7.
- `induction`: configs/induction.py's M = 0 / 1 / 3 at equal training FLOPs; accuracy
  on the second occurrence of a repeated random span vs training steps.
- `sized`: configs/ablation.py's `,decay` variants d0 / d1 / d3 / d3f / d3r / d3p / t1 with a
  learning rate decayed over each run, so every budget is its own run (`<variant>@tokens`
  at the design's steps, `<variant>@flops` at its equal-FLOP steps; d0@tokens is both);
  the seeds and steps come from `--design` (mtp_jax/research/design.py), which sizes the
  sweep to a minimum detectable paired effect and writes OUT/design.json. Every table
  prints the minimum detectable effect of the seeds it has.
- `names`: configs/induction_names.py's M = 0 / parallel n = 2 / sequential M = 1 on
  stories with random names (Gloeckle et al. 2024 section 4.1): accuracy on the second
  token of a name at its second mention vs steps, at equal steps and equal FLOPs.
- `bpe_names`: configs/induction_bpe.py's M = 0 / n = 2 / sequential M = 1 at each trunk
  size (`<variant>@<size>`), trained on stories with ordinary names and tested on random
  names of two tokens of the task's own trained BPE, as Gloeckle et al. ran it.
- `drafter`: configs/drafter.py's drafters on a fixed verifier: per seed one next-token
  trunk (`trunk`), then each arm's MTP modules trained on it frozen (three chained
  modules `ref`, one shared module `shared`, self-generated targets, decaying lambda,
  curricula, strict leap offsets); endpoints tau at T = 1 (primary) and T = 0.7 against
  `ref`, declared in mtp_jax/research/design.py. `--design --groups drafter` sizes it;
  the production arm `shared_soft` runs only when --variants names it.
- `compute`: the sized runs of d0 and d1 on configs/ablation.py's `,deep` trunk, where one
  MTP module is at most 15 % of a step's FLOPs (design.py's COMPUTE_*).

`--declare` writes the reading rules (equivalence margins, outliers, exact tests, the
global Holm correction) and the studies declared but not yet run into OUT/design.json.

Each run writes OUT/<group>/<variant>_s<seed>.json when it finishes; a run whose JSON
exists is skipped, an interrupted one resumes from its last checkpoint in WORKDIR. The
tables go to stdout and to OUT/summary.md, with their numbers in OUT/summary.json.
"""
from __future__ import annotations

import os
import sys

import mtp_jax
from mtp_jax import cli
from mtp_jax.research import studies
from mtp_jax.research.studies import DEFAULT_GROUPS, GROUPS, REPO


def parse(argv):
  p = cli.ArgumentParser(prog='mtp-ablation', description=__doc__.splitlines()[0])
  p.add_argument('--seeds', default=None,
                 help='comma-separated integer seeds to run (default 0,1,2); the tables '
                      'cover every finished run in --out, with --no_run only these seeds')
  p.add_argument('--groups', default=','.join(DEFAULT_GROUPS),
                 help=f'comma-separated, of {", ".join(GROUPS)}')
  p.add_argument('--variants', default='',
                 help='subset of variants (default: all of a group); bpe_names also takes '
                      '<variant>@<size>')
  p.add_argument('--workdir', default=os.path.join('runs', 'ablation', 'workdirs'),
                 help='checkpoints of unfinished runs')
  p.add_argument('--out', default=os.path.join('runs', 'ablation'),
                 help='GROUP.json per group (every run), summary.json and summary.md')
  p.add_argument('--no_run', action='store_true', help='only tabulate what is there')
  p.add_argument('--smoke', action='store_true', help='tiny configs, a few steps (tests)')
  p.add_argument('--data_dir', default='', help='data.data_dir of the stdlib data set')
  p.add_argument('--temperatures', default='0,1,0.7',
                 help='decode temperatures of the lm runs (0 = greedy)')
  p.add_argument('--design', action='store_true',
                 help='size the sized sweep (with --groups drafter: the drafter study): '
                      'measure step times briefly, print the design, write OUT/design.json; '
                      'trains nothing')
  p.add_argument('--declare', action='store_true',
                 help='write the reading rules (equivalence margins, outliers, exact tests, '
                      'the global Holm) and the studies declared but not run (compute, '
                      'production drafters, induction seeds) into OUT/design.json, keeping '
                      'its other keys; measures the compute study\'s step times briefly')
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
  given = args.seeds is not None
  try:
    args.seeds = [int(s) for s in (args.seeds if given else '0,1,2').split(',')]
  except ValueError:
    p.error(f'--seeds must be comma-separated integers, got {args.seeds!r}')
  if len(set(args.seeds)) != len(args.seeds) or any(s < 0 for s in args.seeds):
    p.error(f'--seeds must be distinct non-negative integers, got {args.seeds}')
  # A run of some groups or seeds leaves every other finished run in the tables.
  args.table_seeds = set(args.seeds) if args.no_run and given else None
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
  ablation, bpe = studies.ABLATION, studies.BPE_NAMES  # the config files, read now
  known = set(ablation.VARIANTS) | set(studies.INDUCTION.VARIANTS) \
      | set(ablation.SIZED_VARIANTS) | set(studies.NAMES.VARIANTS) | set(bpe.VARIANTS) \
      | set(studies.DRAFTER.ARMS) | set(studies.DRAFTER.PRODUCTION_ARMS) \
      | {f'{v}@{size}' for v in bpe.VARIANTS for size in bpe.SIZES}
  bad = [v for v in args.variants if v not in known]
  if bad:
    p.error(f'unknown variant(s) {bad}; choose from {", ".join(sorted(known))}')
  return args


def main(argv=None) -> int:
  try:
    args = parse(argv)
    from mtp_jax.research import ablation  # JAX starts here, after the flags parse
    return ablation.run(args)
  except Exception as e:  # pylint: disable=broad-except
    return cli.report_expected(e)  # one line for an expected failure; a bug keeps its traceback


if __name__ == '__main__':
  sys.exit(main())


def __getattr__(name: str):  # a name an earlier release had here: mtp_jax.MOVED_NAMES
  return mtp_jax.moved_name(__name__, name)
