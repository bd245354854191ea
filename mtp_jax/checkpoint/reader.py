"""Read-only access to a run's checkpoints, verified, with a fallback past broken steps.

`CheckpointReader` is what everything that only reads uses (decode, eval, export,
notebooks, `--init_from`). It creates, cleans, moves and deletes nothing, so it is safe on
a run that is training. Nothing here unpickles: arrays come from TensorStore, the rest
from JSON.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from mtp_jax.checkpoint.integrity import fingerprint, verify
from mtp_jax.checkpoint.store import (
  CheckpointError,
  Restored,
  draining_loops,
  is_url,
  isdir,
  listdir,
  location,
  needs_package,
  short,
)
from mtp_jax.config.base import base_config
from mtp_jax.data import tokenizers
from mtp_jax.errors import RequestError


class _ClosedLoopFilter(logging.Filter):
  """Drops asyncio's report of a callback that ran after its event loop closed.

  A read abandoned by the fallback above (a step the trainer removed mid-read) can leave
  TensorStore callbacks that fire once orbax has closed the loop it ran them on; asyncio
  then logs 'RuntimeError: Event loop is closed' with a traceback, although nothing is
  left to deliver the result to. Any other asyncio error is still logged.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (isinstance(exc, RuntimeError) and 'Event loop is closed' in str(exc))


_CLOSED_LOOP_FILTER = _ClosedLoopFilter()
logging.getLogger('asyncio').addFilter(_CLOSED_LOOP_FILTER)


def _order_key(path: tuple) -> tuple:
  """Sorts orbax's string paths as nnx orders the State: numeric keys as numbers ('10' > '9')."""
  return tuple((0, int(p), '') if p.isdigit() else (1, 0, p) for p in path)


def warn(text: str) -> None:
  print(f'warning: {text}', file=sys.stderr, flush=True)


_COMMIT_FILE = 'commit_success.txt'  # orbax's marker of a finished step where it cannot rename


