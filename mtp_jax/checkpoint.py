"""Orbax checkpoints: model + optimizer state, data-iterator state and run metadata together.

Failure model (issue 5):
- A save interrupted by a kill leaves `<step>.orbax-checkpoint-tmp*`; orbax never lists it
  as a step, and the next Checkpointer reports and removes it.
- Every save records in its JSON `meta` a fingerprint of the state and a hash of the data
  iterator state. Orbax restores a checkpoint whose array bytes were flipped without
  complaint (compressed chunks are not checksummed), so `restore_latest_good` checks both
  and falls back to the newest checkpoint that is intact, moving broken ones aside.
- Nothing here unpickles: arrays come from TensorStore, everything else from JSON.

Every checkpoint the package opens is opened here, by one writer and one reader:
- `Checkpointer`: the trainer's (orbax CheckpointManager: saves, removes incomplete
  saves at start-up, keeps max_to_keep, quarantines broken steps). Only a training job
  that holds the workdir's lock (resilience.WorkdirLock, taken by its process 0)
  builds one, in each of its processes.
- `CheckpointReader`: everything that only reads (decode, eval, notebooks, `--init_from`,
  `load_workdir`, `restore_state`, `read_state_arrays`). It creates, cleans, moves and
  deletes nothing, so it is safe on a run that is training; it verifies fingerprints and
  falls back past broken steps with one warning line.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from mtp_jax import config_lib
from mtp_jax.data import tokenizers
from mtp_jax.errors import RequestError
from mtp_jax.errors import ConfigError

# Fields whose change makes an old checkpoint unusable for this run.
_SHAPE_FIELDS = ('model', 'data.tokenizer', 'data.spm_model', 'data.seq_len')
TMP_MARKER = '.orbax-checkpoint-tmp'
QUARANTINE_DIR = 'corrupt_checkpoints'  # next to `checkpoints/`: broken steps moved aside


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be written or read; the message is one line."""
  exit_code = 2


def short(e: BaseException, limit: int = 300) -> str:
  """The first line of an exception (TensorStore errors run to pages), for one-line reports."""
  text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  text = text if len(text) <= limit else text[:limit] + '...'
  return f'{type(e).__name__}: {text}'


def _is_disk_full(e: BaseException) -> bool:
  text = str(e)
  return (getattr(e, 'errno', None) == 28 or 'No space left on device' in text
          or "os_error_code='28'" in text)


@dataclasses.dataclass
class Restored:
  """What restore_latest_good found: the state, its meta and the steps it had to skip."""
  state: object
  meta: dict
  step: int
  broken: list  # [(step, reason)] newer checkpoints that failed to load, newest first
  moved_to: str | None  # where the broken ones were moved


