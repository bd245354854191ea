"""Safetensors directories, read and written through the `safetensors` library.

A directory holds model.safetensors, or shards named by model.safetensors.index.json
(else every *.safetensors in it). Reading opens headers only until a tensor is asked for;
`Reader.block` reads one block of a tensor (what a device holds), `Reader.get` a whole
tensor. Whatever the library refuses (a truncated file, a bad header, a dtype it does not
know) and every dtype this project does not read becomes one `InteropError` line naming
the file.

One exception to "through the library": its numpy and flax readers have no float8 dtype
(safetensors 0.8), so F8_E4M3 tensors (DeepSeek-V3's FP8 weights) are read from the
file's bytes at the offsets its header gives, after the library has checked that header.
"""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from mtp_jax.errors import ConfigError

INDEX = 'model.safetensors.index.json'
SHARD_BYTES = 4 << 30  # shard size on export (transformers' default is 5 GB)
# The dtypes read, as safetensors spells them; F8_E4M3 comes with a weight_scale_inv.
DTYPES = {'F32': np.float32, 'BF16': ml_dtypes.bfloat16, 'F16': np.float16,
          'F8_E4M3': ml_dtypes.float8_e4m3fn}


class InteropError(ConfigError):
  """A Hugging Face-layout directory or export request that cannot work; the message names
  the file, tensor or field (one line, CLI exit code 2)."""
  exit_code = 2


def _why(e: Exception) -> str:
  """What the safetensors library's error means, in a user's words."""
  text = ' '.join(str(e).split())
  if 'not fully covered' in text or 'out of bounds' in text:
    kind = 'truncated: its header names more bytes than the file holds'
  elif 'unknown variant' in text:
    kind = 'a dtype the safetensors library does not know'
  elif 'header' in text:
    kind = 'a bad header'
  else:
    kind = 'unreadable'
  return f'{kind} ({text[:160]})'


def read_json(path: str, where: str) -> dict:
  """A JSON object from a file; InteropError naming it when it is not one."""
  try:
    with open(path, encoding='utf-8') as f:
      out = json.load(f)
  except (OSError, ValueError) as e:
    raise InteropError(f'{where}: {os.path.basename(path)} cannot be read as JSON '
                       f'({" ".join(str(e).split())[:160]})') from e
  if not isinstance(out, dict):
    raise InteropError(f'{where}: {os.path.basename(path)} is not a JSON object')
  return out


def shard_files(directory: str, where: str) -> list[str]:
  """The safetensors files of a directory: those its index names, else every *.safetensors."""
  index = os.path.join(directory, INDEX)
  if os.path.isfile(index):
    weight_map = read_json(index, where).get('weight_map')
    if not isinstance(weight_map, dict) or not weight_map:
      raise InteropError(f'{where}: {INDEX} has no weight_map object')
    names = sorted(set(map(str, weight_map.values())))
    for n in names:
      if not os.path.isfile(os.path.join(directory, n)):
        raise InteropError(f'{where}: {INDEX} names {n}, which is missing')
    return names
  names = sorted(n for n in os.listdir(directory) if n.endswith('.safetensors'))
  if not names:
    raise InteropError(f'{where}: no *.safetensors weights in the directory (.bin / .pt '
                       'checkpoints are not read)')
  return names


class _Tensors:
  """What both readers share: a context manager over tensors by name, each with its
  safetensors dtype string (`_dtype`), refused unless it is one of DTYPES."""
  where: str
  _dtype: dict

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def close(self):
    pass

  def dtype(self, name: str) -> str:
    """The safetensors dtype string: F32, BF16, F16, F8_E4M3, ..."""
    return self._dtype[name]

  def check_dtype(self, name: str) -> None:
    if self._dtype[name] not in DTYPES:
      raise InteropError(f'{self.where}: tensor {name} has dtype {self._dtype[name]}; '
                         f'only {", ".join(DTYPES)} are read')