class CheckpointReader:
  """Read-only access to `<workdir>/checkpoints`: what decode, eval, notebooks, --init_from
  and scripts/chaos_train.py use, never the trainer's Checkpointer.

  It builds no orbax CheckpointManager (whose start-up removes `.orbax-checkpoint-tmp`
  directories: the save a live trainer is writing at that moment), creates no directory
  and never deletes or moves anything; only the trainer quarantines a broken step. A
  step is a finished (renamed) step directory. What it restores is checked against the
  fingerprints recorded at save time, since orbax restores flipped bytes silently. A step
  that vanishes while it is read was removed by the trainer (max_to_keep): the newest
  steps are listed again, not reported as broken.
  """

  _RETRIES = 20  # re-listings after steps vanished under a reader (max_to_keep)

  def __init__(self, directory: str, notify=warn):
    self.directory = location(directory)  # a URL (train.checkpoint_dir) as it is
    needs_package(self.directory)
    self.notify = notify

  def steps(self) -> list[int]:
    """Finished steps, ascending."""
    # On gs:// orbax renames nothing: a step is finished once it holds its commit file.
    def finished(n: str) -> bool:
      return (not self.directory.startswith('gs://')
              or epath.Path(f'{self.directory}/{n}/{_COMMIT_FILE}').exists())

    return sorted(int(n) for n in listdir(self.directory)
                  if n.isdigit() and isdir(f'{self.directory}/{n}') and finished(n))

  def _dir(self, step: int, item: str = '') -> str:
    return f'{self.directory.rstrip("/")}/{step}' + (f'/{item}' if item else '')

  def read_meta(self, step: int) -> dict:
    """Step's JSON meta (the config, fingerprints); ValueError / OSError when unreadable."""
    path = self._dir(step, 'meta/metadata')
    with (epath.Path(path).open('r') if is_url(path) else open(path, encoding='utf-8')) as f:
      meta = json.load(f)
    if not isinstance(meta, dict):
      raise ValueError(f'meta of step {step} is not a JSON object')
    return meta

  def restore(self, step: int, abstract_state):
    """(state, meta) of `step` onto `abstract_state`'s shardings, verified; raises if broken."""
    meta = self.read_meta(step)
    state = restore_item(self._dir(step, 'state'), ocp.StandardCheckpointHandler(),
                          ocp.args.StandardRestore(abstract_state))
    verify(step, state, meta)
    return state, meta

  def newest_first(self, action, step: int | None = None, newest: int | None = None):
    """(step, action(step), broken) for the newest step where action(step) succeeds.

    step: exactly that one (broken: CheckpointError). newest: no step above it, unless
    a step vanished under the reader. The broken steps skipped are reported in one
    warning line; none is moved or deleted.
    """
    if step is not None:
      try:
        return step, action(step), []
      except Exception as e:  # pylint: disable=broad-except
        removed = not isdir(self._dir(step)) or (
            _looks_removed(e) and any(s > step for s in self.steps()))
        why = ('was removed while it was read (the trainer keeps max_to_keep; the newest '
               'steps are kept)' if removed else f'is broken ({short(e)})')
        raise CheckpointError(f'checkpoint {step} in {self.directory} {why}') from e
    broken = {}
    for _ in range(self._RETRIES):
      steps = self.steps()
      # Every step up to `newest` gone: removed by the trainer since it was chosen.
      if newest is not None and not [s for s in steps if s <= newest]:
        newest = None
      broken, removing = {}, False
      for s in reversed(steps):
        if newest is not None and s > newest:
          continue
        try:
          out = action(s)
        except Exception as e:  # pylint: disable=broad-except
          broken[s] = short(e)
          removing |= _looks_removed(e) or not isdir(self._dir(s))
          continue
        broken = {b: r for b, r in broken.items() if isdir(self._dir(b))}
        if broken:
          self.notify('; '.join(f'checkpoint {b} in {self.directory} is broken ({r})'
                                for b, r in broken.items())
                      + f'; using step {s} instead (nothing was changed)')
        return s, out, list(broken.items())
      # Every step failed. A step the trainer is removing (max_to_keep) fails while its
      # files go, its directory last, and by then the trainer has saved a newer one of the
      # same config (it refuses another): list again a little later, until only steps that
      # stay on disk and fail for another reason than a missing file are left.
      if not removing and self.steps() == steps:
        break
      time.sleep(0.05)
    broken = {b: r for b, r in broken.items() if isdir(self._dir(b))}
    if not broken:
      raise CheckpointError(f'no checkpoint in {self.directory} could be read: each was '
                            'removed by the trainer while it was read; try again')
    raise CheckpointError(
        f'no checkpoint in {self.directory} can be read: '
        + '; '.join(f'step {s}: {r}' for s, r in broken.items()) + '. Nothing was changed.')

  def newest_meta(self, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of `step`, else of the newest step whose meta reads."""
    s, meta, _ = self.newest_first(self.read_meta, step, None)
    return s, meta

  def restore_newest_good(self, abstract_state, step: int | None = None,
                          newest: int | None = None) -> Restored:
    """The newest step (not above `newest`) that restores and verifies, or exactly `step`."""
    s, (state, meta), broken = self.newest_first(
        lambda s: self.restore(s, abstract_state), step, newest)
    return Restored(state, meta, s, broken, None)

  def tree_order(self, step: int) -> list[tuple]:
    """Every array's path in the order of the recorded fingerprint (no array is read)."""
    # The handler, not a PyTreeCheckpointer: that one also wants (and logs the lack of) a
    # step-level metadata file inside the item directory.
    handler = ocp.PyTreeCheckpointHandler()
    with draining_loops():
      try:
        tree = handler.metadata(epath.Path(self._dir(step, 'state')))
      finally:
        handler.close()
    tree = getattr(tree, 'tree', tree)
    return sorted(leaf_paths(tree), key=_order_key)

  def verify_paths(self, step: int, meta: dict, loaded: dict) -> None:
    """ValueError unless every {path: array} of `loaded` matches its recorded fingerprint
    (a partial restore: only what was read is checked)."""
    want = meta.get('fingerprint')
    if want is None:
      return  # written before fingerprints were recorded
    order = self.tree_order(step)
    if len(order) != len(want):
      raise ValueError(f'step {step}: {len(order)} arrays on disk but {len(want)} fingerprints')
    index = {p: i for i, p in enumerate(order)}
    paths = list(loaded)
    got = fingerprint([loaded[p] for p in paths])
    bad = [p for p, g in zip(paths, got) if want[index[p]] != g]
    if bad:
      raise ValueError(f'step {step}: restored arrays differ from the saved ones '
                       f'({len(bad)} corrupted, e.g. {", ".join("/".join(p) for p in bad[:3])})')

  def read_arrays(self, step: int) -> list[np.ndarray]:
    """Every array of `step` in fingerprint order, as saved and verified; no model is built."""
    meta = self.read_meta(step)
    tree = _restore_as_numpy(self._dir(step, 'state'))
    loaded = leaf_paths(tree)
    self.verify_paths(step, meta, loaded)
    return [np.asarray(loaded[p]) for p in sorted(loaded, key=_order_key)]


def _looks_removed(e: BaseException) -> bool:
  """A read that failed on a missing file (a step being removed, or a file deleted)."""
  while e is not None:
    if isinstance(e, FileNotFoundError) or 'NOT_FOUND' in str(e):
      return True
    e = e.__cause__ or e.__context__
  return False


def _restore_as_numpy(path: str):
  """An item directory's whole tree as host numpy arrays, whatever devices saved it.

  Without restore args orbax rebuilds each array on the shardings in the checkpoint's
  sharding file, which a process with fewer devices cannot (a 2-device trainer's step
  read from a 1-device process: 'sharding ... should be specified ... Got None')."""
  handler = ocp.PyTreeCheckpointHandler()
  with draining_loops():  # the metadata read runs on an orbax loop too
    try:
      meta = handler.metadata(epath.Path(path))
      tree = getattr(meta, 'tree', meta)
      args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree,
                          is_leaf=lambda x: not isinstance(x, (dict, list, tuple)))
      return handler.restore(epath.Path(path), args=ocp.args.PyTreeRestore(restore_args=args))
    finally:
      handler.close()


