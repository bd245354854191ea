"""JAX's persistent compilation cache, on for every training run (train.compilation_cache_dir).

A restart of the same config (a preempted job rerun, a resumed run) then loads its compiled
programs from the cache instead of compiling them again. The key covers the program, the
devices and the JAX / XLA versions, so a changed config or an upgrade simply misses; the
schedule's settings (train.steps, warmup_steps, lr, min_lr_ratio) are inputs of the train
step rather than constants in it, so changing them hits.

The key also covers XLA's compile options, and by default JAX writes the cache's own path
into them (the GPU per-fusion autotuning cache it keeps under the cache directory), so a
cache moved, copied or pre-warmed elsewhere would never hit. `enable` turns that extra cache
off: the key then holds no path, and a copied cache hits. What a GPU loses is the
autotuning results of programs that miss; a program that hits carries its own.
"""
from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from mtp_jax import storage

# train.compilation_cache_dir's default; $JAX_COMPILATION_CACHE_DIR, when set, replaces it.
DEFAULT_DIR = '~/.cache/mtp_jax/jax_cache'


def is_url(path: str) -> bool:
  return '://' in path


def enable(directory: str, notify=None) -> str | None:
  """Points JAX's cache at `directory` (a local path, ~ expanded, or a URL such as gs://...);
  '' turns it off. Returns the directory in use, or None.

  A local directory that cannot be created, or a URL whose scheme needs a package that is
  not installed (gs:// without gcsfs), is reported in one line through notify and the run
  goes on without a cache (it only saves time).
  """
  if not directory:
    jax.config.update('jax_enable_compilation_cache', False)
    return None
  if directory == DEFAULT_DIR and os.environ.get('JAX_COMPILATION_CACHE_DIR'):
    directory = os.environ['JAX_COMPILATION_CACHE_DIR']  # the user's own choice for JAX
  path = directory if is_url(directory) else os.path.abspath(os.path.expanduser(directory))
  install = storage.missing_backend(path)
  if install:
    if notify is not None:
      notify(f'WARNING: train.compilation_cache_dir {directory!r} needs {install}; '
             'compiling without a persistent cache')
    jax.config.update('jax_enable_compilation_cache', False)
    return None
  if not is_url(path):
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      if notify is not None:
        notify(f'WARNING: train.compilation_cache_dir {directory!r} cannot be created '
               f'({e.strerror or e}); compiling without a persistent cache')
      jax.config.update('jax_enable_compilation_cache', False)
      return None
  jax.config.update('jax_enable_compilation_cache', True)
  jax.config.update('jax_persistent_cache_enable_xla_caches', 'none')  # no path in the key
  if jax.config.jax_compilation_cache_dir != path:
    jax.config.update('jax_compilation_cache_dir', path)
    compilation_cache.reset_cache()  # the next compile opens the cache at the new path
  return path
