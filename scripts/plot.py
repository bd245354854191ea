"""Writes PNG figures of a run: `python scripts/plot.py --workdir DIR [--out DIR]`."""
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp_jax import plotting  # noqa: E402

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory holding metrics.jsonl.')
_OUT = flags.DEFINE_string('out', None, 'Where to write the PNGs (default: WORKDIR/plots).')


def main(argv):
  del argv
  try:
    paths = plotting.plot_run(_WORKDIR.value, _OUT.value)
  except FileNotFoundError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  for p in paths:
    print(p)
  if not any('acceptance' in p for p in paths):
    print('(no decode acceptance in metrics.jsonl yet: run scripts/eval.py or enable '
          'periodic decode eval to get acceptance.png)')


if __name__ == '__main__':
  flags.mark_flags_as_required(['workdir'])
  app.run(main)
