"""The trainer's checkpoint writer: model + optimizer, data-iterator state and run meta.

`Checkpointer` wraps orbax's CheckpointManager. Only a training job that holds the
workdir's lock builds one. A save interrupted by a kill leaves
`<step>.orbax-checkpoint-tmp*`, which orbax never lists as a step and the next
Checkpointer removes; a broken step is moved aside to `corrupt_checkpoints/`.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import shutil
import threading
import time

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from mtp_jax import storage
from mtp_jax.checkpoint.integrity import verify
from mtp_jax.errors import ConfigError

TMP_MARKER = '.orbax-checkpoint-tmp'
QUARANTINE_DIR = 'corrupt_checkpoints'  # next to `checkpoints/`: broken steps moved aside


class _DrainingLoop(asyncio.SelectorEventLoop):
  """An event loop that cancels and awaits its pending tasks before it closes.

  Orbax runs each restore and each save on a fresh loop (run_until_complete, then close).
  When one array read or write fails, the ones gathered beside it are still pending at the
  close; left to the garbage collector, each is closed mid-await and orbax's
  `except BaseException` around it turns that GeneratorExit into an "Exception ignored"
  report, and a TensorStore write finishing after the close calls into a closed loop.
  Cancelled and awaited here, they end before the loop does. Their own failures repeat the
  one orbax raised (and the caller reports), so "Task exception was never retrieved" goes to
  the debug log instead of stderr.
  """

  def __init__(self):
    super().__init__()
    self.set_exception_handler(_quiet_sibling_failures)

  def call_soon_threadsafe(self, callback, *args, context=None):
    # A TensorStore read that became ready just as its task was cancelled still delivers
    # its result from a TensorStore thread; once the loop is closed nothing awaits it.
    try:
      return super().call_soon_threadsafe(callback, *args, context=context)
    except RuntimeError:
      if not self.is_closed():
        raise
      return None

  def close(self):
    if not self.is_running() and not self.is_closed():
      pending = [t for t in asyncio.all_tasks(self) if not t.done()]
      for t in pending:
        t.cancel()
      if pending:
        self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    super().close()


def _quiet_sibling_failures(loop, context):
  if context.get('message') == 'Task exception was never retrieved':
    logging.debug('checkpoint I/O task failed beside the reported one: %s',
                  context.get('exception'))
    return
  loop.default_exception_handler(context)


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):
  def new_event_loop(self):
    return _DrainingLoop()


_policy_lock = threading.Lock()
_policy_holds = [0, None]  # [holders, the policy before the first]


def _hold_draining_policy():
  with _policy_lock:
    if _policy_holds[0] == 0:
      _policy_holds[1] = asyncio.get_event_loop_policy()
      asyncio.set_event_loop_policy(_DrainingPolicy())
    _policy_holds[0] += 1


def _release_draining_policy():
  with _policy_lock:
    _policy_holds[0] -= 1
    if _policy_holds[0] == 0:
      asyncio.set_event_loop_policy(_policy_holds[1])
      _policy_holds[1] = None


@contextlib.contextmanager
def draining_loops():
  """Orbax loops created inside this block end their own pending reads and writes.

  The event loop policy is process-wide, so a save finishing in orbax's background thread
  gets a draining loop as long as some holder (this block, or an open Checkpointer) is live.
  """
  _hold_draining_policy()
  try:
    yield
  finally:
    _release_draining_policy()


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be written or read; the message is one line."""
  exit_code = 2


def is_url(path: str) -> bool:
  """gs://bucket/run and the like: handed to orbax (and epath) as it is, never made absolute."""
  return '://' in str(path)


def location(path: str) -> str:
  """A checkpoint location as orbax gets it: a URL untouched, a local path absolute."""
  return str(path) if is_url(path) else os.path.abspath(os.path.expanduser(path))


def needs_package(path: str) -> None:
  """CheckpointError naming what to install when `path` is a URL no installed package serves
  (gs:// without gcsfs), before orbax fails on it with a long traceback."""
  install = storage.missing_backend(path)
  if install:
    raise CheckpointError(f'checkpoints at {path!r} need {install}')


def isdir(path: str) -> bool:
  if not is_url(path):
    return os.path.isdir(path)
  try:
    return epath.Path(path).is_dir()
  except Exception:  # pylint: disable=broad-except  (no access, no filesystem package)
    return False


# An object's repr inside an error (TensorStore specs print whole JSON documents): its
# name is kept, the rest dropped; a repr cut off by the end of the first line goes whole.
_REPR = re.compile(r'<(?:bound method )?([\w.]+)[^<>]*>')
_CUT_REPR = re.compile(r'\s*<[^<>]*$')


def short(e: BaseException, limit: int = 300) -> str:
  """The first line of an exception (TensorStore errors run to pages), for one-line reports."""
  text = str(e).strip().splitlines()[0] if str(e).strip() else ''
  text = _CUT_REPR.sub('', _REPR.sub(r'\1', text)).rstrip(' :,({[')
  text = text or type(e).__name__
  text = text if len(text) <= limit else text[:limit] + '...'
  return f'{type(e).__name__}: {text}'


