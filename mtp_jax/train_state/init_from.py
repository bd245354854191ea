"""`--init_from`, parsed once: a Hugging Face directory or a checkpoint of this project."""
from __future__ import annotations

import dataclasses
import os

HF_PREFIX = 'hf:'


@dataclasses.dataclass(frozen=True)
class InitFrom:
  """A parsed --init_from: kind 'hf' (a local Hugging Face directory, `hf:DIR`) or
  'checkpoint' (a workdir, its checkpoints/ directory or one step directory of this
  project: checkpoint.resolve_checkpoint tells which). Paths are absolute; nothing is
  checked here."""
  kind: str
  path: str  # '' for a bare 'hf:' (the reader of the directory says why that cannot load)

  @classmethod
  def parse(cls, value: str | InitFrom | None) -> InitFrom | None:
    """None for no --init_from; an InitFrom is returned as it is."""
    if value is None or isinstance(value, InitFrom):
      return value
    value = str(value).strip()
    if not value:
      return None
    if value.startswith(HF_PREFIX):
      rest = value[len(HF_PREFIX):].strip()
      return cls('hf', os.path.abspath(os.path.expanduser(rest)) if rest else '')
    return cls('checkpoint', os.path.abspath(os.path.expanduser(value)))

  def __str__(self) -> str:
    return f'{HF_PREFIX}{self.path}' if self.kind == 'hf' else self.path
