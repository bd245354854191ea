"""The model classes of config/kinds.py's table, by config name: `ATTENTION_KINDS`
(model.attention, model.mtp.block_attention), `MLP_KINDS` (model.mlp, model.mtp.block_mlp)
and `MTP_KINDS` (model.mtp.kind). The table, read before JAX starts, names each class by
its dotted path; these mappings import it on first use, in the table's order.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from mtp_jax.config import kinds


class KindClasses(Mapping):
  """The model classes of one table of config/kinds.py, by config name, in its order: each
  entry's `cls` path imported on first use (the table, read before JAX starts, names the
  classes without importing them)."""

  def __init__(self, table: Mapping):
    self.table = table

  def __getitem__(self, name: str) -> type:
    module, _, attr = self.table[name].cls.rpartition('.')
    return getattr(importlib.import_module(module), attr)

  def __iter__(self) -> Iterator[str]:
    return iter(self.table)

  def __len__(self) -> int:
    return len(self.table)


# The names, the classes and their facts are config/kinds.py's one table, which the config
# checks read too.
ATTENTION_KINDS: Mapping[str, type] = KindClasses(kinds.ATTENTION)
MLP_KINDS: Mapping[str, type] = KindClasses(kinds.MLP)
MTP_KINDS: Mapping[str, type] = KindClasses(kinds.MTP_HEADS)
