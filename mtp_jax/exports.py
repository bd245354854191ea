"""Lazy public names for a sub-package whose modules are also used before JAX starts.

A command parses its flags and checks paths before importing JAX, so importing one light
module (`mtp_jax.data.corpus`, `mtp_jax.runtime.host_memory`, `mtp_jax.research.stats`)
must not import its heavy siblings through the package's `__init__`. Such a package names
its public objects here and imports each module on first use (PEP 562).
"""
from __future__ import annotations

import importlib


def lazy(package: str, names: dict[str, str]):
  """(__getattr__, __dir__, __all__) for `package`; names: public name -> its submodule."""

  def __getattr__(name: str):
    if name not in names:
      raise AttributeError(f'module {package!r} has no attribute {name!r}')
    value = getattr(importlib.import_module(f'{package}.{names[name]}'), name)
    setattr(importlib.import_module(package), name, value)  # the next lookup is direct
    return value

  def __dir__():
    return sorted(set(vars(importlib.import_module(package))) | set(names))

  return __getattr__, __dir__, sorted(names)
