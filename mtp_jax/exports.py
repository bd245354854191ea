"""The public names of a sub-package (its `__init__`), imported on first use (PEP 562).

Every sub-package builds its face this way. A command parses its flags and checks paths
before importing JAX, so importing one light module (`mtp_jax.data.corpus`,
`mtp_jax.runtime.host_memory`, `mtp_jax.research.stats`) must not import its heavy
siblings through the package's `__init__`; and `import mtp_jax.model` costs nothing until
a name is used. A name the table does not hold goes to `mtp_jax.moved_name` (a name that
moved, with its DeprecationWarning; AttributeError otherwise).
"""
from __future__ import annotations

import importlib

import mtp_jax


def lazy(package: str, names: dict[str, str]):
  """(__getattr__, __dir__, __all__) for `package`; names: public name -> its submodule."""

  def __getattr__(name: str):
    if name not in names:
      return mtp_jax.moved_name(package, name)
    value = getattr(importlib.import_module(f'{package}.{names[name]}'), name)
    setattr(importlib.import_module(package), name, value)  # the next lookup is direct
    return value

  def __dir__():
    return sorted(set(vars(importlib.import_module(package))) | set(names))

  return __getattr__, __dir__, sorted(names)