def is_disk_full(e: BaseException) -> bool:
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
  directory: str | None = None  # the checkpoint directory (tier) it came from


def _all_processes(values) -> np.ndarray:
  """Every process's int32 vector `values` (same length everywhere), one row a process."""
  values = np.asarray(values, np.int32).reshape(-1)
  if jax.process_count() == 1:
    return values[None]
  return np.asarray(multihost_utils.process_allgather(values)).reshape(jax.process_count(), -1)


def agreed(ok: bool) -> bool:
  """True when `ok` holds on every process (a collective with several processes)."""
  return bool(_all_processes([int(ok)]).min())


def common_steps(steps) -> list[int]:
  """The steps every process has (a collective with several processes), ascending."""
  steps = sorted(int(s) for s in steps)
  width = int(_all_processes([len(steps)]).max())
  rows = _all_processes(steps + [-1] * (width - len(steps))) if width else np.zeros((1, 0))
  every = set.intersection(*({int(s) for s in row if s >= 0} for row in rows))
  return sorted(every)


class Checkpointer:
  """A CheckpointManager over `<workdir>/checkpoints` saving {state, data, meta} items.

  per_process: every process writes and reads its own directory on its own disk, holding
  only the array shards it addresses (each once), its data-iterator state and the meta, with
  no coordination between processes (orbax's local-checkpoint layout: ArrayHandler without a
  primary host or replica id). A restore needs the same mesh and process count; the trainer
  takes a step only when every process has it and loaded it (`restore_latest_good`).
  """

  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True,
               per_process: bool = False):
    self.directory = location(directory)  # a URL (gs://...) reaches orbax untouched
    needs_package(self.directory)
    self.per_process = per_process
    # Reported once by the trainer; orbax deletes them (cleanup_tmp_directories).
    self.incomplete = sorted(n for n in listdir(self.directory) if TMP_MARKER in n)
    handlers = None
    extra = {}
    if per_process:
      me = jax.process_index()
      mp = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={me},
                                              barrier_sync_key_prefix=f'local_tier_{me}')
      registry = ocp.type_handlers.create_type_handler_registry(
          (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None,
                                                      use_replica_parallel=False)))
      handlers = {'state': ocp.PyTreeCheckpointHandler(multiprocessing_options=mp,
                                                        type_handler_registry=registry),
                  'meta': ocp.JsonCheckpointHandler(multiprocessing_options=mp),
                  'data': grain.checkpoint.CheckpointHandler()}
      extra = dict(multiprocessing_options=mp, enable_per_process_directory_creation=True,
                   save_root_metadata=False)
      epath.Path(self.directory).mkdir(parents=True, exist_ok=True)  # orbax leaves it to us
    self._options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=not per_process,
        cleanup_tmp_directories=True, **extra)
    self.manager = ocp.CheckpointManager(self.directory, options=self._options,
                                         item_handlers=handlers)
    # Async saves run on loops orbax makes in its own thread; they drain until close().
    _hold_draining_policy()
    self._holds_policy = True
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
    items = {'state': (ocp.args.PyTreeSave(state) if self.per_process
                       else ocp.args.StandardSave(state)),
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
    what = 'disk full: ' if is_disk_full(e) else ''
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
    if self.per_process:
      state = ocp.args.PyTreeRestore(
          abstract_state, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state))
    else:
      state = ocp.args.StandardRestore(abstract_state)
    items = {'state': state, 'meta': ocp.args.JsonRestore()}
    if data_iter is not None:
      items['data'] = grain.checkpoint.CheckpointRestore(data_iter)
    with draining_loops():
      out = self.manager.restore(step, args=ocp.args.Composite(**items))
    return out['state'], dict(out['meta'])

  def restore_latest_good(self, abstract_state, data_iter=None, check_meta=None,
                          steps=None) -> Restored | None:
    """The newest checkpoint that loads and matches its recorded fingerprints.

    check_meta(meta) may raise ConfigError (an incompatible run: never a fallback).
    Broken newer checkpoints are moved to `<workdir>/corrupt_checkpoints/` so later
    saves of those steps cannot collide with them; when none is good nothing is moved
    and CheckpointError lists why each failed. None when there is no checkpoint at all.
    steps: the candidates (default: all of this directory's). With several processes, a
    step counts only when every process loaded and verified it (they decide alike).
    """
    steps = sorted(self.all_steps() if steps is None else steps, reverse=True)
    if not steps:
      return None
    broken = []
    for step in steps:
      reason = None
      try:
        meta = self.read_meta(step)
        if check_meta is not None:
          check_meta(meta)
        state, meta = self.restore(step, abstract_state, data_iter)
      except ConfigError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        reason = short(e)
      if agreed(reason is None):  # the fingerprint below is a collective: all or none
        try:
          verify(step, state, meta, data_iter)
        except Exception as e:  # pylint: disable=broad-except
          reason = short(e)
        if agreed(reason is None):
          moved = self._quarantine([s for s, _ in broken]) if broken else None
          return Restored(state, meta, step, broken, moved, self.directory)
      broken.append((step, reason or 'failed to load on another process'))
    raise CheckpointError(
        f'no checkpoint in {self.directory} can be restored: '
        + '; '.join(f'step {s}: {r}' for s, r in broken)
        + '. Nothing was changed; move them away (or use a new --workdir) to start afresh.')

  def _quarantine(self, steps: list[int]) -> str:
    """Moves broken step directories out of the manager's sight (never deletes them)."""
    dest = f'{self.directory.rstrip("/").rsplit("/", 1)[0]}/{QUARANTINE_DIR}'
    if self.per_process:  # each process's own directory, moved by that process
      dest = os.path.join(dest, os.path.basename(self.directory.rstrip('/')))
    if jax.process_index() == 0 or self.per_process:
      stamp = time.strftime('%Y%m%d-%H%M%S')
      if is_url(dest):  # an object store: epath copies and deletes
        epath.Path(dest).mkdir(parents=True, exist_ok=True)
        for step in steps:
          src = epath.Path(self.directory) / str(step)
          if src.exists():
            src.rename(epath.Path(dest) / f'{step}-{stamp}')
      else:
        os.makedirs(dest, exist_ok=True)
        for step in steps:
          src = os.path.join(self.directory, str(step))
          if os.path.exists(src):
            shutil.move(src, os.path.join(dest, f'{step}-{stamp}'))
    if jax.process_count() > 1 and not self.per_process:
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
      finally:
        if self._holds_policy:
          self._holds_policy = False
          _release_draining_policy()


