"""Trains an MTP model: `mtp-train --config configs/stdlib_mtp.py [--workdir DIR]`.

Rerunning with the same --workdir resumes from its latest good checkpoint; SIGTERM or
Ctrl-C saves at the end of the current step and exits 0 (before the first step: one line,
exit 143 / 130, nothing kept); SIGUSR1 prints every thread's stack. Exit 2: bad input (config,
data, workdir, disk), with a one-line `error: ...`; exit 1: training stopped on a
non-finite loss.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

import mtp_jax.commands.preflight as preflight
from mtp_jax import cli
from mtp_jax.config.mesh import fixed_devices, resolved_mesh_axes
from mtp_jax.config.validation import validate
from mtp_jax.runtime import signals
from mtp_jax.train_state.init_from import InitFrom


def _cpu_devices(text: str) -> str:
  """--cpu_devices: 'auto' or a positive integer, checked before JAX starts."""
  if text.strip().lower() != 'auto' and not (text.strip().isdigit() and int(text) > 0):
    raise argparse.ArgumentTypeError(f'must be auto or a positive integer, got {text!r}')
  return text


def parser() -> cli.ArgumentParser:
  p = cli.ArgumentParser(prog='mtp-train', description=__doc__.splitlines()[0])
  p.add_argument('--config', required=True, metavar='FILE', help=cli.CONFIG_HELP)
  p.add_argument('--workdir', help='run directory (default: runs/<config file name>)')
  p.add_argument(
      '--init_from', metavar='SOURCE',
      help='a workdir or checkpoint whose trunk and shared embedding/head start this run '
      '(new MTP depths start fresh; ignored once --workdir has checkpoints of its own), or '
      'hf:DIR, a local Hugging Face directory (config.json, *.safetensors, tokenizer), '
      'which also sets config.model and the tokenizer')
  p.add_argument('--new_data', action='store_true',
                 help='resume the workdir on another data stream (data.source, path, splits, '
                 '...): model and optimizer continue, the data iterator starts afresh; '
                 'without it such a change is refused')
  # Multi-process jobs (docs/scaling.md). Not config fields: they describe one launch,
  # not the experiment.
  p.add_argument('--distributed', default='auto', choices=('auto', 'on', 'off'),
                 help='auto: join a job when a coordinator is given or a TPU pod / SLURM / '
                 'MPI launcher is detected; on: always (TPU pods); off: never')
  p.add_argument('--coordinator_address', metavar='HOST:PORT', help='address of process 0')
  p.add_argument('--num_processes', type=cli.positive_int, help='processes in the job')
  p.add_argument('--process_id', type=cli.non_negative_int,
                 help='this process, 0 .. num_processes - 1')
  p.add_argument('--distributed_init_timeout', type=int, default=300, metavar='SECONDS',
                 help='how long process 0 waits for every process to join the job')
  p.add_argument('--distributed_heartbeat_timeout', type=int, default=100, metavar='SECONDS',
                 help='a process without a heartbeat for this long counts as dead and the '
                 'job stops (raise it for long pauses, lower it to notice a lost host sooner)')
  p.add_argument('--distributed_shutdown_timeout', type=int, default=300, metavar='SECONDS',
                 help='how long a finishing process waits for the others at exit')
  p.add_argument('--cpu_devices', default='auto', type=_cpu_devices,
                 help='CPU devices of this process. auto: 2 on a single-process CPU job '
                 'whose config is valid with 2 (data parallel, both cores busy), else 1; '
                 'an explicit XLA_FLAGS device count wins')
  p.add_argument('--check_storage', action='store_true',
                 help='only check that this host can write, read back and delete a small '
                 'file in train.checkpoint_dir (and a URL train.compilation_cache_dir), '
                 'print one line and exit: 0 when it can, 2 when not (the pod launcher runs '
                 'it on every worker before starting)')
  p.add_argument('--print_config', action='store_true',
                 help='print the resolved config and the device and mesh plan, then exit '
                 'without compiling or writing anything')
  p.add_argument('--host_malloc', default='auto',
                 help='keep: the C allocator keeps the buffers XLA:CPU frees for reuse (no '
                 'page faults per step); system: leave it; auto: keep for a CPU job on '
                 'Linux/glibc')
  return p


def _fail(what: str, e: BaseException) -> int:
  print(f'error: {what}: {" ".join(str(e).split())}', file=sys.stderr)
  return 2


def _check_cpu_mesh(config) -> None:
  """A mesh this single CPU process cannot hold names the flag that sets its device
  count (the config check alone would say only how many devices there are)."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() > 1 or jax.devices()[0].platform != 'cpu':
    return
  n = jax.device_count()
  try:
    resolved_mesh_axes(config.mesh, n)
  except cli.ConfigError as e:
    fixed = fixed_devices(config.mesh)
    raise cli.ConfigError(
        f'{e} (this process has {n} CPU device{"s" if n > 1 else ""}: --cpu_devices={fixed} '
        f'gives it {fixed}, on a host with {os.cpu_count()} cores)') from e


