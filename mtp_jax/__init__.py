"""mtp_jax: multi-token prediction pretraining and self-speculative decoding in JAX.

The sub-packages, lowest first: runtime and data; model and checkpoint (neither imports the
other); train_state (the optimizer, building on the mesh, restoring); interop and decode;
train; research; the commands. Each `__init__` names its public objects
(`from mtp_jax.model import MTPModel, ModelArgs`, `from mtp_jax.decode import Decoder`).
The module names of the earlier flat layout (`mtp_jax.loss`, `mtp_jax.state`, ...) still
import, with a DeprecationWarning that names the new place.
"""
import glob as _glob
import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import os as _os
import sys as _sys
import warnings as _warnings

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


# -- the flat layout's module names ------------------------------------------------------
MOVED = {
    'distill': 'mtp_jax.research.distill',
    'distributed': 'mtp_jax.runtime.distributed',
    'evaluation': 'mtp_jax.train.evaluation',
    'flops': 'mtp_jax.train.flops',
    'generate': 'mtp_jax.decode.generate',
    'hf': 'mtp_jax.interop.hf',
    'host_memory': 'mtp_jax.runtime.host_memory',
    'layers': 'mtp_jax.model.layers',
    'loss': 'mtp_jax.train.loss',
    'metrics': 'mtp_jax.train.metrics',
    'mla': 'mtp_jax.model.mla',
    'moe': 'mtp_jax.model.moe',
    'plotting': 'mtp_jax.research.plotting',
    'resilience': 'mtp_jax.train.resilience',
    'sampling': 'mtp_jax.decode.sampling',
    'sharding': 'mtp_jax.runtime.sharding',
    'state': 'mtp_jax.train_state',
    'steps': 'mtp_jax.train.steps',
}
# Flat modules split over several new ones: importing them is an error naming each part.
SPLIT = {
    'convert': 'mtp_jax.convert was split: from_hf (tensors in memory) is now '
               'mtp_jax.interop.params_from_hf, to_hf mtp_jax.interop.to_hf_tensors; '
               'load_dir, export_model, export_workdir and model_params are in mtp_jax.interop, '
               'the FP8 block scales in mtp_jax.interop.fp8, the tensor tables in '
               'mtp_jax.interop.layouts, config_from_hf is mtp_jax.interop.hf_config.to_config',
}


def _moved(name: str, stacklevel: int):
  """The module that replaced mtp_jax.<name>, after one DeprecationWarning at the caller."""
  old = f'mtp_jax.{name}'
  if name in SPLIT:
    raise ImportError(SPLIT[name], name=old)
  new = MOVED[name]
  _warnings.warn(f'{old} moved to {new}; import it from there', DeprecationWarning,
                 stacklevel=stacklevel + 1)
  module = _importlib.import_module(new)
  _sys.modules[old] = module
  globals()[name] = module
  return module


def __getattr__(name: str):
  if name in MOVED or name in SPLIT:
    return _moved(name, 2)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


class _Alias(_importlib_abc.Loader):
  """Loads an old module name as the module that replaced it (the same object)."""

  def __init__(self, module):
    self.module = module

  def create_module(self, spec):
    return self.module

  def exec_module(self, module):
    pass


class _MovedFinder(_importlib_abc.MetaPathFinder):
  """`import mtp_jax.loss` and friends: the new module, with the warning."""

  def find_spec(self, fullname, path, target=None):
    package, _, name = fullname.rpartition('.')
    if package != __name__ or (name not in MOVED and name not in SPLIT):
      return None
    return _importlib_util.spec_from_loader(fullname, _Alias(_moved(name, 2)))


if not any(isinstance(f, _MovedFinder) for f in _sys.meta_path):
  _sys.meta_path.append(_MovedFinder())
