"""What machine this is, in words a result file can record (standard library only, so a
benchmark can ask before JAX starts)."""
from __future__ import annotations

import os
import platform


def cpu_model() -> str:
  """The CPU's model name ('AMD EPYC 9R14'), or what platform knows of it."""
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
  """The vector extensions that decide XLA:CPU's kernels (AVX2, AVX-512, AMX)."""
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('flags'):
          have = set(line.split(':', 1)[1].split())
          return sorted(x for x in have if x.startswith(('avx512', 'avx2', 'amx')))
  except OSError:
    pass
  return []


def usable_cores() -> int:
  """The cores this process may run on (its affinity mask), else the machine's count."""
  return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 1)
