"""Fault tolerance around the training loop (issue 5).

- Preflight checks that fail before anything compiles, with one-line messages:
  the workdir, free disk space for a checkpoint, documents long enough for depth D.
- `PreemptionGuard`: SIGTERM / SIGINT ask the loop to stop after the current step,
  save and exit 0. With several processes JAX's preemption sync point decides, so
  every host saves the same step.
- Non-finite steps: `keep_finite_update` drops a NaN/Inf update inside the jitted
  step (no bad state ever exists, in either policy); `NonFiniteMonitor` applies
  train.nonfinite on the host (skip and count, or halt naming step and depth).
- `init_from`: trunk, shared embedding/head and matching MTP depths from another
  run's checkpoint; new MTP modules keep their fresh initialisation.
"""
from __future__ import annotations

import errno
import os
import signal
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import checkpoint as ckpt_lib
from mtp_jax.config_lib import ConfigError

CheckpointError = ckpt_lib.CheckpointError


class WorkdirError(ConfigError):
  """The run directory cannot be used (exists as a file, unreadable, read-only, full)."""


class NonFiniteError(FloatingPointError):
  """train.nonfinite='halt' (or too many skips in a row): the message names step and depths."""
  exit_code = 1


def exit_code_of(e: BaseException) -> int | None:
  """The CLI exit code for an expected failure (2: bad input / environment), else None."""
  if isinstance(e, ConfigError):
    return 2
  code = getattr(e, 'exit_code', None)
  if code is not None:
    return code
  if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS,
                                            errno.EACCES, errno.EPERM, errno.ENOTDIR):
    return 2  # e.g. metrics.jsonl on a full disk: the environment, not a bug
  return None


def one_line(e: BaseException) -> str:
  text = ' '.join(str(e).split())
  return text if isinstance(e, (ConfigError, CheckpointError, NonFiniteError)) else (
      f'{type(e).__name__}: {text}')


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
def check_workdir(workdir: str) -> None:
  """Creates the run directory and proves it is a writable, listable directory."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f'--workdir {workdir!r} exists and is not a directory')
  try:
    os.makedirs(workdir, exist_ok=True)
    os.listdir(workdir)
    with tempfile.NamedTemporaryFile(dir=workdir, prefix='.write_probe_') as f:
      f.write(b'x')
      f.flush()
      os.fsync(f.fileno())
  except OSError as e:
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


def validate_data(config, process_count: int = 1) -> None:
  """pipeline.validate_data_config, with TFDS's failure on a split left without any readable
  document (every file binary or empty) turned into a ConfigError naming the corpus."""
  from mtp_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  try:
    pipeline.validate_data_config(config, process_count)
  except AssertionError as e:
    if 'No examples were yielded' not in str(e):
      raise
    raise ConfigError(
        f'data.corpus_dir {config.data.corpus_dir or "(this interpreter stdlib)"!r}: a split has '
        f'no readable document ({one_line(e)}); files holding NUL bytes (binary) and empty '
        'files are skipped') from e


_DOC_SAMPLE = 512


def check_document_lengths(config) -> None:
  """ConfigError when no sampled training document is long enough for the deepest MTP depth.

  Depth k at position i predicts t_{i+k+1} of the same document, so a document (with its
  eos) needs D + 2 tokens to give depth D one target; a corpus of shorter ones would
  train depth D on a loss that is always empty (0), silently.
  """
  from mtp_jax.data import stdlib_dataset, tokenizers  # pylint: disable=g-import-not-at-top
  depth = config.model.mtp.depth
  need = depth + 2
  d = config.data
  source = stdlib_dataset.data_source(d, d.train_split)
  tokenizer = tokenizers.get_tokenizer(d)
  n = min(len(source), _DOC_SAMPLE)
  longest = 0
  for i in range(n):
    text = source[i][d.text_key]
    if not len(text):
      continue
    length = len(tokenizer.encode_array(text)) + 1  # + eos
    longest = max(longest, length)
    if longest >= need:
      return
  raise ConfigError(
      f'data: the {n} documents checked in split {d.train_split!r} of data.dataset '
      f'{d.dataset!r} are all shorter than model.mtp.depth + 2 = {need} tokens (longest '
      f'{longest} with eos), so MTP depth {depth} would never have a target; lower '
      'model.mtp.depth or use longer documents')


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
    self.signal_name = name
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
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal_name = self.signal_name or 'SIGTERM'
        return True
      return False
    return self.requested


def _preemption_service_running() -> bool:
  try:
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


def depth_names(num_depths: int) -> list[str]:
  return ['main'] + [f'mtp_{k}' for k in range(1, num_depths)]


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


# -- init from another run -----------------------------------------------------------------
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


def check_init_from(source: str, config, config_dict: dict) -> tuple[str, int, int]:
  """(checkpoints directory, step, MTP depths to load) once the source's trunk is known to
  fit this config; ConfigError / CheckpointError otherwise. Compiles nothing."""
  directory, step = resolve_checkpoint(source)
  ckpt = ckpt_lib.Checkpointer(directory, max_to_keep=1 << 30, async_save=False)
  try:
    steps = sorted(ckpt.all_steps(), reverse=True)
    if not steps:
      raise ConfigError(f'--init_from {source!r}: no checkpoint in {directory}')
    step = steps[0] if step is None else step
    if step not in steps:
      raise ConfigError(f'--init_from {source!r}: no step {step} in {directory} (has {steps})')
    try:
      meta = ckpt.read_meta(step)
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f'--init_from {directory}/{step}: meta unreadable '
                            f'({ckpt_lib.short(e)})') from e
  finally:
    ckpt.close()
  saved = meta.get('config', {})
  # Only the optimizer differs with freeze_trunk, and it starts fresh here anyway.
  diffs = ckpt_lib.config_diffs(saved, config_dict,
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
  fresh: this begins a new run. Returns (state, description).
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  directory, step, keep = check_init_from(source, config, config_dict)

  def wanted(path):  # the model half; MTP depths only up to `keep`
    return path[0] == '0' and (path[1] != 'mtp' or int(path[2]) < keep)

  target = _nested({p: x for p, x in _paths(abstract_state).items() if wanted(p)})
  state_dir = os.path.join(directory, str(step), 'state')
  restore_args = jax.tree.map(
      lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype),
      target)
  try:
    with ocp.PyTreeCheckpointer() as ckptr:
      restored = ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(
          item=target, restore_args=restore_args, partial_restore=True))
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'--init_from {state_dir}: cannot load the trunk '
                          f'({ckpt_lib.short(e)})') from e
  loaded = _paths(restored)
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


def repair_jsonl(path: str) -> None:
  """Drops a last line cut short by a kill, so metrics.jsonl stays one JSON object a line."""
  try:
    with open(path, 'rb+') as f:
      data = f.read()
      if not data or data.endswith(b'\n'):
        return
      f.truncate(data.rfind(b'\n') + 1)
  except FileNotFoundError:
    return
