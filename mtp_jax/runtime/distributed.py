"""Joining a multi-process (multi-host) JAX job before anything touches a device.

One process per host (TPU VM worker, GPU node) runs the same `scripts/train.py`. Each
reads its own shard of the data (`pipeline.make_train_iter(..., process_index,
process_count)`); `jax.make_array_from_process_local_data` assembles the global batch;
only process 0 writes metrics; orbax checkpoints are written and restored by all
processes together. Where the coordinator comes from:

  explicit   --coordinator_address / --num_processes / --process_id (or the environment
             variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)
  automatic  Cloud TPU pod slices, SLURM and Open MPI jobs: JAX finds the coordinator
             itself (`jax.distributed.initialize()` with no arguments)
"""
from __future__ import annotations

import os

import jax

import mtp_jax.runtime.machine as machine
from mtp_jax.config.validation import validate

MODES = ('auto', 'on', 'off')

# --cpu_devices auto: a single-process CPU job trains on this many CPU devices (data
# parallel) when its config is valid with them. XLA:CPU then runs the two halves of the
# batch as two streams of thunks, which keeps both cores busy through the small ops
# between the GEMMs (the MaxText-shape step, remat block: 0.88-0.96x the time
# of one device on a 2-core host; configs/stdlib_mtp.py, remat none, level). Only 2 was
# measured (4 devices on 2 cores: slower than 2).
AUTO_CPU_DEVICES = 2
_DEVICE_COUNT_FLAG = 'xla_force_host_platform_device_count'


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  return int(value) if value not in (None, '') else None


def managed_cluster() -> str | None:
  """The name of a multi-process launcher JAX detects by itself, if this is one."""
  hosts = os.environ.get('TPU_WORKER_HOSTNAMES') or os.environ.get('TPU_PROCESS_ADDRESSES')
  if hosts and ',' in hosts:
    return 'cloud_tpu'
  if (_env_int('SLURM_STEP_NUM_TASKS') or _env_int('SLURM_NTASKS') or 1) > 1:
    return 'slurm'
  if (_env_int('OMPI_COMM_WORLD_SIZE') or 1) > 1:
    return 'ompi'
  return None


def resolve_cpu_devices(value, config=None, mode: str = 'auto',
                        coordinator_address: str | None = None,
                        num_processes: int | None = None) -> int | None:
  """The CPU device count to give JAX for --cpu_devices `value` (None: leave JAX's own).

  An integer (or its string) is taken as is. 'auto' (the trainer's default) gives
  AUTO_CPU_DEVICES when this is a single-process job on a CPU host with that many cores,
  nobody fixed the count already (XLA_FLAGS' --xla_force_host_platform_device_count,
  jax_num_cpu_devices), and `config` validates with that many devices (batch divisible
  by data x fsdp, ...); otherwise None. Runs before JAX starts a backend.
  """
  if value is None:
    return None
  if isinstance(value, int) or str(value).strip().lstrip('-').isdigit():
    n = int(value)
    if n < 1:
      raise ValueError(f'--cpu_devices must be a positive integer or auto, got {value}')
    return n
  if str(value).strip().lower() != 'auto':
    raise ValueError(f'--cpu_devices must be a positive integer or auto, got {value}')
  platforms = os.environ.get('JAX_PLATFORMS', '').strip().lower()
  if (platforms not in ('', 'cpu') or mode == 'on' or managed_cluster()
      or coordinator_address or os.environ.get('JAX_COORDINATOR_ADDRESS')
      or (num_processes or _env_int('JAX_NUM_PROCESSES') or 1) > 1
      or _DEVICE_COUNT_FLAG in os.environ.get('XLA_FLAGS', '')
      or jax.config.jax_num_cpu_devices not in (-1, None)
      or machine.usable_cores() < AUTO_CPU_DEVICES):
    return None
  if config is not None:
    try:
      validate(config, AUTO_CPU_DEVICES)
    except Exception:  # pylint: disable=broad-except
      return None  # e.g. an odd batch: one device, as JAX would give
  return AUTO_CPU_DEVICES


# jax.distributed.initialize's own defaults (seconds): how long to wait for every process
# to join, after how long without a heartbeat a process counts as dead, and how long a
# finishing process waits for the others.
TIMEOUTS = {'initialization_timeout': 300, 'heartbeat_timeout_seconds': 100,
            'shutdown_timeout_seconds': 300}


def initialize(mode: str = 'auto', coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               cpu_devices: int | None = None, timeouts: dict | None = None) -> bool:
  """Joins the job's other processes if there are any; True when it did.

  mode: 'auto' joins when a coordinator is given or a managed cluster is detected,
  'on' always calls jax.distributed.initialize (auto-detection, e.g. TPU pods),
  'off' never does. cpu_devices: local CPU devices of this process (tests, CPU jobs).
  timeouts: some of TIMEOUTS' keys, in seconds (the rest keep JAX's defaults).
  Must run before the first JAX computation.
  """
  timeouts = {**TIMEOUTS, **(timeouts or {})}
  if any(int(v) < 1 for v in timeouts.values()):
    raise ValueError(f'distributed timeouts must be positive seconds, got {timeouts}')
  if mode not in MODES:
    raise ValueError(f'distributed mode must be one of {MODES}, got {mode!r}')
  if cpu_devices:  # an int: resolve_cpu_devices turns --cpu_devices auto into one (or None)
    jax.config.update('jax_num_cpu_devices', int(cpu_devices))
  if mode == 'off':
    return False
  coordinator_address = coordinator_address or os.environ.get('JAX_COORDINATOR_ADDRESS') or None
  num_processes = num_processes or _env_int('JAX_NUM_PROCESSES')
  process_id = process_id if process_id is not None else _env_int('JAX_PROCESS_ID')
  if coordinator_address or (num_processes or 1) > 1:
    missing = [name for name, v in [('coordinator_address', coordinator_address),
                                    ('num_processes', num_processes),
                                    ('process_id', process_id)] if v is None]
    if missing and not managed_cluster():
      raise ValueError(f'a multi-process job needs {", ".join(missing)} '
                       '(flags, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID)')
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **timeouts)
    return True
  if mode == 'on' or managed_cluster():
    jax.distributed.initialize(**timeouts)
    return True
  return False


def describe() -> str:
  """One line about this process's place in the job (for the console)."""
  return (f'process {jax.process_index()} of {jax.process_count()}: '
          f'{jax.local_device_count()} local / {jax.device_count()} global '
          f'{jax.devices()[0].platform} devices')