class Checkpointer:
  """A CheckpointManager over `<workdir>/checkpoints` saving {state, data, meta} items."""

  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    # Reported once by the trainer; orbax deletes them (cleanup_tmp_directories).
    self.incomplete = sorted(n for n in _listdir(self.directory) if TMP_MARKER in n)
    self._options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True,
        cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(self.directory, options=self._options)
    self._in_flight: int | None = None  # step of an async save not yet known to be complete
    self._failed = False  # orbax re-raises a failed save on every later wait

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state, data_iter=None, meta: dict | None = None,
           force: bool = False) -> bool:
    """Starts a (possibly asynchronous) save; CheckpointError if this or the previous one failed."""
    self.wait()  # an error of the previous async save belongs to that step, not this one
    items = {'state': ocp.args.StandardSave(state),
             'meta': ocp.args.JsonSave(meta or {})}
    if data_iter is not None:
      items['data'] = grain.checkpoint.CheckpointSave(data_iter)
    if self._failed:
      raise CheckpointError(f'not saving step {step}: an earlier save in {self.directory} failed')
    try:
      saved = self.manager.save(step, args=ocp.args.Composite(**items), force=force)
    except Exception as e:  # pylint: disable=broad-except
      self._failed = True
      raise self._save_error(step, e) from e
    self._in_flight = step
    return saved

  def _save_error(self, step: int, e: BaseException) -> CheckpointError:
    what = 'disk full: ' if _is_disk_full(e) else ''
    return CheckpointError(
        f'{what}could not save the checkpoint of step {step} in {self.directory} ({short(e)}); '
        'earlier checkpoints are intact, and rerunning the same command resumes from the '
        'latest one once the problem is fixed')

  def read_meta(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    meta = out['meta']
    if not isinstance(meta, dict):
      raise ValueError(f'meta of step {step} is not a JSON object')
    return dict(meta)

  def restore(self, step: int, abstract_state, data_iter=None):
    """Restores onto the shardings carried by `abstract_state` (ShapeDtypeStructs)."""
    items = {'state': ocp.args.StandardRestore(abstract_state), 'meta': ocp.args.JsonRestore()}
    if data_iter is not None:
      items['data'] = grain.checkpoint.CheckpointRestore(data_iter)
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    return out['state'], dict(out['meta'])

  def restore_latest_good(self, abstract_state, data_iter=None, check_meta=None) -> Restored | None:
    """The newest checkpoint that loads and matches its recorded fingerprints.

    check_meta(meta) may raise ConfigError (an incompatible run: never a fallback).
    Broken newer checkpoints are moved to `<workdir>/corrupt_checkpoints/` so later
    saves of those steps cannot collide with them; when none is good nothing is moved
    and CheckpointError lists why each failed. None when there is no checkpoint at all.
    """
    steps = sorted(self.all_steps(), reverse=True)
    if not steps:
      return None
    broken = []
    for step in steps:
      try:
        meta = self.read_meta(step)
        if check_meta is not None:
          check_meta(meta)
        state, meta = self.restore(step, abstract_state, data_iter)
        verify(step, state, meta, data_iter)
      except ConfigError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        broken.append((step, short(e)))
        continue
      moved = self._quarantine([s for s, _ in broken]) if broken else None
      return Restored(state, meta, step, broken, moved)
    raise CheckpointError(
        f'no checkpoint in {self.directory} can be restored: '
        + '; '.join(f'step {s}: {r}' for s, r in broken)
        + '. Nothing was changed; move them away (or use a new --workdir) to start afresh.')

  def _quarantine(self, steps: list[int]) -> str:
    """Moves broken step directories out of the manager's sight (never deletes them)."""
    dest = os.path.join(os.path.dirname(self.directory), QUARANTINE_DIR)
    if jax.process_index() == 0:
      os.makedirs(dest, exist_ok=True)
      stamp = time.strftime('%Y%m%d-%H%M%S')
      for step in steps:
        src = os.path.join(self.directory, str(step))
        if os.path.exists(src):
          shutil.move(src, os.path.join(dest, f'{step}-{stamp}'))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices('mtp_jax_checkpoint_quarantine')
    self.manager.reload()
    return dest

  def wait(self):
    """Blocks until the in-flight save is on disk; CheckpointError naming its step if it failed."""
    if self._failed:
      return
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      step, self._in_flight, self._failed = self._in_flight, None, True
      raise self._save_error(step if step is not None else -1, e) from e
    self._in_flight = None

  def close(self):
    try:
      self.wait()
    finally:
      try:
        self.manager.close()
      except Exception:  # pylint: disable=broad-except
        if not self._failed:
          raise


def _listdir(path: str) -> list[str]:
  try:
    return os.listdir(path)
  except FileNotFoundError:
    return []


# -- integrity ---------------------------------------------------------------------------
def _as_uint32(x):
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)


@jax.jit
def _leaf_hashes(leaves):
  """One uint32 per array: a position-dependent mix of its bits, summed (order-free, exact)."""
  out = []
  for x in leaves:
    u = _as_uint32(jnp.asarray(x))
    idx = jnp.zeros(u.shape, jnp.uint32)  # flat index without reshaping a sharded array
    stride = 1
    for axis in reversed(range(u.ndim)):
      idx = idx + jax.lax.broadcasted_iota(jnp.uint32, u.shape, axis) * jnp.uint32(stride)
      stride *= u.shape[axis]
    h = (u ^ (idx * jnp.uint32(0x9E3779B9))) * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    out.append(jnp.sum(h, dtype=jnp.uint32))
  return jnp.stack(out) if out else jnp.zeros((0,), jnp.uint32)


def fingerprint(state) -> list[int]:
  """A uint32 per leaf of `state`; recorded in meta at save, compared at restore."""
  return [int(v) for v in np.asarray(jax.device_get(_leaf_hashes(jax.tree.leaves(state))))]


def data_state_hash(data_iter) -> str | None:
  if data_iter is None or not hasattr(data_iter, 'get_state'):
    return None
  state = data_iter.get_state()
  blob = state if isinstance(state, bytes) else json.dumps(state, sort_keys=True).encode()
  return hashlib.sha256(blob).hexdigest()


