"""Trains an MTP model: `python scripts/train.py --config configs/stdlib_mtp.py [--workdir DIR]`.

Intentionally thin: parse flags, validate, call mtp_jax.train.train_and_evaluate.
Rerunning with the same --workdir resumes from its latest checkpoint.
"""
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp_jax import config_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file (get_config()).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory (default: runs/<config name>).')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax and grain log every save at INFO
  config = _CONFIG.value
  workdir = _WORKDIR.value or os.path.join(
      'runs', os.path.splitext(os.path.basename(flags.FLAGS['config'].config_filename))[0])
  from mtp_jax import train  # after flag parsing: JAX starts here
  try:
    train.train_and_evaluate(config, workdir)
  except config_lib.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main)
