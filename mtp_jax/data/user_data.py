"""User data: a folder of text files, `.jsonl` / `.parquet` records, or a saved `datasets` set.

`data.source` picks the reader (`tfds`, the default, is stdlib_dataset's TFDS path):
  files    every file under data.path whose name ends with one of data.extensions;
           one document per file, split by a hash of its relative path (as python_stdlib)
  jsonl    data.path: one .jsonl file or a folder of them; one JSON object per line
  parquet  data.path: one .parquet file or a folder of them; one row per document
  hf_disk  data.path: a directory written by `datasets.Dataset.save_to_disk` (or a
           DatasetDict's, whose splits data.train_split / data.eval_split then name)
Records hold the document text in data.text_key, or its token ids in data.tokens_key
(used as they are: exact for any tokenizer, e.g. sampled bytes that are not valid UTF-8).
Records without named splits go to 'train' / 'validation' by a hash of (file, row),
data.validation_percent of them held out, the same on every machine and run.

Each reader is a random-access source (len, [i]) of dicts, so the grain pipeline above it
(shuffle, per-process shard, packing, checkpointed iterator state) is the one the stdlib
corpus uses. Nothing is copied or prepared: .jsonl lines are found and checked once (byte
offsets; every line parsed before the run starts, so a malformed one is named up front) and
read with pread; a parquet file's one needed column is read on first use and kept in memory;
a saved `datasets` set is memory-mapped by `datasets` itself.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

import mtp_jax.data.corpus as corpus
from mtp_jax.config import kinds
from mtp_jax.config.validation import validate_data_source
from mtp_jax.errors import ConfigError

TFDS, FILES, JSONL, PARQUET, HF_DISK = 'tfds', 'files', 'jsonl', 'parquet', 'hf_disk'
SOURCES = kinds.DATA_SOURCES  # (TFDS, FILES, JSONL, PARQUET, HF_DISK): config/kinds.py's DATA
# A user's folder: caches, virtual environments and hidden directories (.git) are not text.
_SKIP_DIRS = frozenset({'site-packages', 'dist-packages', '__pycache__', 'node_modules'})
_INDEX_CHUNK = 1 << 26  # bytes read at a time while finding a .jsonl file's lines


def source_of(data_config) -> str:
  """data.source (configs saved before it existed load with its default, tfds)."""
  return data_config.source


def is_user_source(data_config) -> bool:
  return kinds.DATA[source_of(data_config)].takes_path


def describe(data_config) -> str:
  """What the data is, as error messages name it."""
  if not is_user_source(data_config):
    return f'data.dataset {data_config.dataset!r}'
  return f'data.path {data_config.path!r} (data.source {source_of(data_config)})'


def check_fields(data_config) -> None:
  """The data.source / path / extensions / tokens_key values themselves (no disk access)."""
  validate_data_source(data_config)


def _root(path: str) -> str:
  return os.path.abspath(os.path.expanduser(path))


def _record_buckets(file_key: str, n: int) -> np.ndarray:
  """[n] hash buckets in [0, corpus.HASH_BUCKETS) of rows 0..n-1 of one file, stable anywhere.

  splitmix64 of (sha1 of the file's relative path + row): vectorised, so a million rows
  take milliseconds.
  """
  seed = np.uint64(int.from_bytes(hashlib.sha1(file_key.encode('utf-8')).digest()[:8], 'big'))
  with np.errstate(over='ignore'):
    z = np.arange(n, dtype=np.uint64) + seed + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
  return (z % np.uint64(corpus.HASH_BUCKETS)).astype(np.int64)


def _in_split(buckets: np.ndarray, split: str, validation_percent: float) -> np.ndarray:
  held_out = buckets < validation_percent * (corpus.HASH_BUCKETS // 100)
  return held_out if split == corpus.VALIDATION else ~held_out


def _split_field(d, split: str) -> str:
  """The config field that asked for `split` (as error messages name it)."""
  return 'data.train_split' if split == d.train_split else 'data.eval_split'


def _check_hash_split(d, split: str, what: str = 'records without named splits') -> None:
  if split not in corpus.SPLITS:
    raise ConfigError(f'{_split_field(d, split)} {split!r}: {what} are split by hash into '
                      f'{corpus.SPLITS} (data.validation_percent held out); use one of those')


def _record_files(root: str, source: str) -> list[tuple[str, str]]:
  """[(absolute path, relative path)] of the .jsonl / .parquet files of data.path, sorted."""
  suffix = kinds.DATA[source].suffix
  if os.path.isfile(root):
    if not root.endswith(suffix):
      raise ConfigError(f'data.path {root!r} is not a {suffix} file (data.source {source})')
    return [(root, os.path.basename(root))]
  if not os.path.isdir(root):
    raise ConfigError(f'data.path {root!r} is neither a {suffix} file nor a directory')
  rels = corpus.list_files(root, extensions=(suffix,), skip_dirs=_SKIP_DIRS, skip_hidden=True,
                           field='data.path', hint=f'point data.path at a {suffix} file or a '
                           'folder holding some, or set data.source to the format it holds')
  return [(os.path.join(root, r), r) for r in rels]


class _Fields:
  """Turns a raw record into {text_key: str} or {tokens_key: int32 ids}, checking it."""

  def __init__(self, text_key: str, tokens_key: str):
    self.text_key, self.tokens_key = text_key, tokens_key

  @property
  def key(self) -> str:
    return self.tokens_key or self.text_key

  def field_name(self) -> str:
    return f'data.tokens_key {self.tokens_key!r}' if self.tokens_key else \
        f'data.text_key {self.text_key!r}'

  def pick(self, record: Any, where: str) -> dict:
    if not isinstance(record, dict):
      raise ConfigError(f'{where} is not a JSON object / record (got {type(record).__name__})')
    if self.key not in record:
      raise ConfigError(f'{self.field_name()} is not a field of {where} '
                        f'(fields: {sorted(record)[:20]})')
    value = record[self.key]
    out = {}
    if self.tokens_key:
      ids = np.asarray(value)
      if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ConfigError(f'{self.field_name()} of {where} must be a list of token ids, '
                          f'got {str(value)[:60]}')
      out[self.tokens_key] = ids.astype(np.int32)
      text = record.get(self.text_key)
      if isinstance(text, str):
        out[self.text_key] = text
    else:
      if not isinstance(value, str):
        raise ConfigError(f'{self.field_name()} of {where} must hold text (a string), '
                          f'got {type(value).__name__}')
      out[self.text_key] = value
    return out


# -- files -------------------------------------------------------------------------------------
class FilesSource:
  """One document per text file: {text_key: text, 'path': relative path}.

  Empty, binary (NUL-holding) and unreadable files read as '' (the pipeline skips empty
  documents), so listing never opens a file; invalid UTF-8 is replaced, as in the stdlib.
  """

  def __init__(self, root: str, rels: Sequence[str], text_key: str):
    self.root, self.rels, self.text_key = root, list(rels), text_key

  def __len__(self) -> int:
    return len(self.rels)

  def __getitem__(self, i: int) -> dict:
    rel = self.rels[i]
    text = corpus.read_text(os.path.join(self.root, rel))
    return {self.text_key: text or '', 'path': rel}


def _files_source(d, split: str) -> FilesSource:
  _check_hash_split(d, split, 'files')
  root = _root(d.path)
  ext = tuple(d.extensions)
  rels = corpus.list_files(root, extensions=ext, skip_dirs=_SKIP_DIRS, skip_hidden=True,
                           field='data.path', hint='point data.path at a folder holding them, or '
                           'list the endings to read, e.g. --config.data.extensions="(\'.md\', '
                           '\'.txt\')"')
  _check_some_file_readable(root, rels)
  return FilesSource(root, corpus.split_files(rels, d.validation_percent)[split], d.text_key)


def _check_some_file_readable(root: str, rels: Sequence[str]) -> None:
  """ConfigError when no listed file holds a document (all empty, binary or unreadable):
  reads files until the first readable one, so a usual folder costs one read."""
  stats = corpus.ReadStats()
  for rel in rels:
    if corpus.read_text(os.path.join(root, rel), stats) is not None:
      return
  found = ', '.join(f'{n} {what}' for n, what in ((stats.empty, 'empty'),
                                                  (stats.binary, 'binary (holding NUL bytes)'),
                                                  (stats.unreadable, 'unreadable')) if n)
  raise ConfigError(f'data.path {root!r} (data.source files) has no readable document among '
                    f'its {len(rels)} matching file(s) ({found}); add text files')


# -- jsonl -------------------------------------------------------------------------------------
_SPANS_CACHE: dict = {}  # (path, size, mtime, key) -> spans: one pass per file per process


def _line_spans(path: str, where: str, fields: _Fields) -> tuple[np.ndarray, np.ndarray,
                                                                 np.ndarray]:
  """(byte offset, length, 1-based line number) of every non-blank line of a .jsonl file.

  Every line is parsed (a streaming pass, one chunk of the file in memory at a time) and
  its field checked, so a malformed line anywhere stops the run before anything compiles:
  ConfigError naming `where` (the file) and the line. The result is kept per process
  while the file is unchanged (train, eval and the preflight checks share one pass).
  """
  st = os.stat(path)
  key = (path, st.st_size, st.st_mtime_ns, fields.text_key, fields.tokens_key)
  if key in _SPANS_CACHE:
    return _SPANS_CACHE[key]
  starts, lengths, numbers = [], [], []
  pos, number, carry = 0, 0, b''
  with open(path, 'rb') as f:
    while True:
      chunk = f.read(_INDEX_CHUNK)
      if chunk:
        lines = (carry + chunk).split(b'\n')
        carry = lines.pop()  # the start of a line the next chunk ends
      else:
        lines = [carry] if carry else []  # a last line without '\n'
      for line in lines:
        number += 1
        if line.strip():
          _check_line(line, f'{where} line {number}', fields)
          starts.append(pos)
          lengths.append(len(line))
          numbers.append(number)
        pos += len(line) + 1
      if not chunk:
        break
  out = (np.asarray(starts, np.int64), np.asarray(lengths, np.int64),
         np.asarray(numbers, np.int64))
  _SPANS_CACHE[key] = out
  return out


def _check_line(raw: bytes, where: str, fields: _Fields) -> None:
  """The cheap part of _Fields.pick (syntax, object, field, its type) for one line."""
  try:
    record = json.loads(raw)
  except ValueError as e:
    raise ConfigError(f'data.path: {where} is not valid JSON ({str(e)[:100]})') from None
  if not isinstance(record, dict):
    raise ConfigError(f'data.path: {where} is not a JSON object (got {type(record).__name__})')
  value = record.get(fields.key)
  if fields.key not in record:
    raise ConfigError(f'{fields.field_name()} is not a field of data.path: {where} '
                      f'(fields: {sorted(record)[:20]})')
  if fields.tokens_key:
    if not isinstance(value, list) or (value and not isinstance(value[0], int)):
      raise ConfigError(f'{fields.field_name()} of data.path: {where} must be a list of '
                        f'token ids, got {str(value)[:60]}')
  elif not isinstance(value, str):
    raise ConfigError(f'{fields.field_name()} of data.path: {where} must hold text (a '
                      f'string), got {type(value).__name__}')


class _FileRecords:
  """The records `index` selects from files; what a process opened or read of them
  (`_cache`: descriptors, columns) stays in that process: a pickled copy (a grain worker)
  starts with none and opens its own."""

  def __getstate__(self):
    state = dict(self.__dict__)
    state['_cache'], state['_lock'] = {}, None
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self.index)


class JsonlSource(_FileRecords):
  """Records of .jsonl files, read by byte offset (os.pread on a per-process descriptor)."""

  def __init__(self, files: Sequence[tuple[str, str]], fields: _Fields, split: str,
               validation_percent: float):
    self.paths = [p for p, _ in files]
    self.rels = [r for _, r in files]
    self.fields = fields
    rows = []  # per file: [file index, offset, length, line number]
    for fi, (path, rel) in enumerate(files):
      starts, lengths, numbers = _line_spans(path, path, fields)
      sel = _in_split(_record_buckets(rel, starts.size), split, validation_percent)
      rows.append(np.stack([np.full(starts.size, fi), starts, lengths, numbers], 1)[sel])
    self.index = np.concatenate(rows) if rows else np.zeros((0, 4), np.int64)
    self._cache, self._lock = {}, threading.Lock()  # file index -> descriptor

  def _parse(self, raw: bytes, where: str) -> dict:
    try:
      record = json.loads(raw)
    except ValueError as e:
      raise ConfigError(f'data.path: {where} is not valid JSON ({str(e)[:100]})') from e
    return self.fields.pick(record, f'data.path: {where}')

  def _fd(self, fi: int) -> int:
    with self._lock:
      if fi not in self._cache:
        self._cache[fi] = os.open(self.paths[fi], os.O_RDONLY)
      return self._cache[fi]

  def __getitem__(self, i: int) -> dict:
    fi, start, length, line = (int(v) for v in self.index[i])
    raw = os.pread(self._fd(fi), length, start)
    return self._parse(raw, f'{self.rels[fi]} line {line}')


# -- parquet -----------------------------------------------------------------------------------
class ParquetSource(_FileRecords):
  """Rows of .parquet files; each file's one needed column is read on first use and kept."""

  def __init__(self, files: Sequence[tuple[str, str]], fields: _Fields, split: str,
               validation_percent: float):
    try:
      # Deferred: pyarrow is needed only for parquet data (an optional dependency).
      import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ConfigError('data.source parquet needs pyarrow: pip install "mtp_jax[data]"') from e
    self.paths = [p for p, _ in files]
    self.rels = [r for _, r in files]
    self.fields = fields
    rows = []
    for fi, (path, rel) in enumerate(files):
      try:
        meta = pq.ParquetFile(path)
      except Exception as e:  # pylint: disable=broad-except
        raise ConfigError(f'data.path: {rel} is not a readable parquet file '
                          f'({type(e).__name__}: {str(e)[:120]})') from e
      names = meta.schema_arrow.names
      if fields.key not in names:
        raise ConfigError(f'{fields.field_name()} is not a column of data.path: {rel} '
                          f'(columns: {names[:20]})')
      n = meta.metadata.num_rows
      sel = _in_split(_record_buckets(rel, n), split, validation_percent)
      rows.append(np.stack([np.full(n, fi), np.arange(n)], 1)[sel])
    self.index = np.concatenate(rows) if rows else np.zeros((0, 2), np.int64)
    self._cache, self._lock = {}, threading.Lock()  # file index -> its read columns
    if len(self.index):
      self[0]  # pylint: disable=pointless-statement  (checks the column's type)

  def _column(self, fi: int):
    with self._lock:
      if fi not in self._cache:
        # Deferred: as in __init__ (optional dependency).
        import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
        wanted = [self.fields.key] + ([self.fields.text_key] if self.fields.tokens_key else [])
        names = pq.ParquetFile(self.paths[fi]).schema_arrow.names
        self._cache[fi] = pq.read_table(self.paths[fi],
                                        columns=[c for c in wanted if c in names])
      return self._cache[fi]

  def __getitem__(self, i: int) -> dict:
    fi, row = (int(v) for v in self.index[i])
    table = self._column(fi)
    record = {name: table.column(name)[row].as_py() for name in table.column_names}
    return self.fields.pick(record, f'data.path: {self.rels[fi]} row {row}')


# -- a saved `datasets` dataset ------------------------------------------------------------------
class HFDiskSource:
  """Rows of a `datasets.Dataset` (memory-mapped Arrow files), restricted to the used columns."""

  def __init__(self, dataset, fields: _Fields, where: str, rows: np.ndarray | None = None):
    self.dataset, self.fields, self.where = dataset, fields, where
    self.rows = rows  # None: every row

  def __len__(self) -> int:
    return len(self.dataset) if self.rows is None else len(self.rows)

  def __getitem__(self, i: int) -> dict:
    row = int(i if self.rows is None else self.rows[i])
    return self.fields.pick(self.dataset[row], f'{self.where} row {row}')


def _hf_source(d, split: str, fields: _Fields) -> HFDiskSource:
  root = _root(d.path)
  if not os.path.isdir(root):
    raise ConfigError(f'data.path {root!r} is not a directory (data.source hf_disk reads '
                      'what datasets.Dataset.save_to_disk wrote)')
  try:
    # Deferred: `datasets` is an optional dependency, and slow to import (≈ 1 s).
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ConfigError('data.source hf_disk needs datasets: pip install "mtp_jax[data]"') from e
  try:
    loaded = datasets.load_from_disk(root)
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f'data.path {root!r} is not a saved datasets dataset '
                      f'({type(e).__name__}: {str(e)[:160]})') from e
  where = f'data.path {root!r}'
  rows = None
  if isinstance(loaded, datasets.DatasetDict):
    if split not in loaded:
      raise ConfigError(f'{where} has no split {split!r} ({_split_field(d, split)}); '
                        f'it has {sorted(loaded)}')
    ds = loaded[split]
    where = f'{where} split {split!r}'
  else:
    _check_hash_split(d, split, 'the rows of a saved Dataset (not a DatasetDict)')
    ds = loaded
    rows = np.flatnonzero(_in_split(_record_buckets('', len(ds)), split, d.validation_percent))
  if fields.key not in ds.column_names:
    raise ConfigError(f'{fields.field_name()} is not a column of {where} '
                      f'(columns: {ds.column_names[:20]})')
  keep = [c for c in (fields.key, fields.text_key) if c in ds.column_names]
  return HFDiskSource(ds.select_columns(keep), fields, where, rows)


def data_source(data_config, split: str):
  """The random-access source of one split of a user data source; ConfigError if unusable."""
  d = data_config
  check_fields(d)
  src = source_of(d)
  fields = _Fields(d.text_key, d.tokens_key)
  if src == FILES:
    source = _files_source(d, split)
  elif src == HF_DISK:
    source = _hf_source(d, split, fields)
  else:
    _check_hash_split(d, split)
    files = _record_files(_root(d.path), src)
    records = {JSONL: JsonlSource, PARQUET: ParquetSource}[src]
    source = records(files, fields, split, d.validation_percent)
  if len(source) == 0:
    raise ConfigError(f'{describe(d)}: split {split!r} is empty (data.validation_percent '
                      f'{d.validation_percent:g} of the records are held out): add records, '
                      'or hold out more with --config.data.validation_percent (e.g. 20)')
  return source