def _per_process_hashes(digest: str | None) -> list[str] | None:
  """Every process's data-state digest, in process order (meta is written by process 0)."""
  if digest is None:
    return None
  if jax.process_count() == 1:
    return [digest]
  mine = np.frombuffer(bytes.fromhex(digest), np.uint8)
  every = np.asarray(multihost_utils.process_allgather(mine))
  return [bytes(row).hex() for row in every.reshape(jax.process_count(), -1)]


def integrity_meta(state, data_iter=None) -> dict:
  return {'fingerprint': fingerprint(state),
          'data_sha256': _per_process_hashes(data_state_hash(data_iter))}


def verify(step: int, state, meta: dict, data_iter=None) -> None:
  """ValueError when the restored state or data position differs from what was saved."""
  want = meta.get('fingerprint')
  if want is not None:
    got = fingerprint(state)
    if got != want:
      bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
      paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
      names = ', '.join(paths[i] for i in bad[:3]) if len(got) == len(want) else 'tree shape'
      raise ValueError(f'step {step}: restored arrays differ from the saved ones '
                       f'({len(bad) or "all"} corrupted, e.g. {names})')
  want_data = meta.get('data_sha256')
  if isinstance(want_data, list):  # one digest per process
    want_data = want_data[jax.process_index()] if len(want_data) == jax.process_count() else None
  if want_data is not None and data_iter is not None and data_state_hash(data_iter) != want_data:
    raise ValueError(f'step {step}: restored data-iterator state differs from the saved one')


# -- compatibility ---------------------------------------------------------------------------
def _lookup(d: dict, dotted: str):
  for part in dotted.split('.'):
    if not isinstance(d, dict) or part not in d:
      return None
    d = d[part]
  return d


# Training-only model switches that may change between runs of the same model.
_TRAINING_ONLY = {'remat', 'scan_layers', 'loss_chunk', 'dtype', 'mtp.lambda_values',
                  'mtp.lambda_boundaries', 'mtp.weights', 'mtp.detach_trunk',
                  'mtp.stop_gradient'}
# Not here: mtp.freeze_trunk changes the optimizer state's tree, so resuming with it
# switched is an incompatible config (a clear error, not a failed restore that would
# send good checkpoints to corrupt_checkpoints/).


def config_diffs(saved_config: dict, config_dict: dict, ignore=()) -> list[str]:
  """'field: checkpoint X vs config Y' for every shape-relevant difference."""
  diffs = []
  for field in _SHAPE_FIELDS:
    old, new = _lookup(saved_config, field), _lookup(config_dict, field)
    if field == 'model' and isinstance(old, dict) and isinstance(new, dict):
      # A field added after the checkpoint was written holds its default there.
      default = _flatten(_norm(config_lib.base_config().model.to_dict()))
      fo, fn = {**default, **_flatten(old)}, {**default, **_flatten(new)}
      skip = _TRAINING_ONLY | set(ignore)
      diffs += [f'model.{k}: checkpoint {fo.get(k)!r} vs config {fn.get(k)!r}'
                for k in sorted(set(fo) | set(fn))
                if k not in skip and _norm(fo.get(k)) != _norm(fn.get(k))
                and not (k == 'vocab_size' and 0 in (fo.get(k), fn.get(k)))]
      # vocab_size 0 means the tokenizer's size; the tokenizer fields are compared below.
    elif _norm(old) != _norm(new):
      diffs.append(f'{field}: checkpoint {old!r} vs config {new!r}')
  return diffs


def check_compatible(saved_config: dict, config_dict: dict, directory: str) -> None:
  """Raises ConfigError when a checkpoint was written by a config of another shape."""
  diffs = config_diffs(saved_config, config_dict)
  if diffs:
    raise ConfigError(
        f'the workdir holds a checkpoint of an incompatible config ({directory}): '
        + '; '.join(diffs) + '. Use a new --workdir (with --init_from=<this workdir> to '
        'start from its trunk, embedding and head).')


def _flatten(d: dict, prefix: str = '') -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


def _norm(v):
  """Lists and tuples compare equal after a JSON round trip."""
  return json.loads(json.dumps(v))


def abstract_like(state, shardings):
  """ShapeDtypeStructs with target shardings: the restore template."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)


# -- reading a run: read-only, verified, with fallback ---------------------------------------
def _order_key(path: tuple) -> tuple:
  """Sorts orbax's string paths as nnx orders the State: numeric keys as numbers ('10' > '9')."""
  return tuple((0, int(p), '') if p.isdigit() else (1, 0, p) for p in path)


