"""`mtp-train --check_storage`: can this host write and read where the run keeps its files?

On a pod every worker saves its shards of each checkpoint to train.checkpoint_dir, so a
bucket one worker cannot reach fails the first save, minutes or hours into the rental.
scripts/launch_tpu_pod.sh runs this on every worker before it starts the trainer: a small
file is written under the location, read back and deleted. JAX is not imported.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import uuid

from etils import epath

from mtp_jax import storage

PROBE_DIR = '.mtp_jax_probe'


def _round_trip(location: str) -> None:
  """Writes, reads back and deletes one small file under `location`; OSError (or the file
  system's own error) when any of the three fails or the bytes differ."""
  name = f'{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}'
  payload = f'mtp_jax storage probe {name}\n'
  path = epath.Path(location) / PROBE_DIR / name
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(payload)
  try:
    if path.read_text() != payload:
      raise OSError(f'{path} read back different bytes')
  finally:
    path.unlink()
  if not storage.is_url(location):
    try:  # leave no empty probe folder behind on a local or mounted path
      os.rmdir(path.parent)
    except OSError:
      pass


def _local_target(path: str) -> str | None:
  """The directory a local checkpoint_dir would be created in: itself or its nearest
  existing parent; None when that is not a directory."""
  path = os.path.abspath(os.path.expanduser(path))
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return path if os.path.isdir(path) else None


def check(config, workdir: str) -> int:
  """Probes train.checkpoint_dir (default: WORKDIR/checkpoints, tried through the nearest
  directory that exists, nothing created) and a URL compilation cache from this host. One
  line on stdout when reachable (0), one `error:` line on stderr when not (2)."""
  host = socket.gethostname()
  for name in ('gcsfs', 'fsspec'):  # each retry would print a traceback before our line
    logging.getLogger(name).setLevel(logging.CRITICAL)
  named = config.train.checkpoint_dir or os.path.join(workdir, 'checkpoints')
  places = [('train.checkpoint_dir', named)]
  if storage.is_url(config.train.compilation_cache_dir):
    places.append(('train.compilation_cache_dir', config.train.compilation_cache_dir))
  for field, location in places:
    install = storage.missing_backend(location)
    if install:
      print(f'error: {field} {location!r} needs {install} (on {host})', file=sys.stderr)
      return 2
    target = location if storage.is_url(location) else _local_target(location)
    if target is None:
      print(f'error: {field} {location!r} cannot be created on {host}: a parent is a file',
            file=sys.stderr)
      return 2
    try:
      _round_trip(target)
    except Exception as e:  # pylint: disable=broad-except  (any file system's own errors)
      reason = ' '.join(str(e).split())[:300] or type(e).__name__
      print(f'error: {field} {location!r} cannot be written and read back on {host}: '
            f'{type(e).__name__}: {reason}', file=sys.stderr)
      return 2
  print(f'storage ok on {host}: ' + ', '.join(f'{f} {loc}' for f, loc in places))
  return 0
