"""Writes PNG figures of a run or of a sweep.

  python scripts/plot.py --workdir DIR [--out DIR]     # one run's metrics.jsonl
  python scripts/plot.py --sweep benchmarks/research   # scripts/ablation.py's per-run JSON:
      loss_vs_flops.png, acceptance_per_depth.png, induction.png (into --out, default the
      sweep folder)
"""
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp_jax.research import plotting  # noqa: E402

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory holding metrics.jsonl.')
_SWEEP = flags.DEFINE_string('sweep', None,
                             'Output folder of scripts/ablation.py (lm/*.json, induction/*.json).')
_OUT = flags.DEFINE_string('out', None, 'Where to write the PNGs (default: WORKDIR/plots, or '
                           'the sweep folder).')


def main(argv):
  del argv
  if (_WORKDIR.value is None) == (_SWEEP.value is None):
    print('error: give exactly one of --workdir (a run) or --sweep (scripts/ablation.py output)',
          file=sys.stderr)
    sys.exit(2)
  try:
    if _SWEEP.value is not None:
      paths = plotting.plot_sweep(_SWEEP.value, _OUT.value)
    else:
      paths = plotting.plot_run(_WORKDIR.value, _OUT.value)
  except FileNotFoundError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  for p in paths:
    print(p)
  if _WORKDIR.value is not None and not any('acceptance' in p for p in paths):
    print('(no decode acceptance in metrics.jsonl yet: run scripts/eval.py or enable '
          'periodic decode eval to get acceptance.png)')


if __name__ == '__main__':
  app.run(main)