def warn(text: str) -> None:
  print(f'warning: {text}', file=sys.stderr, flush=True)


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
    self.directory = os.path.abspath(directory)
    self.notify = notify

  def steps(self) -> list[int]:
    """Finished steps, ascending."""
    return sorted(int(n) for n in _listdir(self.directory)
                  if n.isdigit() and os.path.isdir(os.path.join(self.directory, n)))

  def _dir(self, step: int, item: str = '') -> str:
    return os.path.join(self.directory, str(step), item)

  def read_meta(self, step: int) -> dict:
    """Step's JSON meta (the config, fingerprints); ValueError / OSError when unreadable."""
    with open(self._dir(step, os.path.join('meta', 'metadata')), encoding='utf-8') as f:
      meta = json.load(f)
    if not isinstance(meta, dict):
      raise ValueError(f'meta of step {step} is not a JSON object')
    return meta

  def restore(self, step: int, abstract_state):
    """(state, meta) of `step` onto `abstract_state`'s shardings, verified; raises if broken."""
    meta = self.read_meta(step)
    state = _restore_item(self._dir(step, 'state'), ocp.StandardCheckpointHandler(),
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
        why = ('was removed while it was read (the trainer keeps max_to_keep)'
               if not os.path.isdir(self._dir(step)) else f'is broken ({short(e)})')
        raise CheckpointError(f'checkpoint {step} in {self.directory} {why}') from e
    broken = {}
    for _ in range(self._RETRIES):
      steps = self.steps()
      # Every step up to `newest` gone: removed by the trainer since it was chosen.
      vanished = newest is not None and not [s for s in steps if s <= newest]
      if vanished:
        newest = None
      for s in reversed(steps):
        if s in broken or (newest is not None and s > newest):
          continue
        try:
          out = action(s)
        except Exception as e:  # pylint: disable=broad-except
          if not os.path.isdir(self._dir(s)):
            # The trainer removed it (max_to_keep) and has saved newer steps since, of
            # the same config (it refuses another): list again, the newest are welcome.
            vanished, newest = True, None
            break
          broken[s] = short(e)
          continue
        if broken:
          self.notify('; '.join(f'checkpoint {b} in {self.directory} is broken ({r})'
                                for b, r in broken.items())
                      + f'; using step {s} instead (nothing was changed)')
        return s, out, list(broken.items())
      if not vanished:
        break
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
    try:
      tree = handler.metadata(epath.Path(self._dir(step, 'state')))
    finally:
      handler.close()
    tree = getattr(tree, 'tree', tree)
    return sorted(_paths(tree), key=_order_key)

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
    loaded = _paths(tree)
    self.verify_paths(step, meta, loaded)
    return [np.asarray(loaded[p]) for p in sorted(loaded, key=_order_key)]


def _restore_as_numpy(path: str):
  """An item directory's whole tree as host numpy arrays, whatever devices saved it.

  Without restore args orbax rebuilds each array on the shardings in the checkpoint's
  sharding file, which a process with fewer devices cannot (a 2-device trainer's step
  read from a 1-device process: 'sharding ... should be specified ... Got None')."""
  handler = ocp.PyTreeCheckpointHandler()
  try:
    meta = handler.metadata(epath.Path(path))
    tree = getattr(meta, 'tree', meta)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree,
                        is_leaf=lambda x: not isinstance(x, (dict, list, tuple)))
    return handler.restore(epath.Path(path), args=ocp.args.PyTreeRestore(restore_args=args))
  finally:
    handler.close()


def _restore_item(path: str, handler, args):
  """One item directory restored through its handler alone: a Checkpointer would also look
  for (and log the lack of) step-level metadata inside the item directory."""
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
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(directory):
    raise RequestError(f'--workdir {workdir!r} has no checkpoints/ directory (train it first)')
  return CheckpointReader(directory, notify)


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
  config = config_lib.base_config()
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


# -- partial restore: init from another run ------------------------------------------------
def resolve_checkpoint(path: str) -> tuple[str, int | None]:
  """(checkpoints directory, step or None for its latest) from a workdir, a checkpoints
  directory or one step directory."""
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise ConfigError(f'--init_from {path!r} is not a directory (give a workdir, its '
                      'checkpoints/ directory or one step directory)')
  if os.path.isdir(os.path.join(path, 'checkpoints')):
    return os.path.join(path, 'checkpoints'), None
  base = os.path.basename(path)
  if base.isdigit() and os.path.isdir(os.path.join(path, 'state')):
    return os.path.dirname(path), int(base)
  if any(n.isdigit() for n in os.listdir(path)):
    return path, None
  raise ConfigError(f'--init_from {path!r} holds no checkpoint')


