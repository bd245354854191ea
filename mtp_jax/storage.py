"""Where a run keeps its files, when that is a URL: which package a scheme needs.

Checkpoints (train.checkpoint_dir) and JAX's compilation cache (train.compilation_cache_dir)
may live at a URL such as gs://bucket/run. orbax and JAX reach it through etils.epath,
which serves gs:// with gcsfs (or TensorFlow's file system, when TensorFlow is installed);
without either, the first access fails deep inside a library. Standard library only, so
the command lines ask before JAX starts.
"""
from __future__ import annotations

import importlib.util

# scheme -> (the modules any one of which serves it, what to install)
_BACKENDS = {
    'gs': (('gcsfs', 'tensorflow'), "the gcs extra: pip install 'mtp_jax[gcs]' (gcsfs)"),
}


def is_url(path: str) -> bool:
  return '://' in str(path)


def scheme(path: str) -> str:
  return str(path).split('://', 1)[0].lower() if is_url(path) else ''


def missing_backend(path: str) -> str | None:
  """What to install before `path` can be read or written, or None when nothing is missing
  (a local path, a scheme served by an installed package, or one this module does not know)."""
  known = _BACKENDS.get(scheme(path))
  if known is None:
    return None
  modules, install = known
  if any(importlib.util.find_spec(m) is not None for m in modules):
    return None
  return install
