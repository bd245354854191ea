"""Trains an MTP model: `python scripts/train.py --config configs/stdlib_mtp.py [--workdir DIR]`.

Intentionally thin: parse flags, call mtp_jax.train.loop.train_and_evaluate.
Rerunning with the same --workdir resumes from its latest good checkpoint; SIGTERM or
Ctrl-C saves at the end of the current step and exits 0. Exit 2: bad input (config,
data, workdir, disk), with a one-line `error: ...`; exit 1: training stopped on a
non-finite loss.
"""
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file (get_config()).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory (default: runs/<config name>).')
_INIT_FROM = flags.DEFINE_string(
    'init_from', None, 'A workdir or checkpoint whose trunk and shared embedding/head start '
    'this run; new MTP depths are freshly initialised (ignored once --workdir has checkpoints). '
    'hf:DIR: a local Hugging Face Llama / Mistral / Qwen2 directory (config.json, '
    '*.safetensors, tokenizer.json), which also sets config.model and the tokenizer.')

# Multi-process jobs (mtp_jax/runtime/distributed.py; README "Scaling out"). Not config fields:
# they describe one launch, not the experiment.
_DISTRIBUTED = flags.DEFINE_enum('distributed', 'auto', ['auto', 'on', 'off'],
                                 'auto: join a job when a coordinator is given or a TPU pod / '
                                 'SLURM / MPI launcher is detected; on: always (TPU pods); off: never.')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'host:port of process 0.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in the job.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process, 0 .. num_processes - 1.')
_CPU_DEVICES = flags.DEFINE_string(
    'cpu_devices', 'auto', 'CPU devices of this process (CPU jobs, tests). auto: 2 on a '
    'single-process CPU job whose config is valid with 2 (data parallel: both cores busy, '
    'distributed.AUTO_CPU_DEVICES), else one; an explicit XLA_FLAGS device count wins.')

_HOST_MALLOC = flags.DEFINE_string(
    'host_malloc', 'auto', 'keep: the C allocator keeps the buffers XLA:CPU frees for reuse '
    '(no page faults per step; mtp_jax/runtime/host_memory.py); system: leave it; auto: keep for a '
    'CPU job on Linux/glibc.')


def _fail(what: str, e: BaseException):
  text = ' '.join(str(e).replace('\\n', '. ').replace("\\'", '').split()).strip('\'"')
  print(f'error: {what}: {text}', file=sys.stderr)
  sys.exit(2)


def _parse_flags(argv):
  """absl's parser, but a bad flag or config file is exit 2 with one line, not a traceback."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail('bad flag', e)
  except AttributeError as e:  # ml_collections: an unknown --config.x key
    _fail('unknown config field in a --config.* override', e)
  except Exception as e:  # pylint: disable=broad-except
    _fail(f'bad --config file or override ({type(e).__name__})', e)


def main(argv):
  if len(argv) > 1:
    print(f'error: unexpected arguments {argv[1:]}', file=sys.stderr)
    sys.exit(2)
  if not flags.FLAGS['config'].present:
    print('error: --config is required (e.g. --config configs/tiny.py)', file=sys.stderr)
    sys.exit(2)
  try:
    config = _CONFIG.value
    config.keys()  # a config file that failed to load raises only when used
  except Exception as e:  # pylint: disable=broad-except
    _fail('cannot load --config', e)
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax and grain log every save at INFO
  workdir = _WORKDIR.value or os.path.join(
      'runs', os.path.splitext(os.path.basename(flags.FLAGS['config'].config_filename))[0])
  from mtp_jax.runtime import host_memory  # standard library only: before JAX and its first thread
  try:
    host_memory.configure(_HOST_MALLOC.value)
  except ValueError as e:
    _fail('bad flag', e)
  from mtp_jax import cli  # after flag parsing: JAX starts here
  from mtp_jax.runtime import distributed
  from mtp_jax.train import loop as train
  try:
    cpu_devices = distributed.resolve_cpu_devices(
        _CPU_DEVICES.value, config, _DISTRIBUTED.value, _COORDINATOR.value, _NUM_PROCESSES.value)
  except ValueError as e:
    _fail('bad flag', e)
  distributed.initialize(_DISTRIBUTED.value, _COORDINATOR.value, _NUM_PROCESSES.value,
                         _PROCESS_ID.value, cpu_devices)
  try:
    train.train_and_evaluate(config, workdir, init_from=_INIT_FROM.value)
  except Exception as e:  # pylint: disable=broad-except
    code = cli.exit_code_of(e)
    if code is None:
      raise
    print(f'error: {cli.one_line(e)}', file=sys.stderr)
    sys.exit(code)


if __name__ == '__main__':
  app.run(main, flags_parser=_parse_flags)
