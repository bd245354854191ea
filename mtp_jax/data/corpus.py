"""The embedded default corpus: this interpreter's standard library `.py` files.

Every machine that runs this code has it, nobody here wrote it, and it is real
code (≈ 31 MB in ≈ 1,800 files on CPython 3.11). Files are enumerated in sorted
relative-path order and assigned to a split by a hash of that path, so the split
of a file never depends on which other files exist.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence

from mtp_jax.errors import ConfigError

TRAIN, VALIDATION = 'train', 'validation'
SPLITS = (TRAIN, VALIDATION)
# Third-party code is not part of the standard library; caches are not source.
_SKIP_DIRS = frozenset({'site-packages', 'dist-packages', '__pycache__'})
HASH_BUCKETS = 10_000  # split granularity: validation_percent to 0.01 %


def stdlib_root() -> str:
  """This interpreter's standard library directory."""
  return sysconfig.get_paths()['stdlib']


def resolve_root(corpus_dir: str = '') -> str:
  """`corpus_dir`, or this interpreter's stdlib when empty."""
  return os.path.abspath(os.path.expanduser(corpus_dir)) if corpus_dir else stdlib_root()


def list_files(root: str, extensions: Sequence[str] = ('.py',), *,
               skip_dirs: frozenset = _SKIP_DIRS, skip_hidden: bool = False,
               field: str = 'data.corpus_dir', hint: str = '') -> list[str]:
  """Sorted relative POSIX paths of the files under root ending in one of `extensions`.

  ConfigError naming `field` when root is not a readable directory or holds no such file
  (`hint`: what to change then; default: for data.corpus_dir).
  skip_hidden: also leave out directories whose names start with '.' (.git, .venv).
  """
  if not os.path.isdir(root) or not os.access(root, os.R_OK | os.X_OK):
    raise ConfigError(f'{field}: corpus root {root!r} is not a readable directory')
  ends = tuple(extensions)
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):  # does not follow dir symlinks
    dirnames[:] = [d for d in dirnames
                   if d not in skip_dirs and not (skip_hidden and d.startswith('.'))]
    rel_dir = os.path.relpath(dirpath, root)
    for name in filenames:
      if name.endswith(ends) and os.path.isfile(os.path.join(dirpath, name)):
        rel = name if rel_dir == '.' else os.path.join(rel_dir, name)
        paths.append(rel.replace(os.sep, '/'))
  if not paths:
    what = ' or '.join(ends) if len(ends) > 1 else ends[0]
    hint = hint or (f"point {field} at a folder holding {what} files ('' reads this "
                    "interpreter's standard library)")
    raise ConfigError(f'{field}: corpus root {root!r} contains no {what} files; {hint}')
  return sorted(paths)


def split_of(relpath: str, validation_percent: float) -> str:
  """'validation' for about validation_percent % of paths, stable across runs and machines."""
  bucket = int.from_bytes(hashlib.sha1(relpath.encode('utf-8')).digest()[:8], 'big') % HASH_BUCKETS
  return VALIDATION if bucket < validation_percent * (HASH_BUCKETS // 100) else TRAIN


def split_files(paths: Sequence[str], validation_percent: float) -> dict[str, list[str]]:
  """{'train': [...], 'validation': [...]}, each in the input (sorted) order."""
  out = {s: [] for s in SPLITS}
  for p in paths:
    out[split_of(p, validation_percent)].append(p)
  return out


def fingerprint(root: str, paths: Sequence[str]) -> str:
  """Short hash of (path, size) of every file: different Pythons give different corpora.

  Sizes rather than contents keep this at a few ms; mtimes are left out so two
  installs of the same Python share one prepared dataset.
  """
  h = hashlib.sha1()
  for p in paths:
    try:
      size = os.path.getsize(os.path.join(root, p))
    except OSError:
      size = -1
    h.update(f'{p}\t{size}\n'.encode())
  return h.hexdigest()[:10]


def interpreter_tag() -> str:
  """e.g. 'cpython3_11_7': part of the dataset config name."""
  v = sys.version_info
  return f'{sys.implementation.name}{v.major}_{v.minor}_{v.micro}'


@dataclasses.dataclass
class ReadStats:
  """What reading a list of files found; skipped files are counted, never fatal."""
  documents: int = 0  # files yielded
  bytes: int = 0  # UTF-8 bytes of the yielded text
  replaced: int = 0  # files with undecodable bytes (replaced by U+FFFD)
  empty: int = 0  # zero-length files (skipped)
  binary: int = 0  # files holding NUL bytes (skipped)
  unreadable: int = 0  # OSError on open/read (skipped)


def read_text(path: str, stats: ReadStats | None = None) -> str | None:
  """The file as text (invalid UTF-8 replaced), or None if empty, binary or unreadable."""
  stats = stats if stats is not None else ReadStats()
  try:
    with open(path, 'rb') as f:
      raw = f.read()
  except OSError:
    stats.unreadable += 1
    return None
  if not raw:
    stats.empty += 1
    return None
  if b'\x00' in raw:
    stats.binary += 1
    return None
  try:
    text = raw.decode('utf-8')
  except UnicodeDecodeError:
    text = raw.decode('utf-8', errors='replace')
    stats.replaced += 1
  stats.documents += 1
  stats.bytes += len(text.encode('utf-8'))
  return text


def iter_documents(root: str, paths: Sequence[str],
                   stats: ReadStats | None = None) -> Iterator[tuple[str, str]]:
  """(relpath, text) for each readable, non-empty file of paths, in order."""
  for p in paths:
    text = read_text(os.path.join(root, p), stats)
    if text is not None:
      yield p, text


def split_documents(split: str, *, corpus_dir: str = '', validation_percent: float = 5,
                    stats: ReadStats | None = None) -> Iterator[tuple[str, str]]:
  """(relpath, text) of one split of the corpus, read straight from disk (no TFDS)."""
  if split not in SPLITS:
    raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
  root = resolve_root(corpus_dir)
  paths = split_files(list_files(root), validation_percent)[split]
  return iter_documents(root, paths, stats)
