"""Partial restore: start a run from another run's trunk, embedding and head (`--init_from`).

The MTP modules of the new run keep their fresh initialisation when the source has fewer
depths (or none); a source with more depths gives its first ones. The flag is parsed once
by mtp_jax.train_state.InitFrom: this module reads its 'checkpoint' kind (a path),
mtp_jax.interop.hf its 'hf' kind.
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

import mtp_jax
from mtp_jax.checkpoint.compat import config_diffs
from mtp_jax.checkpoint.reader import (
  CheckpointReader,
  leaf_paths,
  nested,
  path_names,
  restore_item,
  warn,
)
from mtp_jax.checkpoint.store import CheckpointError
from mtp_jax.config import kinds
from mtp_jax.config.readers import optional
from mtp_jax.errors import ConfigError


def resolve_checkpoint(path: str) -> tuple[str, int | None]:
  """(checkpoints directory, step or None for its latest) from a workdir, a checkpoints
  directory or one step directory."""
  path = os.path.abspath(os.path.expanduser(str(path)))
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


def check_init_from(source: str, config, config_dict: dict,
                    notify=warn) -> tuple[str, int, int]:
  """(checkpoints directory, step, MTP depths to load) once the source's trunk is known to
  fit this config; ConfigError / CheckpointError otherwise. Compiles nothing; read-only
  (the source may be a run that is training right now). notify: the broken steps skipped."""
  source = str(source)
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
  # Only the optimizer differs with freeze_trunk, and it starts fresh here anyway; the MTP
  # modules' layout (depths, kind, sharing, what they read) is the new run's own.
  diffs = config_diffs(saved, config_dict,
                       ignore={'mtp.depth', 'mtp.kind', 'mtp.freeze_trunk', 'mtp.share_modules',
                               'mtp.target_offsets', 'mtp.strict_leaps'})
  if diffs:
    raise ConfigError(f'--init_from {directory}/{step}: the trunk differs from this config: '
                      + '; '.join(diffs))
  old_mtp = saved['model']['mtp']
  share = bool(optional(config, 'model.mtp.share_modules', False))
  same_kind = (old_mtp['kind'] == config.model.mtp.kind
               and bool(old_mtp.get('share_modules', False)) == share)
  keep = min(int(old_mtp['depth']), config.model.mtp.depth) if same_kind else 0
  return directory, step, kinds.mtp_module_count(keep, share)


def init_from(source: str, config, config_dict: dict, state, abstract_state,
              notify=print):
  """`state` with trunk, embedding/head and matching MTP depths loaded from `source`.

  The model must agree with the source in everything except model.mtp (depth, kind,
  weights); depths 1..min(D_old, D_new) are loaded when the kind is the same, deeper
  ones keep their fresh initialisation. Optimizer state, step and data position start
  fresh: this begins a new run. What is loaded is checked against the source's
  fingerprints; a broken newest step falls back to an older one (a given step
  directory does not). Returns (state, description).
  """
  source = str(source)

  def report(text):
    notify(f'WARNING: --init_from: {text}')

  directory, step, keep = check_init_from(source, config, config_dict, report)
  explicit = resolve_checkpoint(source)[1] is not None

  def wanted(path):  # the model half; MTP depths only up to `keep`
    return path[0] == '0' and (path[1] != 'mtp' or int(path[2]) < keep)

  target = nested({p: x for p, x in leaf_paths(abstract_state).items() if wanted(p)})
  restore_args = jax.tree.map(
      lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype),
      target)
  reader = CheckpointReader(directory, report)

  def load(s: int) -> dict:
    meta = reader.read_meta(s)
    restored = restore_item(
        os.path.join(directory, str(s), 'state'), ocp.PyTreeCheckpointHandler(),
        ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True))
    loaded = leaf_paths(restored)
    reader.verify_paths(s, meta, loaded)
    return loaded

  try:
    step, loaded, _ = reader.newest_first(load, step=step if explicit else None,
                                          newest=None if explicit else step)
  except CheckpointError as e:
    raise CheckpointError(f'--init_from {source}: cannot load the trunk ({e})') from e
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  state = jax.tree_util.tree_unflatten(treedef, [
      loaded.get(path_names(p), x) for p, x in flat])
  fresh = kinds.mtp_module_count(
      config.model.mtp.depth, optional(config, 'model.mtp.share_modules', False)) - keep
  desc = (f'Initialised from {directory}/{step}: trunk, embedding and head'
          + (f' + MTP depths 1..{keep}' if keep else '')
          + f' loaded ({len(loaded)} arrays); '
          + (f'{fresh} new MTP depth(s) freshly initialised; ' if fresh else '')
          + 'optimizer, step and data start fresh.')
  notify(desc)
  return state, desc


def __getattr__(name: str):  # a name an earlier release had here: mtp_jax.MOVED_NAMES
  return mtp_jax.moved_name(__name__, name)