class Reader(_Tensors):
  """The tensors of a safetensors directory by name: shape and dtype from the headers,
  data on request. Use as a context manager (or call close) to release the files."""

  def __init__(self, directory: str, where: str | None = None):
    self.directory, self.where = directory, where or directory
    self._file, self._shape, self._dtype = {}, {}, {}
    self._open = {}
    for name in shard_files(directory, self.where):
      path = os.path.join(directory, name)
      f = self._handle(path)
      for key in f.keys():
        sl = f.get_slice(key)
        self._file[key], self._shape[key] = path, tuple(sl.get_shape())
        self._dtype[key] = sl.get_dtype()

  def _handle(self, path: str):
    if path not in self._open:
      try:
        self._open[path] = safe_open(path, framework='numpy')
      except (SafetensorError, OSError) as e:
        raise InteropError(f'{self.where}: {os.path.basename(path)} is not a readable '
                           f'safetensors file: {_why(e)}') from e
    return self._open[path]

  def close(self):
    for f in self._open.values():
      f.__exit__(None, None, None)
    self._open = {}

  def __contains__(self, name) -> bool:
    return name in self._file

  def keys(self):
    return self._file.keys()

  def shape(self, name: str) -> tuple:
    return self._shape[name]

  def block(self, name: str, index: tuple) -> np.ndarray:
    """tensor[index] (a tuple of slices), in its stored dtype."""
    self.check_dtype(name)
    if self._dtype[name] == 'F8_E4M3':
      return self._float8(name)[index]
    try:
      return np.asarray(self._handle(self._file[name]).get_slice(name)[index])
    except SafetensorError as e:
      raise InteropError(f'{self.where}: tensor {name} of {os.path.basename(self._file[name])} '
                         f'cannot be read: {_why(e)}') from e

  def get(self, name: str) -> np.ndarray:
    """The whole tensor, in its stored dtype."""
    return self.block(name, tuple(slice(None) for _ in self._shape[name]))

  def _float8(self, name: str) -> np.ndarray:
    path = self._file[name]
    with open(path, 'rb') as f:
      n = int.from_bytes(f.read(8), 'little')
      start, end = json.loads(f.read(n))[name]['data_offsets']
    return np.memmap(path, ml_dtypes.float8_e4m3fn, 'r', offset=8 + n + start,
                     shape=self._shape[name])[...].copy()


class MemoryReader(_Tensors):
  """Reader's interface over tensors already in memory: {name: array} (numpy, or anything
  np.asarray takes, in a dtype of DTYPES; FP8 weights beside their weight_scale_inv)."""

  def __init__(self, tensors, where: str = 'tensors'):
    self.where = where
    self._tensors = {str(k): np.asarray(v) for k, v in tensors.items()}
    codes = {np.dtype(v): k for k, v in DTYPES.items()}
    self._dtype = {k: codes.get(x.dtype, str(x.dtype)) for k, x in self._tensors.items()}

  def __contains__(self, name) -> bool:
    return name in self._tensors

  def keys(self):
    return self._tensors.keys()

  def shape(self, name: str) -> tuple:
    return tuple(self._tensors[name].shape)

  def block(self, name: str, index: tuple) -> np.ndarray:
    self.check_dtype(name)
    return self._tensors[name][index]

  def get(self, name: str) -> np.ndarray:
    self.check_dtype(name)
    return self._tensors[name]


def _file_mode() -> int:
  """The mode open() gives a new file here: 0666 less the process umask (0644 usually)."""
  mask = os.umask(0)
  os.umask(mask)
  return 0o666 & ~mask


def write_dir(directory: str, tensors: dict, shard_bytes: int = SHARD_BYTES) -> list[str]:
  """model.safetensors, or shards + model.safetensors.index.json when the tensors exceed
  shard_bytes, in insertion order (layer by layer). Returns the file names written."""
  os.makedirs(directory, exist_ok=True)
  shards, size = [[]], 0
  for name, x in tensors.items():
    if shards[-1] and size + x.nbytes > shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += x.nbytes
  meta = {'format': 'pt'}  # what transformers and vLLM check for
  if len(shards) == 1:
    names = ['model.safetensors']
  else:
    names = [f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors' for i in range(len(shards))]
  mode = _file_mode()
  for file, keys in zip(names, shards):
    path = os.path.join(directory, file)
    save_file({k: np.ascontiguousarray(tensors[k]) for k in keys}, path, metadata=meta)
    os.chmod(path, mode)  # safetensors writes 0600; the export's other files follow the umask
  if len(shards) == 1:
    return names
  total = int(sum(x.nbytes for x in tensors.values()))
  weight_map = {k: file for file, keys in zip(names, shards) for k in keys}
  with open(os.path.join(directory, INDEX), 'w', encoding='utf-8') as f:
    json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
  return [INDEX] + names