def main(argv=None) -> int:
  # SIGTERM / SIGINT until the first step: one line, exit 143 / 130 (runtime/signals.py).
  startup = signals.install_for_process()  # scripts/train.py installed it before its imports
  signals.install_stack_dump()  # kill -USR1 <pid>: every thread's stack to stderr
  try:
    return _main(argv, startup)
  except signals.StartupInterrupted as e:
    return cli.report_expected(e)
  finally:
    startup.uninstall()


def _main(argv, startup: signals.StartupSignals) -> int:
  args, overrides = cli.parse_with_config(parser(), argv)
  try:
    config = cli.load_config(args.config, overrides)
  except cli.ConfigError as e:
    return cli.report_expected(e)
  workdir = args.workdir or os.path.join(
      'runs', os.path.splitext(os.path.basename(args.config))[0])
  init_from = InitFrom.parse(args.init_from)  # standard library only
  try:  # a bad value or a mistyped path is answered before JAX starts
    if not (init_from and init_from.facts.sets_model):  # else checked once config.json is read
      validate(config)  # all but the device count
    preflight.train_paths(config, workdir, init_from)
  except (cli.ConfigError, cli.RequestError) as e:
    return cli.report_expected(e)
  if args.check_storage:
    import mtp_jax.commands.storage_check as storage_check  # pylint: disable=g-import-not-at-top
    return storage_check.check(config, workdir)
  startup.check()
  # Standard library only: the allocator is set before JAX starts its first thread.
  from mtp_jax.runtime import host_memory  # pylint: disable=g-import-not-at-top
  try:
    host_memory.configure(args.host_malloc)
  except ValueError as e:
    return _fail('bad flag', e)
  # Standard library only: libtpu reads its flags when the TPU backend starts.
  from mtp_jax.runtime import tpu_flags  # pylint: disable=g-import-not-at-top
  tpu_flags.apply()
  cli.quiet_library_logs()
  # JAX starts here, after the flags are known to be good.
  from mtp_jax.runtime import distributed  # pylint: disable=g-import-not-at-top
  from mtp_jax.train import loop, plan  # pylint: disable=g-import-not-at-top
  try:
    cpu_devices = distributed.resolve_cpu_devices(
        args.cpu_devices, config, args.distributed, args.coordinator_address,
        args.num_processes)
  except ValueError as e:
    return _fail('bad flag', e)
  startup.check()
  timeouts = {'initialization_timeout': args.distributed_init_timeout,
              'heartbeat_timeout_seconds': args.distributed_heartbeat_timeout,
              'shutdown_timeout_seconds': args.distributed_shutdown_timeout}
  try:
    joined = distributed.initialize(args.distributed, args.coordinator_address,
                                    args.num_processes, args.process_id, cpu_devices, timeouts)
  except ValueError as e:
    return _fail('bad flag', e)
  if joined:
    startup.release(signal.SIGTERM)  # JAX's preemption service owns it in a multi-process job
  startup.check()
  try:
    _check_cpu_mesh(config)
    if args.print_config:
      print(plan.describe(config, workdir, init_from))
      return 0
    loop.train_and_evaluate(config, workdir, init_from=init_from,
                             new_data=args.new_data)
  except Exception as e:  # pylint: disable=broad-except
    return cli.report_expected(e)
  return 0


if __name__ == '__main__':
  sys.exit(main())
