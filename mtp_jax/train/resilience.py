"""Fault tolerance around the training loop.

Partial restores (--init_from) live in checkpoint.py, exit codes in errors.py.

- Preflight checks that fail before anything compiles, with one-line messages:
  the workdir, free disk space for a checkpoint, documents long enough for depth M.
- `WorkdirLock`: one trainer per workdir (an flock on `<workdir>/train.lock`).
- `PreemptionGuard`: SIGTERM / SIGINT ask the loop to stop after the current step,
  save and exit 0. With several processes JAX's preemption sync point decides, so
  every host saves the same step.
- Non-finite steps: `keep_finite_update` drops a NaN/Inf update inside the jitted
  step (no bad state ever exists, in either policy); `NonFiniteMonitor` applies
  train.nonfinite on the host (skip and count, or halt naming step and depth).
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

import mtp_jax
from mtp_jax.checkpoint import store as ckpt_store
from mtp_jax.errors import ConfigError, one_line
from mtp_jax.train.metrics import depth_names


class WorkdirError(ConfigError):
  """The run directory cannot be used (exists as a file, unreadable, read-only, full)."""


class NonFiniteError(FloatingPointError):
  """train.nonfinite='halt' (or too many skips in a row): the message names step and depths."""
  exit_code = 1


def close_all(error, notify, *closers) -> None:
  """Calls every closer; raises the first failure only when no other error is propagating
  (e.g. a full disk must not turn a clear checkpoint error into a TensorBoard traceback)."""
  first = None
  for close in closers:
    if close is None:
      continue
    try:
      close()
    except Exception as e:  # pylint: disable=broad-except
      if error is None and first is None:
        first = e
      else:
        notify(f'also, while shutting down: {one_line(e)}')
  if first is not None:
    raise first


# -- preflight ---------------------------------------------------------------------------
def check_workdir(workdir: str) -> str | None:
  """Creates the run directory and proves it is a writable, listable directory.

  Returns the top-most directory it created (None if the workdir existed), for
  `remove_failed_start` to take away again when the run fails before its first checkpoint.
  """
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f'--workdir {workdir!r} exists and is not a directory')
  created = None
  parent = os.path.abspath(workdir)
  while not os.path.exists(parent):
    created, parent = parent, os.path.dirname(parent)
  try:
    os.makedirs(workdir, exist_ok=True)
    os.listdir(workdir)
    with tempfile.NamedTemporaryFile(dir=workdir, prefix='.write_probe_') as f:
      f.write(b'x')
      f.flush()
      os.fsync(f.fileno())
  except OSError as e:
    if created is not None:  # e.g. created, but no space for the probe: taken away again
      remove_failed_start(workdir, created, None)
    raise WorkdirError(f'--workdir {workdir!r} is not a usable directory: '
                       f'{e.strerror or e} (errno {e.errno})') from e
  for sub in ('checkpoints',):
    path = os.path.join(workdir, sub)
    if os.path.lexists(path) and not os.path.isdir(path):
      raise WorkdirError(f'{path!r} exists and is not a directory (a broken link or a file)')
    if os.path.isdir(path):
      try:
        os.listdir(path)
      except OSError as e:
        raise WorkdirError(f'{path!r} cannot be listed: {e.strerror or e}') from e
  return created


def workdir_entries(workdir: str) -> set[str] | None:
  """The names in a workdir before a run touches it (None: it does not exist yet)."""
  try:
    return set(os.listdir(workdir))
  except OSError:
    return None


def _has_checkpoint(workdir: str, directory: str | list | None = None) -> bool:
  """A finished (renamed) checkpoint step exists in `directory` (or any of a list of them,
  the checkpoint tiers): the run can resume from it."""
  if isinstance(directory, (list, tuple)):
    return any(_has_checkpoint(workdir, d) for d in directory)
  directory = directory or os.path.join(workdir, 'checkpoints')
  try:
    return any(n.isdigit() and ckpt_store.isdir(f'{directory.rstrip("/")}/{n}')
               for n in ckpt_store.listdir(directory))
  except Exception:  # pylint: disable=broad-except  (unreachable storage: nothing to keep)
    return False


def existing_parent(path: str) -> str:
  """path, or its nearest existing parent (a checkpoint directory not made yet)."""
  path = os.path.abspath(path)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return path


def remove_failed_start(workdir: str, created: str | None, before: set[str] | None,
                        checkpoints_dir: str | list | None = None) -> None:
  """Undoes what a run that failed before its first checkpoint wrote.

  created (check_workdir's result): the workdir and the parents this run made are removed
  whole; a workdir that existed (`before`: its names then) keeps everything it held and
  loses only what this run added (config.json, metrics.jsonl, tensorboard/, checkpoints/,
  train.lock). Nothing is removed once a checkpoint exists.
  """
  path = os.path.abspath(workdir)
  if _has_checkpoint(path, checkpoints_dir):
    return
  if created is None:
    if before is None or not os.path.isdir(path):
      return  # (made by another process in between: not this run's to clean)
    for name in set(os.listdir(path)) - (before or set()):
      target = os.path.join(path, name)
      if os.path.isdir(target) and not os.path.islink(target):
        shutil.rmtree(target, ignore_errors=True)
      else:
        with contextlib.suppress(OSError):
          os.unlink(target)
    return
  shutil.rmtree(path, ignore_errors=True)
  created = os.path.abspath(created)
  while path != created:
    path = os.path.dirname(path)
    try:
      os.rmdir(path)
    except OSError:
      return  # not empty: someone else's files now live there


# -- one writer per workdir --------------------------------------------------------------
LOCK_FILE = 'train.lock'


class WorkdirLock:
  """One trainer per workdir: an exclusive flock on `<workdir>/train.lock` for the run.

  The kernel releases an flock when its holder exits in any way (kill -9 included), so
  a lock is never stale on this host; the file names the holder (pid, host, start) for
  the refusal message and stays behind (unlinking it would let a waiter lock the old
  inode while a newcomer locks a new one). With several processes, process 0 holds it
  for the job. Readers (decode, eval) never take it. On a shared filesystem flock may be
  local to each host (some NFS and Lustre mounts): there it does not stop a second
  trainer on another host (README, fault tolerance). A filesystem without flock
  support gets a warning and no lock.
  """

  def __init__(self, workdir: str, notify=print):
    self.path = os.path.join(os.path.abspath(workdir), LOCK_FILE)
    self.notify = notify
    self._fd = None

  def acquire(self) -> WorkdirLock:
    """WorkdirError naming the holder when another trainer holds the workdir."""
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec'd children
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = _lock_holder(fd)
      os.close(fd)
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        self.notify(f'WARNING: cannot lock {self.path} ({e.strerror or e}): this filesystem '
                    'has no flock, so nothing stops a second trainer on this workdir')
        return self
      raise WorkdirError(
          f'--workdir {os.path.dirname(self.path)!r} is being trained by {holder} (it holds '
          f'{self.path}): one trainer per workdir; wait for it to finish, or stop it and '
          'rerun to resume') from e
    record = {'pid': os.getpid(), 'host': socket.gethostname(),
              'since': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + '\n').encode(), 0)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)  # releases the flock
      self._fd = None


def _lock_holder(fd: int) -> str:
  try:
    record = json.loads(os.pread(fd, 4096, 0).decode() or '{}')
    text = f"pid {record['pid']} on host {record['host']} (since {record['since']})"
  except (OSError, ValueError, KeyError, TypeError):
    return 'another process'
  if record['host'] == socket.gethostname() and not _alive(int(record['pid'])):
    # The recorded trainer is gone, yet the flock is held: by a process it forked.
    text += ', which has exited; a process it started still holds the lock'
  return text


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:
    return True  # exists, owned by someone else
  return True


def state_bytes(abstract_state) -> int:
  return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(abstract_state)))


def check_disk_space(directory: str, needed: int) -> None:
  """WorkdirError when the filesystem cannot hold one more checkpoint of `needed` bytes."""
  free = _free_bytes(directory)
  if free < needed:
    raise WorkdirError(
        f'disk full: {directory!r} has {free / 2**20:.1f} MiB free but one checkpoint needs '
        f'about {needed / 2**20:.1f} MiB; free space or use another --workdir')


def _free_bytes(directory: str) -> int:
  st = os.statvfs(directory)
  return st.f_bavail * st.f_frsize


def checkpoint_bytes_estimate(abstract_state) -> int:
  """Array bytes plus slack for orbax metadata (checkpoints are compressed, so this bounds)."""
  return state_bytes(abstract_state) + (1 << 20)


# -- preemption --------------------------------------------------------------------------
class PreemptionGuard:
  """Turns SIGTERM / SIGINT into 'save at the end of this step and exit 0'.

  One process: Python handlers set a flag that `should_stop` reads. Several processes
  (TPU pods): JAX's preemption service owns SIGTERM (it propagates the notice to every
  host) and `multihost_utils.reached_preemption_sync_point(step)` becomes true at the
  same step everywhere; SIGINT is forwarded to it as SIGTERM. A second SIGINT restores
  the default handler's KeyboardInterrupt, for a user who really wants out now.
  """

  def __init__(self, notify=print):
    self.notify = notify
    self.signal_name: str | None = None
    self.signum: int | None = None
    self._previous = {}
    self._multihost = False

  def install(self):
    self._multihost = jax.process_count() > 1 and _preemption_service_running()
    if threading.current_thread() is not threading.main_thread():
      return self  # signals can only be caught in the main thread
    wanted = [signal.SIGINT] if self._multihost else [signal.SIGTERM, signal.SIGINT]
    for sig in wanted:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def uninstall(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def __enter__(self):
    return self.install()

  def __exit__(self, *exc):
    self.uninstall()
    return False

  def _handle(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    if self.signal_name is not None:
      if signum == signal.SIGINT:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        raise KeyboardInterrupt
      return  # a repeated SIGTERM: the save is already on its way
    self.signal_name, self.signum = name, signum
    self.notify(f'{name} received: finishing this step, then saving a checkpoint and exiting '
                '(press Ctrl-C again to abort without saving).')
    if self._multihost:
      os.kill(os.getpid(), signal.SIGTERM)  # let JAX's preemption service agree on a step

  @property
  def requested(self) -> bool:
    return self.signal_name is not None

  def should_stop(self, step: int) -> bool:
    """Called once per step by every process with the same step numbers."""
    if self._multihost:
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal_name = self.signal_name or 'SIGTERM'
        return True
      return False
    return self.requested


def _preemption_service_running() -> bool:
  try:
    # Deferred into the try: a private module, which a JAX release may move or drop.
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
    return distributed.global_state.preemption_sync_manager is not None
  except Exception:  # pylint: disable=broad-except
    return False


# -- non-finite steps ----------------------------------------------------------------------
def keep_finite_update(old_state, new_state, metrics: dict):
  """Inside the jitted step: the new state if loss, depth losses and grad norm are finite,
  else the old one bit for bit (the batch counts as seen; the update is dropped).

  `old_state` must be a copy taken before nnx.merge, which aliases the input state.
  """
  ok = (jnp.isfinite(metrics['loss']) & jnp.isfinite(metrics['grad_norm'])
        & jnp.all(jnp.isfinite(metrics['loss_sum'])))
  state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, old_state)
  return state, {**metrics, 'skipped': (~ok).astype(jnp.int32)}


def nonfinite_report(m: dict) -> str:
  """'depth losses main=2.31 mtp_1=nan mtp_2=nan (non-finite: mtp_1, mtp_2); grad_norm=nan'."""
  count = np.maximum(np.asarray(m['count'], np.float64), 1.0)
  with np.errstate(invalid='ignore', over='ignore'):
    per = np.asarray(m['loss_sum'], np.float64) / count
  names = depth_names(len(per))
  bad = [n for n, v in zip(names, per) if not np.isfinite(v)]
  values = ' '.join(f'{n}={v:.4g}' for n, v in zip(names, per))
  return (f'depth losses {values} (non-finite: {", ".join(bad) if bad else "none"}); '
          f'loss={float(m["loss"]):.4g}, grad_norm={float(m["grad_norm"]):.4g}')


class NonFiniteMonitor:
  """Host side of train.nonfinite: counts skipped steps, halts with a message when told to."""

  def __init__(self, policy: str, max_consecutive: int, notify=print, skipped_total: int = 0):
    self.policy = policy
    self.max_consecutive = max_consecutive
    self.notify = notify
    self.skipped_total = skipped_total
    self.consecutive = 0

  def check(self, step: int, m: dict, last_checkpoint: int | None) -> bool:
    """True when step's metrics are usable; False when the step was skipped; raises on halt."""
    finite = bool(np.isfinite(m['loss']) and np.isfinite(m['grad_norm'])
                  and np.all(np.isfinite(m['loss_sum'])))
    if finite:
      self.consecutive = 0
      return True
    where = (f'the last checkpoint is step {last_checkpoint}' if last_checkpoint is not None
             else 'no checkpoint was saved yet')
    if self.policy == 'halt':
      raise NonFiniteError(
          f'non-finite training step {step}: {nonfinite_report(m)}. Stopped '
          f"(train.nonfinite='halt'); the update was not applied and {where}. Rerun with "
          '--config.train.nonfinite=skip to drop such steps, or lower train.lr.')
    self.skipped_total += 1
    self.consecutive += 1
    if self.consecutive >= self.max_consecutive:
      raise NonFiniteError(
          f'{self.consecutive} non-finite steps in a row, the last at step {step}: '
          f'{nonfinite_report(m)}. Stopped (train.max_consecutive_skips='
          f'{self.max_consecutive}); {where}.')
    self.notify(f'step {step}: non-finite, update skipped ({self.skipped_total} so far): '
                f'{nonfinite_report(m)}')
    return False


def __getattr__(name: str):  # a name an earlier release had here: mtp_jax.MOVED_NAMES
  return mtp_jax.moved_name(__name__, name)
