"""Writes PNG figures of a run or of a sweep.

  mtp-plot --workdir DIR [--out DIR]     # one run's metrics.jsonl
  mtp-plot --workdir A B ... [--out DIR] # several runs' losses in one figure, compare_runs.png
  mtp-plot --sweep DIR [--out DIR]       # mtp-ablation's GROUP.json files: per group
                                         # present, sized_loss_vs_flops.png,
                                         # sized_acceptance_per_depth.png, names.png
                                         # (lm: loss_vs_flops.png, acceptance_per_depth.png;
                                         # induction: induction.png)

Reads only: the figures go to --out (default: WORKDIR/plots, or the sweep folder).
"""
from __future__ import annotations

import sys

from mtp_jax import cli


def parser() -> cli.ArgumentParser:
  p = cli.ArgumentParser(prog='mtp-plot', description=__doc__.splitlines()[0])
  p.add_argument('--workdir', nargs='+', metavar='DIR',
                 help='run directory holding metrics.jsonl; several: their losses overlaid')
  p.add_argument('--sweep', help='output folder of mtp-ablation (its GROUP.json files)')
  p.add_argument('--out', help='where to write the PNGs (default: WORKDIR/plots, the first '
                 'WORKDIR\'s with several, or the sweep folder)')
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  if (args.workdir is None) == (args.sweep is None):
    print('error: give exactly one of --workdir (a run) or --sweep (mtp-ablation output)',
          file=sys.stderr)
    return 2
  from mtp_jax.research import plotting  # pylint: disable=g-import-not-at-top
  try:
    if args.sweep is not None:
      paths = plotting.plot_sweep(args.sweep, args.out)
    elif len(args.workdir) > 1:
      paths = plotting.plot_runs(args.workdir, args.out)
    else:
      paths = plotting.plot_run(args.workdir[0], args.out)
  except FileNotFoundError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  for p in paths:
    print(p)
  if args.workdir is not None and len(args.workdir) == 1 and not any(
      'acceptance' in p for p in paths):
    print('(no acceptance.png: metrics.jsonl has no eval/decode_* figures. The trainer\'s '
          'evaluations write them when train.eval_decode_prompts is above 0 (e.g. '
          '--config.train.eval_decode_prompts=4); mtp-eval prints the same figures but never '
          'writes metrics.jsonl)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
