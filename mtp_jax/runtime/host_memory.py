"""How this process's C allocator treats the buffers XLA:CPU frees: keep them for reuse.

XLA:CPU allocates every executable's temporaries afresh on each run (the MaxText-shape
M = 3 train step: 551 MiB per device) and frees them at its end. glibc serves blocks that
large with mmap and unmaps them on free, so each step faults every page back in, zeroed
by the kernel: 282,000 minor faults and 0.7 s of system time per 1.9 s step on the 2-core
VM of docs/benchmarks.md. With `keep` the allocator takes them
from its heap instead and keeps freed memory mapped, so the next step reuses the same
pages: after the heap has grown to its peak in the first 2-4 steps, no faults at all
(250,000-280,000 per step before); the step 0.72-0.89x the time.

  keep    mallopt: one arena (M_ARENA_MAX 1: XLA's worker threads would otherwise each
          get their own, which still map and unmap), no mmap'd blocks (M_MMAP_MAX 0) and
          no trimming of the heap's free top (M_TRIM_THRESHOLD -1). The process's
          resident memory then stays at its peak instead of shrinking between steps, and
          the peak is higher (fragmentation: max RSS 3.1-3.4 GB against ~2 GB for the
          two-device M 3 / stdlib_mtp steps).
  system  leave the allocator as it is.
  auto    keep for a CPU job: on Linux with glibc, when JAX_PLATFORMS is unset or 'cpu'
          and no GPU / TPU plugin is installed, and nobody set glibc.malloc tunables in
          GLIBC_TUNABLES already; otherwise system.

It has to run before JAX starts threads (each thread that allocated before it keeps an
arena of its own): this module imports only the standard library, and scripts/train.py
calls it right after parsing flags (--host_malloc), before it imports JAX; the training
benchmarks before their own imports (mode_from_argv).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import platform

MODES = ('auto', 'keep', 'system')

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_NO_TRIM = -1  # M_TRIM_THRESHOLD -1: never trim (mallopt(3))
_ACCELERATOR_PLUGINS = ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'jax_rocm60_plugin',
                        'jax_rocm7_plugin', 'libtpu')


def _glibc():
  """The process's glibc (ctypes), or None on another C library / OS."""
  if platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
    return None
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
  except OSError:
    return None
  return libc if hasattr(libc, 'mallopt') else None


def _cpu_job() -> bool:
  platforms = os.environ.get('JAX_PLATFORMS', '').strip().lower()
  if platforms == 'cpu':
    return True
  if platforms:
    return False
  return not any(importlib.util.find_spec(p) is not None for p in _ACCELERATOR_PLUGINS)


def resolve(mode: str) -> str:
  """'keep' or 'system' for --host_malloc `mode`; ValueError on anything else."""
  mode = str(mode).strip().lower()
  if mode not in MODES:
    raise ValueError(f'--host_malloc must be one of {", ".join(MODES)}, got {mode or "nothing"}')
  if mode != 'auto':
    return mode
  if 'glibc.malloc' in os.environ.get('GLIBC_TUNABLES', '') or not _cpu_job():
    return 'system'
  return 'keep' if _glibc() is not None else 'system'


def mode_from_argv(argv, default: str = 'auto') -> str:
  """--host_malloc's value in a command line (--host_malloc X or --host_malloc=X), for a
  script that must configure before its argument parser and its imports run."""
  for i, arg in enumerate(argv):
    if arg == '--host_malloc' and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith('--host_malloc='):
      return arg.split('=', 1)[1]
  return default


def configure(mode: str = 'auto') -> str:
  """Applies --host_malloc `mode` (see the module doc); returns what it did: 'keep' or
  'system'. 'keep' where glibc is missing is an error, not a silent no-op."""
  what = resolve(mode)
  if what == 'system':
    return what
  libc = _glibc()
  if libc is None:
    raise ValueError('--host_malloc keep needs Linux with glibc (mallopt)')
  ok = all(libc.mallopt(p, v) == 1 for p, v in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0),
                                                (_M_TRIM_THRESHOLD, _NO_TRIM)))
  if not ok:
    raise ValueError('--host_malloc keep: glibc mallopt refused a setting')
  return what