def restore_item(path: str, handler, args):
  """One item directory restored through its handler alone: a Checkpointer would also look
  for (and log the lack of) step-level metadata inside the item directory."""
  with draining_loops():
    try:
      return handler.restore(epath.Path(path), args=args)
    finally:
      handler.close()


def _reader_of(workdir: str, notify=warn) -> CheckpointReader:
  """The reader of a training workdir; RequestError naming what is missing (creates nothing)."""
  if not os.path.exists(workdir):
    raise RequestError(f'--workdir {workdir!r} does not exist')
  if not os.path.isdir(workdir):
    raise RequestError(f'--workdir {workdir!r} is not a directory')
  directory = checkpoint_dir_of(workdir)
  needs_package(directory)
  if not isdir(directory):
    where = ('no checkpoints/ directory' if directory == os.path.join(
        os.path.abspath(workdir), 'checkpoints') else f'no checkpoints in {directory}')
    raise RequestError(f'--workdir {workdir!r} has {where} (train it first)')
  return CheckpointReader(directory, notify)


def checkpoint_dir_of(workdir: str) -> str:
  """Where a workdir's checkpoints are: the train.checkpoint_dir its config.json names (a
  URL such as gs://bucket/run, or a local path), else `<workdir>/checkpoints`."""
  try:
    with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
      named = json.load(f).get('train', {}).get('checkpoint_dir', '')
  except (OSError, ValueError, AttributeError):
    named = ''
  return location(named) if named else os.path.join(os.path.abspath(workdir), 'checkpoints')


def load_workdir(workdir: str, step: int | None = None, notify=warn):
  """(config, step) of checkpoint `step` (default: the newest whose meta reads) of a workdir.

  The saved config over base_config(): a run saved before a field existed reads as
  having that field's default. RequestError if there is no checkpoint, CheckpointError
  (one line) if `step` or every step is broken. Read-only (CheckpointReader).
  """
  reader = _reader_of(workdir, notify)
  steps = reader.steps()
  if not steps:
    raise RequestError(f'--workdir {workdir!r} holds no checkpoint (train it first)')
  if step is not None and step not in steps:
    raise RequestError(f'--step {step}: --workdir {workdir!r} has checkpoints of steps '
                       f'{steps} only')
  step, meta = reader.newest_meta(step)
  saved = meta.get('config')
  if not saved:
    path = os.path.join(workdir, 'config.json')
    if not os.path.isfile(path):
      raise RequestError(f'checkpoint {step} in {workdir!r} has no saved config')
    with open(path) as f:
      saved = json.load(f)
  config = base_config()
  config.update(saved)
  return tokenizers.resolve_vocab_size(config), step


def restore_state(workdir: str, step: int, abstract_state, *, fallback: bool = False,
                  notify=warn) -> Restored:
  """Checkpoint `step` of a workdir onto `abstract_state`'s shardings, verified.

  fallback: when `step` is broken, the newest older step that is intact (one warning
  line); otherwise a broken `step` is a one-line CheckpointError. Read-only.
  """
  reader = _reader_of(workdir, notify)
  if fallback:
    return reader.restore_newest_good(abstract_state, newest=step)
  return reader.restore_newest_good(abstract_state, step=step)


def read_state_arrays(directory: str, step: int) -> list[np.ndarray]:
  """Every array of checkpoint `step` in a checkpoints directory, in tree order, as saved
  and verified against its fingerprint. Needs no template (no model is built): for
  comparing two runs bit for bit. Read-only."""
  return CheckpointReader(directory).read_arrays(step)


def path_names(path) -> tuple[str, ...]:
  """A jax tree path as the tuple of its key names: ('0', 'embed', 'embedding', 'value').

  The one spelling of a parameter's path, shared by checkpoints and the HF interop."""
  return tuple(_key_name(k) for k in path)


def _key_name(k) -> str:
  """A DictKey's key, a SequenceKey's index, a GetAttrKey's name."""
  for attr in ('key', 'idx', 'name'):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def leaf_paths(tree) -> dict:
  """{('0', 'embed', 'embedding', 'value'): leaf, ...}: the names orbax saves under."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_names(p): x for p, x in flat}


def nested(paths: dict) -> dict:
  out = {}
  for path, leaf in paths.items():
    node = out
    for part in path[:-1]:
      node = node.setdefault(part, {})
    node[path[-1]] = leaf
  return out
