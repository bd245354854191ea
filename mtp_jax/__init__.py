"""mtp_jax: multi-token prediction pretraining and self-speculative decoding in JAX.

The sub-packages, lowest first: runtime and data; model and checkpoint (neither imports the
other); train_state (the optimizer, building on the mesh, restoring); interop and decode;
train; research; the commands. Each `__init__` names its public objects
(`from mtp_jax.model import MTPModel, ModelArgs`, `from mtp_jax.decode import Decoder`).
The module names of the earlier flat layout (`mtp_jax.loss`, `mtp_jax.state`, ...) and the
names that moved since (`mtp_jax.model.state`, `mtp_jax.checkpoint.partial.InitFrom`, ...)
still import, with a DeprecationWarning that names the new place.
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
# Modules of the sub-package layout's first release that moved again.
MOVED_SUBMODULES = {
    'model.state': 'mtp_jax.train_state',
}
# Flat modules split over several new ones: importing them is an error naming each part.
SPLIT = {
    'convert': 'mtp_jax.convert was split: from_hf (tensors in memory) is now '
               'mtp_jax.interop.params_from_hf, to_hf mtp_jax.interop.to_hf_tensors; '
               'load_dir, export_model, export_workdir and model_params are in mtp_jax.interop, '
               'the FP8 block scales in mtp_jax.interop.fp8, the tensor tables in '
               'mtp_jax.interop.layouts, config_from_hf is mtp_jax.interop.hf_config.to_config',
}


SPLIT['interop.convert'] = SPLIT['convert'].replace('mtp_jax.convert', 'mtp_jax.interop.convert')

# Public names of a module that moved to another module: 'old_module.name' -> 'new_module.name'
# (the old one still works, with a DeprecationWarning), or -> a sentence saying what took the
# place of a name that is gone (an ImportError). The old module's __getattr__ asks
# moved_name; tests/test_public_api.py holds every earlier public name to this table.
_TABLES = 'mtp_jax.research.tables'
MOVED_NAMES = {
    'mtp_jax.decode.decoder.DecodeState': 'mtp_jax.decode.program.DecodeState',
    'mtp_jax.checkpoint.partial.InitFrom': 'mtp_jax.train_state.InitFrom',
    'mtp_jax.checkpoint.partial.HF_PREFIX': 'mtp_jax.train_state.HF_PREFIX',
    'mtp_jax.commands.preflight.HF_PREFIX': 'mtp_jax.train_state.HF_PREFIX',
    'mtp_jax.train.resilience.StartupInterrupted': 'mtp_jax.runtime.signals.StartupInterrupted',
    'mtp_jax.train.resilience.StartupSignals': 'mtp_jax.runtime.signals.StartupSignals',
    **{f'mtp_jax.commands.ablation.{n}': f'{_TABLES}.{n}' for n in (
        'BUDGETS', 'SIZED_BUDGETS', 'TEMPS', 'TEMP_NAMES', 'induction_metrics', 'lm_metrics',
        'tabulate', 'tabulate_names', 'tabulate_sized')},
    **{f'mtp_jax.commands.ablation.{n}': f'mtp_jax.research.{m}.{n}' for n, m in (
        ('ABLATION', 'studies'), ('CONFIGS', 'studies'), ('INDUCTION', 'studies'),
        ('NAMES', 'studies'), ('load_config_module', 'studies'), ('aggregate', 'families'),
        ('eval_se_of_difference', 'families'), ('paired_test', 'families'),
        ('ind_alphabet', 'markdown'), ('markdown', 'markdown'), ('markdown_names', 'markdown'),
        ('markdown_sized', 'markdown'))},
    'mtp_jax.interop.hf_config.read_config': 'mtp_jax.interop.hf.read_config',
    **{f'mtp_jax.model.mtp.{n}': f'mtp_jax.model.{m}.{n}' for n, m in (
        ('SharedHead', 'heads'), ('SequentialMTP', 'heads'), ('ParallelHead', 'heads'),
        ('config_path', 'args'), ('remat_policy', 'blocks'))},
    'mtp_jax.train.loss.cross_entropy_autodiff': 'mtp_jax.train.head_sums.cross_entropy_autodiff',
    **{f'mtp_jax.commands.ablation.{n}': f'mtp_jax.research.ablation.{n}' for n in (
        'design_path', 'group_variants', 'make_design', 'make_runs', 'make_sweep',
        'names_estimate', 'sized_runs', 'sized_steps')},
    # helpers that left the checkpoint package's public names (still in their modules)
    **{f'mtp_jax.checkpoint.{n}': f'mtp_jax.checkpoint.{m}.{n}' for n, m in (
        ('is_url', 'store'), ('location', 'store'), ('short', 'store'), ('warn', 'reader'))},
}
# Names of the flat layout that moved and changed meaning: old -> (new, what changed).
FLAT_NAMES = {
    'mtp_jax.model.resolve_vocab_size': (
        'mtp_jax.data.model_vocab_size',
        'mtp_jax.data.resolve_vocab_size now sets config.model.vocab_size and returns the '
        'config'),
}
REMOVED_NAMES = {
    'mtp_jax.decode.sampling.BITWISE_THRESHOLDS':
        'the module switch is gone: Decoder(model, bitwise_thresholds=False) compiles the '
        'earlier top-k / top-p thresholds',
    'mtp_jax.model.decode_ops.ATTN_TALL':
        'the module switch is gone: Decoder(model, tall_attention=False) compiles the earlier '
        'few-query attention products',
    'mtp_jax.interop.hf.source_dir':
        "InitFrom.parse(value) (mtp_jax.train_state) gives the directory: its path when its "
        "kind is 'hf'",
    'mtp_jax.train.flops.block_flops':
        'each attention and MLP kind counts its own FLOPs now (flops_per_token of the classes '
        'in mtp_jax.model.ATTENTION_KINDS and MLP_KINDS); mtp_jax.train.flops_per_token(config) '
        'counts a whole model',
}


def moved_name(module: str, name: str):
  """For a module's `__getattr__`: the object `name` of `module` became, after a
  DeprecationWarning naming its new place; ImportError saying what replaced a removed one;
  AttributeError for any other name."""
  old = f'{module}.{name}'
  if old in REMOVED_NAMES:
    raise ImportError(f'{old} was removed: {REMOVED_NAMES[old]}', name=module)
  if old in FLAT_NAMES:
    new, note = FLAT_NAMES[old]
  elif old in MOVED_NAMES:
    new, note = MOVED_NAMES[old], 'import it from there'
  else:
    raise AttributeError(f'module {module!r} has no attribute {name!r}')
  _warnings.warn(f'{old} moved to {new}; {note}', DeprecationWarning, stacklevel=3)
  new_module, _, new_name = new.rpartition('.')
  return getattr(_importlib.import_module(new_module), new_name)


def _moved(name: str, stacklevel: int, register: bool = True):
  """The module that replaced mtp_jax.<name>, after one DeprecationWarning at the caller.
  register: enter it in sys.modules under the old name (the import system does that itself
  for a finder's module; one entered while it looks would make it load the new module again)."""
  old = f'mtp_jax.{name}'
  if name in SPLIT:
    raise ImportError(SPLIT[name], name=old)
  new = MOVED.get(name) or MOVED_SUBMODULES[name]
  _warnings.warn(f'{old} moved to {new}; import it from there', DeprecationWarning,
                 stacklevel=stacklevel + 1)
  module = _importlib.import_module(new)
  if register:
    _sys.modules[old] = module
  if name in MOVED:
    globals()[name] = module
  return module


def __getattr__(name: str):
  if name in MOVED or name in SPLIT:
    return _moved(name, 2)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


class _Alias(_importlib_abc.Loader):
  """Loads an old module name as the module that replaced it (the same object)."""

  def __init__(self, module):
    self.module, self.spec = module, module.__spec__

  def create_module(self, spec):
    return self.module

  def exec_module(self, module):
    module.__spec__ = self.spec  # the import system gave it the old name's spec: its own back


class _MovedFinder(_importlib_abc.MetaPathFinder):
  """`import mtp_jax.loss` and friends: the new module, with the warning."""

  def find_spec(self, fullname, path, target=None):
    prefix = __name__ + '.'
    name = fullname[len(prefix):] if fullname.startswith(prefix) else ''
    if name not in MOVED and name not in MOVED_SUBMODULES and name not in SPLIT:
      return None
    return _importlib_util.spec_from_loader(fullname, _Alias(_moved(name, 2, register=False)))


if not any(isinstance(f, _MovedFinder) for f in _sys.meta_path):
  _sys.meta_path.append(_MovedFinder())