def _key_str(k) -> str:
  for attr in ('key', 'idx', 'name'):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _paths(tree) -> dict:
  """{('0', 'embed', 'embedding', 'value'): leaf, ...}: the names orbax saves under."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(_key_str(k) for k in p): x for p, x in flat}


def _nested(paths: dict) -> dict:
  out = {}
  for path, leaf in paths.items():
    node = out
    for part in path[:-1]:
      node = node.setdefault(part, {})
    node[path[-1]] = leaf
  return out


def check_init_from(source: str, config, config_dict: dict,
                    notify=warn) -> tuple[str, int, int]:
  """(checkpoints directory, step, MTP depths to load) once the source's trunk is known to
  fit this config; ConfigError / CheckpointError otherwise. Compiles nothing; read-only
  (the source may be a run that is training right now). notify: the broken steps skipped."""
  directory, step = resolve_checkpoint(source)
  reader = CheckpointReader(directory, notify)
  steps = reader.steps()
  if not steps:
    raise ConfigError(f'--init_from {source!r}: no checkpoint in {directory}')
  if step is not None and step not in steps:
    raise ConfigError(f'--init_from {source!r}: no step {step} in {directory} (has {steps})')
  try:
    step, meta = reader.newest_meta(step)
  except CheckpointError as e:
    raise CheckpointError(f'--init_from {source!r}: {e}') from e
  saved = meta.get('config', {})
  # Only the optimizer differs with freeze_trunk, and it starts fresh here anyway.
  diffs = config_diffs(saved, config_dict,
                       ignore={'mtp.depth', 'mtp.kind', 'mtp.freeze_trunk'})
  if diffs:
    raise ConfigError(f'--init_from {directory}/{step}: the trunk differs from this config: '
                      + '; '.join(diffs))
  same_kind = saved['model']['mtp']['kind'] == config.model.mtp.kind
  keep = min(int(saved['model']['mtp']['depth']), config.model.mtp.depth) if same_kind else 0
  return directory, step, keep


def init_from(source: str, config, config_dict: dict, state, abstract_state, notify=print):
  """`state` with trunk, embedding/head and matching MTP depths loaded from `source`.

  The model must agree with the source in everything except model.mtp (depth, kind,
  weights); depths 1..min(D_old, D_new) are loaded when the kind is the same, deeper
  ones keep their fresh initialisation. Optimizer state, step and data position start
  fresh: this begins a new run. What is loaded is checked against the source's
  fingerprints; a broken newest step falls back to an older one (a given step
  directory does not). Returns (state, description).
  """
  def report(text):
    notify(f'WARNING: --init_from: {text}')

  directory, step, keep = check_init_from(source, config, config_dict, report)
  explicit = resolve_checkpoint(source)[1] is not None

  def wanted(path):  # the model half; MTP depths only up to `keep`
    return path[0] == '0' and (path[1] != 'mtp' or int(path[2]) < keep)

  target = _nested({p: x for p, x in _paths(abstract_state).items() if wanted(p)})
  restore_args = jax.tree.map(
      lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype),
      target)
  reader = CheckpointReader(directory, report)

  def load(s: int) -> dict:
    meta = reader.read_meta(s)
    restored = _restore_item(
        os.path.join(directory, str(s), 'state'), ocp.PyTreeCheckpointHandler(),
        ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True))
    loaded = _paths(restored)
    reader.verify_paths(s, meta, loaded)
    return loaded

  try:
    step, loaded, _ = reader.newest_first(load, step=step if explicit else None,
                                          newest=None if explicit else step)
  except CheckpointError as e:
    raise CheckpointError(f'--init_from {source}: cannot load the trunk ({e})') from e
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  state = jax.tree_util.tree_unflatten(treedef, [
      loaded.get(tuple(_key_str(k) for k in p), x) for p, x in flat])
  fresh = config.model.mtp.depth - keep
  desc = (f'Initialised from {directory}/{step}: trunk, embedding and head'
          + (f' + MTP depths 1..{keep}' if keep else '')
          + f' loaded ({len(loaded)} arrays); '
          + (f'{fresh} new MTP depth(s) freshly initialised; ' if fresh else '')
          + 'optimizer, step and data start fresh.')
  notify(desc)
  return state, desc
