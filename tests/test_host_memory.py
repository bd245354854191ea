"""--host_malloc (mtp_jax/runtime/host_memory.py): which mode auto picks, and that keep really stops
the page faults of re-allocating a large freed buffer."""
import json
import os
import subprocess
import sys

import pytest

from mtp_jax.runtime import host_memory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A child process (the setting is process-wide and must come first): malloc, write and free
# a 64 MiB block 20 times, count the minor page faults of the last 10.
CHILD = r'''
import ctypes, ctypes.util, json, resource, sys
from mtp_jax.runtime import host_memory
mode = host_memory.configure(sys.argv[1])
libc = ctypes.CDLL(ctypes.util.find_library('c'))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def touch():  # what XLA:CPU does with a step's temporaries: malloc, write, free
  p = libc.malloc(64 << 20)
  ctypes.memset(p, 1, 64 << 20)
  libc.free(p)
for _ in range(10):
  touch()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
  touch()
print(json.dumps({'mode': mode, 'faults': resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0}))
'''


def _faults(mode):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu')
  env.pop('GLIBC_TUNABLES', None)
  p = subprocess.run([sys.executable, '-c', CHILD, mode], capture_output=True, text=True,
                     env=env, timeout=120, check=True)
  return json.loads(p.stdout.strip().splitlines()[-1])


def test_auto_rule_and_bad_mode(monkeypatch):
  for bad in ('', 'on', 'tcmalloc'):
    with pytest.raises(ValueError, match='--host_malloc must be one of auto, keep, system'):
      host_memory.resolve(bad)
  assert host_memory.resolve('system') == 'system'
  assert host_memory.resolve('KEEP') == 'keep'
  monkeypatch.delenv('GLIBC_TUNABLES', raising=False)
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  want = 'keep' if host_memory._glibc() is not None else 'system'  # pylint: disable=protected-access
  assert host_memory.resolve('auto') == want
  monkeypatch.setenv('JAX_PLATFORMS', 'cuda')  # an accelerator job: leave the allocator alone
  assert host_memory.resolve('auto') == 'system'
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu')
  monkeypatch.setenv('GLIBC_TUNABLES', 'glibc.malloc.mmap_max=0')  # the user chose already
  assert host_memory.resolve('auto') == 'system'


@pytest.mark.skipif(host_memory._glibc() is None, reason='glibc mallopt only')  # pylint: disable=protected-access
def test_keep_reuses_freed_large_buffers():
  """system: each 64 MiB buffer is mmap'd afresh and faulted in (16,384 pages); keep: the
  freed pages are reused, (almost) no faults."""
  system, keep = _faults('system'), _faults('keep')
  assert (system['mode'], keep['mode']) == ('system', 'keep')
  assert system['faults'] > 10 * 16384 * 0.9, system
  assert keep['faults'] < 1000, keep
