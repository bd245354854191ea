"""mtp_jax: multi-token prediction pretraining and self-speculative decoding in JAX."""
import glob as _glob
import os as _os
import sys as _sys

__version__ = '0.1.0'

_GOOGLE_PCI_VENDOR = '0x1ae0'  # TPU chips are PCI devices of Google's vendor id


def _only_cpu_here() -> bool:
  """No TPU chip (Google PCI device), NVIDIA GPU or AMD GPU on this machine."""
  for vendor in _glob.glob('/sys/bus/pci/devices/*/vendor'):
    try:
      with open(vendor) as f:
        if f.read().strip() == _GOOGLE_PCI_VENDOR:
          return False
    except OSError:
      continue
  return not (_glob.glob('/dev/nvidia[0-9]*') or _os.path.exists('/dev/kfd'))


def _quiet_absent_tpu() -> None:
  """JAX_PLATFORMS=cpu on a machine with nothing but CPUs, unless the user chose platforms.

  With libtpu installed (the [tpu] or [test] extra), JAX otherwise starts the TPU backend on
  any machine, and libtpu prints a block of 'could not determine TPU accelerator type'
  errors before falling back to the CPU. A TPU VM has Google PCI devices and is left alone,
  so a real TPU's start-up errors still show.
  """
  if 'jax' in _sys.modules or _os.environ.get('JAX_PLATFORMS') or \
      'JAX_FORCE_TPU_INIT' in _os.environ:
    return
  if _only_cpu_here():
    _os.environ['JAX_PLATFORMS'] = 'cpu'


_quiet_absent_tpu()
