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
# Multi-process jobs (mtp_jax/distributed.py; README "Scaling out"). Not config fields:
# they describe one launch, not the experiment.
_DISTRIBUTED = flags.DEFINE_enum('distributed', 'auto', ['auto', 'on', 'off'],
                                 'auto: join a job when a coordinator is given or a TPU pod / '
                                 'SLURM / MPI launcher is detected; on: always (TPU pods); off: never.')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'host:port of process 0.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in the job.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, 0 .. num_processes - 1.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', None, 'CPU devices of this process (CPU jobs, tests).')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax and grain log every save at INFO
  config = _CONFIG.value
  workdir = _WORKDIR.value or os.path.join(
      'runs', os.path.splitext(os.path.basename(flags.FLAGS['config'].config_filename))[0])
  from mtp_jax import distributed, train  # after flag parsing: JAX starts here
  distributed.initialize(_DISTRIBUTED.value, _COORDINATOR.value, _NUM_PROCESSES.value,
                         _PROCESS_ID.value, _CPU_DEVICES.value)
  try:
    train.train_and_evaluate(config, workdir)
  except config_lib.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config'])
  app.run(main)