class TieredCheckpointer:
  """Two tiers: the persistent checkpoints (`checkpoint_dir`, every checkpoint_every steps)
  and frequent emergency saves on each host's local disk (`save(..., local=True)`), so a
  preemption loses at most local_checkpoint_every steps. The local tier is a per-process
  Checkpointer: each process keeps its own shards in its own directory. A step saved to the
  persistent tier is not saved locally again; the local tier keeps its newest steps.
  Restoring takes the newest good step of either tier; a local step counts only when every
  process has it. Everything else (`directory`, `incomplete`, `wait`, ...) is the persistent
  tier's, plus the local one's where it matters.
  """

  def __init__(self, persistent: Checkpointer, local: Checkpointer):
    self.persistent, self.local = persistent, local
    self.directory = persistent.directory
    self.incomplete = persistent.incomplete + [f'{local.directory}/{n}' for n in local.incomplete]
    self.manager = persistent.manager

  def local_steps(self) -> list[int]:
    """The local tier's steps that every process holds (a collective)."""
    return common_steps(self.local.all_steps())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def all_steps(self) -> list[int]:
    return sorted(set(self.persistent.all_steps()) | set(self.local_steps()))

  def read_meta(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    tier = self.persistent if step in self.persistent.all_steps() else self.local
    return tier.read_meta(step)

  def save(self, step: int, state, data_iter=None, meta: dict | None = None,
           force: bool = False, local: bool = False) -> bool:
    return (self.local if local else self.persistent).save(step, state, data_iter, meta, force)

  def restore_latest_good(self, abstract_state, data_iter=None, check_meta=None) -> Restored | None:
    """The newest good step across both tiers (the persistent one on a tie)."""
    candidates = [(self.persistent, self.persistent.all_steps()), (self.local, self.local_steps())]
    tiers = [(max(steps), -i, tier, steps) for i, (tier, steps) in enumerate(candidates) if steps]
    best, last, errors = None, None, []
    for newest, _, tier, steps in sorted(tiers, key=lambda t: t[:2], reverse=True):
      if best is not None and best[0].step >= newest:
        break  # nothing in this tier is newer than what was restored
      try:
        last = (tier.restore_latest_good(abstract_state, data_iter, check_meta, steps), tier)
      except CheckpointError as e:
        errors.append(str(e))
        continue
      if best is None or last[0].step > best[0].step:
        best = last
    if best is None:
      if errors:
        raise CheckpointError(' '.join(errors))
      return None
    if last is not best and data_iter is not None:  # the iterator holds the later restore's
      best[1].restore(best[0].step, abstract_state, data_iter)
    return best[0]

  def wait(self):
    self.persistent.wait()
    self.local.wait()

  def close(self):
    try:
      self.persistent.close()
    finally:
      self.local.close()


def listdir(path: str) -> list[str]:
  if is_url(path):
    try:
      return [p.name for p in epath.Path(path).iterdir()]
    except FileNotFoundError:
      return []
  try:
    return os.listdir(path)
  except FileNotFoundError:
    return []


def abstract_like(state, shardings):
  """ShapeDtypeStructs with target shardings: the restore template."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)
