"""`--init_from`, parsed once: a Hugging Face directory or a checkpoint of this project.

Standard library only: the command lines parse and check the flag with it before JAX
starts. What each kind of source does with the run (its config, its checks, its load) is
mtp_jax/train/start.py's `InitSource`.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from mtp_jax.errors import ConfigError, RequestError

HF_PREFIX = 'hf:'


def _check_hf_dir(directory: str) -> None:
  if not directory:
    raise RequestError('--init_from hf:DIR needs a local directory after hf: (nothing is '
                       'downloaded from the Hugging Face hub)')
  if not os.path.isdir(directory):
    what = 'does not exist' if not os.path.exists(directory) else 'is not a directory'
    raise RequestError(f'--init_from hf:{directory}: {what}: give a local directory holding '
                       'config.json and *.safetensors (nothing is downloaded from the '
                       'Hugging Face hub)')
  if not os.path.isfile(os.path.join(directory, 'config.json')):
    raise RequestError(f'--init_from hf:{directory}: no config.json in the directory')


def _check_checkpoint_dir(path: str) -> None:
  if not os.path.isdir(path):
    raise ConfigError(f'--init_from {path!r} is not a directory (give a workdir, its '
                      'checkpoints/ directory or one step directory)')


@dataclasses.dataclass(frozen=True)
class SourceKind:
  """What is known of a kind of --init_from before anything is read."""
  prefix: str  # how the flag names it ('' for the kind a bare path is)
  sets_model: bool  # its config.json replaces config.model: the model is checked once read
  check_path: Callable[[str], None]  # ConfigError / RequestError for a path it cannot be


KINDS = {
    'hf': SourceKind(HF_PREFIX, sets_model=True, check_path=_check_hf_dir),
    'checkpoint': SourceKind('', sets_model=False, check_path=_check_checkpoint_dir),
}


@dataclasses.dataclass(frozen=True)
class InitFrom:
  """A parsed --init_from: kind 'hf' (a local Hugging Face directory, `hf:DIR`) or
  'checkpoint' (a workdir, its checkpoints/ directory or one step directory of this
  project: checkpoint.resolve_checkpoint tells which). Paths are absolute; nothing is
  read here."""
  kind: str
  path: str  # '' for a bare 'hf:' (check_path says why that cannot load)

  @classmethod
  def parse(cls, value: str | InitFrom | None) -> InitFrom | None:
    """None for no --init_from; an InitFrom is returned as it is."""
    if value is None or isinstance(value, InitFrom):
      return value
    value = str(value).strip()
    if not value:
      return None
    kind = next((k for k, facts in KINDS.items()
                 if facts.prefix and value.startswith(facts.prefix)), 'checkpoint')
    rest = value[len(KINDS[kind].prefix):].strip()
    return cls(kind, os.path.abspath(os.path.expanduser(rest)) if rest else '')

  @property
  def facts(self) -> SourceKind:
    return KINDS[self.kind]

  def check_path(self) -> None:
    """ConfigError / RequestError when the path cannot be a source of its kind (files
    only: what they hold is checked when the run starts)."""
    self.facts.check_path(self.path)

  def __str__(self) -> str:
    return self.facts.prefix + self.path
