"""The held-out corpus: third-party Python code that is not in the training corpus.

`heldout_documents` gathers the site-packages sources of the installed libraries, minus
every file whose content also appears in the interpreter's standard library (the
training corpus), by a fixed rule (`HeldoutRule`); `pack_rows` and `prompts_from` turn
them into evaluation batches and decode prompts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig
from collections.abc import Sequence

import numpy as np

from mtp_jax.data import corpus
from mtp_jax.train import evaluation


@dataclasses.dataclass(frozen=True)
class HeldoutRule:
  """Which third-party sources form the held-out corpus (deterministic for one install).

  Every `.py` file under `root` (default: this interpreter's purelib, i.e. the venv's
  site-packages) of [min_bytes, max_bytes] bytes, minus __pycache__ and editable-install
  shims, ordered by sha1(relative path) (which interleaves packages) and taken in that
  order until cap_bytes, skipping files with NUL bytes or invalid UTF-8 and every file
  whose content equals a stdlib file's or an already taken file's: a fixed list for a
  given set of installed package versions.
  """
  root: str = ''
  min_bytes: int = 1_000
  max_bytes: int = 64_000
  cap_bytes: int = 1_000_000


def _sha1(b: bytes) -> str:
  return hashlib.sha1(b).hexdigest()


def stdlib_hashes() -> set[str]:
  root = corpus.stdlib_root()
  out = set()
  for rel in corpus.list_files(root):
    try:
      with open(os.path.join(root, rel), 'rb') as f:
        out.add(_sha1(f.read()))
    except OSError:
      continue
  return out


def heldout_documents(rule: HeldoutRule = HeldoutRule()) -> tuple[list[tuple[str, str]], dict]:
  """([(relpath, text)] in the rule's order, a description with a fingerprint).

  Only sizes are read for the whole tree; files are opened in the rule's order until
  the cap is reached, so a large site-packages costs one directory walk.
  """
  root = rule.root or sysconfig.get_paths()['purelib']
  if not os.path.isdir(root):
    raise ValueError(f'held-out corpus root {root!r} is not a directory')
  counts = {'files': 0, 'size': 0, 'binary_or_bad_utf8': 0, 'duplicate': 0}
  candidates = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d != '__pycache__']
    for name in filenames:
      if not name.endswith('.py') or name.startswith('__editable__'):
        continue
      path = os.path.join(dirpath, name)
      counts['files'] += 1
      try:
        size = os.path.getsize(path)
      except OSError:
        continue
      if not rule.min_bytes <= size <= rule.max_bytes:
        counts['size'] += 1
        continue
      rel = os.path.relpath(path, root).replace(os.sep, '/')
      candidates.append((_sha1(rel.encode()), rel))
  candidates.sort()
  seen = stdlib_hashes()  # content seen: the stdlib's, then every file taken
  docs, total, digest = [], 0, hashlib.sha1()
  for _, rel in candidates:
    if total >= rule.cap_bytes:
      break
    with open(os.path.join(root, rel), 'rb') as f:
      raw = f.read()
    h = _sha1(raw)
    if h in seen:
      counts['duplicate'] += 1
      continue
    seen.add(h)
    try:
      text = raw.decode('utf-8')
    except UnicodeDecodeError:
      text = None
    if text is None or '\x00' in text:
      counts['binary_or_bad_utf8'] += 1
      continue
    docs.append((rel, text))
    total += len(raw)
    digest.update(f'{rel}\t{h}\n'.encode())
  desc = {'root': _portable(root), 'rule': dataclasses.asdict(rule), 'scanned': counts,
          'eligible_by_size': len(candidates), 'documents': len(docs), 'bytes': total,
          'packages': sorted({d[0].split('/')[0] for d in docs}),
          'fingerprint': digest.hexdigest()[:12]}
  return docs, desc


def pack_rows(docs: Sequence[str], tokenizer, seq_len: int, rows: int) -> dict[str, np.ndarray]:
  """Documents (+ EOS each) concatenated and cut into `rows` rows of seq_len tokens.

  The packing of the training pipeline: a row holds pieces of several documents, each
  its own segment (ids from 1) with positions from 0 at the piece's start.
  """
  tokens = np.zeros((rows, seq_len), np.int32)
  seg = np.zeros((rows, seq_len), np.int32)
  pos = np.zeros((rows, seq_len), np.int32)
  r = c = 0
  s = 1
  for text in docs:
    ids = np.append(tokenizer.encode_array(text), tokenizer.eos_id).astype(np.int32)
    while len(ids) and r < rows:
      n = min(len(ids), seq_len - c)
      tokens[r, c:c + n], seg[r, c:c + n], pos[r, c:c + n] = ids[:n], s, np.arange(n)
      ids, c, s = ids[n:], c + n, s + 1
      if c == seq_len:
        r, c, s = r + 1, 0, 1
    if r == rows:
      break
  if r < rows:
    raise ValueError(f'the held-out corpus fills {r} of the {rows} rows of {seq_len} tokens '
                     'asked for; raise HeldoutRule.cap_bytes or ask for fewer')
  return {'tokens': tokens, 'segment_ids': seg, 'positions': pos}


def prompts_from(docs: Sequence[str], tokenizer, n: int, length: int) -> list[list[int]]:
  """evaluation.prompts_from_docs, ValueError unless all n prompts exist."""
  out = evaluation.prompts_from_docs(docs, tokenizer, n, length)
  if len(out) < n:
    raise ValueError(f'only {len(out)} held-out documents have {4 * length}+ tokens')
  return out


def _portable(path: str) -> str:
  """A recorded root without this machine's absolute path: relative to sys.prefix (the
  venv) when it lies inside it."""
  prefix = os.path.abspath(sys.prefix)
  path = os.path.abspath(path)
  if path == prefix or path.startswith(prefix + os.sep):
    return os.path.join('<sys.prefix>', os.path.relpath(path, prefix))
  return path
