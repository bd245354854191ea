"""The path and file checks of the command lines, run before JAX and the model are imported.

JAX-free (the standard library, the config tables and the parsed --init_from), so a
mistyped path costs a user a second, not the start-up of JAX. Each message is the one the
deeper check (data, tokenizer, checkpoint and workdir layers) gives for the same mistake;
those checks stay, for callers of the library.
"""
from __future__ import annotations

import importlib.util
import json
import os

import mtp_jax
from mtp_jax import storage
from mtp_jax.config import kinds
from mtp_jax.errors import ConfigError, RequestError
from mtp_jax.train_state.init_from import InitFrom


def train_paths(config, workdir: str, init_from: str | InitFrom | None) -> None:
  """ConfigError / RequestError for a --workdir, --init_from or data / tokenizer file that
  cannot be what the run needs."""
  _train_workdir(workdir)
  parsed = InitFrom.parse(init_from)
  if parsed is not None:
    parsed.check_path()
  _data_path(config.data)
  _tokenizer_files(config.data)
  for name in ('checkpoint_dir', 'compilation_cache_dir'):
    _reachable(f'train.{name}', config.train[name])
  _optional_packages(config)


def read_workdir(workdir: str) -> None:
  """A trained workdir to read (decode, eval, export, self-distill): it exists and its
  checkpoints are where its config.json's train.checkpoint_dir says (default: checkpoints/
  inside it). A URL is only checked for the package its scheme needs: whether it holds
  checkpoints is the reader's first question."""
  if not os.path.exists(workdir):
    raise RequestError(f'--workdir {workdir!r} does not exist')
  if not os.path.isdir(workdir):
    raise RequestError(f'--workdir {workdir!r} is not a directory')
  named = _named_checkpoint_dir(workdir)
  if not named:
    if not os.path.isdir(os.path.join(workdir, 'checkpoints')):
      raise RequestError(f'--workdir {workdir!r} has no checkpoints/ directory (train it first)')
    return
  if storage.is_url(named):
    _reachable(f'--workdir {workdir!r}: its checkpoints at', named, RequestError)
    return
  path = os.path.abspath(os.path.expanduser(named))
  if not os.path.isdir(path):
    raise RequestError(f'--workdir {workdir!r} has no checkpoints in {path} (its '
                       'train.checkpoint_dir; train it first)')


def _named_checkpoint_dir(workdir: str) -> str:
  """train.checkpoint_dir of the workdir's config.json ('' when unset or unreadable: the
  checkpoint reader falls back to checkpoints/ the same way)."""
  try:
    with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
      named = json.load(f).get('train', {}).get('checkpoint_dir', '')
  except (OSError, ValueError, AttributeError):
    return ''
  return named if isinstance(named, str) else ''


def _reachable(what: str, path: str, error=ConfigError) -> None:
  """`error` naming the package to install when `path` is a URL no installed package serves."""
  install = storage.missing_backend(path) if isinstance(path, str) else None
  if install:
    raise error(f'{what} {path!r} needs {install}')


def readable_file(path: str, flag: str) -> None:
  """RequestError unless `path` is a file this process can read."""
  try:
    with open(path, 'rb'):
      pass
  except OSError as e:
    raise RequestError(f'{flag} {path!r} cannot be read: {e}') from e


def _train_workdir(workdir: str) -> None:
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise RequestError(f'--workdir {workdir!r} exists and is not a directory')
  parent = os.path.dirname(os.path.abspath(workdir))
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise RequestError(f'--workdir {workdir!r} is not a usable directory: {parent!r} is a file')


def _data_path(d) -> None:
  facts = kinds.DATA.get(d.source)
  if facts is None or not facts.takes_path or not isinstance(d.path, str) or not d.path:
    return  # config_lib.validate names a missing or misplaced data.path
  root = os.path.abspath(os.path.expanduser(d.path))
  suffix = facts.suffix
  if suffix:
    if os.path.isfile(root) and not root.endswith(suffix):
      raise ConfigError(f'data.path {root!r} is not a {suffix} file (data.source {d.source})')
    if not os.path.exists(root):
      raise ConfigError(f'data.path {root!r} is neither a {suffix} file nor a directory')
  elif not os.path.isdir(root):
    raise ConfigError(facts.not_a_folder.format(root=root))


def _optional_packages(config) -> None:
  wandb = config.train.get('wandb')
  if wandb is not None and wandb.project and importlib.util.find_spec('wandb') is None:
    raise ConfigError(f'train.wandb.project ({wandb.project!r}) logs to Weights & Biases, '
                      "which is not installed: pip install -e '.[wandb]'")


def _tokenizer_files(d) -> None:
  if d.tokenizer == 'sentencepiece' and d.spm_model:
    path = os.path.expanduser(d.spm_model)
    if not os.path.isfile(path):
      raise ConfigError(f'data.spm_model {path!r} does not exist '
                        '(train one with scripts/train_tokenizer.py)')
  if d.tokenizer == 'hf' and d.hf_tokenizer:
    directory = os.path.abspath(os.path.expanduser(d.hf_tokenizer))
    if not os.path.isdir(directory):
      raise ConfigError(f'data.hf_tokenizer {directory!r} is not a directory (a local Hugging '
                        'Face model directory holding tokenizer.json)')
    if not os.path.isfile(os.path.join(directory, 'tokenizer.json')):
      raise ConfigError(f'data.hf_tokenizer {directory!r} has no tokenizer.json (nor a '
                        'SentencePiece tokenizer.model, which --init_from hf:DIR would take '
                        'instead)')


def __getattr__(name: str):  # a name an earlier release had here: mtp_jax.MOVED_NAMES
  return mtp_jax.moved_name(__name__, name)
