"""Orbax checkpoints: model + optimizer state, data-iterator state and run metadata together."""
from __future__ import annotations

import json
import os

import grain
import jax
import orbax.checkpoint as ocp

from mtp_jax.config_lib import ConfigError

# Fields whose change makes an old checkpoint unusable for this run.
_SHAPE_FIELDS = ('model', 'data.tokenizer', 'data.spm_model', 'data.seq_len')


class Checkpointer:
  """A CheckpointManager over `<workdir>/checkpoints` saving {state, data, meta} items."""

  def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state, data_iter=None, meta: dict | None = None,
           force: bool = False) -> bool:
    items = {'state': ocp.args.StandardSave(state),
             'meta': ocp.args.JsonSave(meta or {})}
    if data_iter is not None:
      items['data'] = grain.checkpoint.CheckpointSave(data_iter)
    return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

  def read_meta(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(out['meta'])

  def restore(self, step: int, abstract_state, data_iter=None):
    """Restores onto the shardings carried by `abstract_state` (ShapeDtypeStructs)."""
    items = {'state': ocp.args.StandardRestore(abstract_state), 'meta': ocp.args.JsonRestore()}
    if data_iter is not None:
      items['data'] = grain.checkpoint.CheckpointRestore(data_iter)
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    return out['state'], dict(out['meta'])

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def _lookup(d: dict, dotted: str):
  for part in dotted.split('.'):
    if not isinstance(d, dict) or part not in d:
      return None
    d = d[part]
  return d


def check_compatible(saved_config: dict, config_dict: dict, directory: str) -> None:
  """Raises ConfigError when a checkpoint was written by a config of another shape."""
  diffs = []
  for field in _SHAPE_FIELDS:
    old, new = _lookup(saved_config, field), _lookup(config_dict, field)
    if field == 'model' and isinstance(old, dict) and isinstance(new, dict):
      keys = sorted(set(_flatten(old)) | set(_flatten(new)))
      fo, fn = _flatten(old), _flatten(new)
      # Training-only switches may change between runs of the same model.
      ignore = {'remat', 'scan_layers', 'loss_chunk', 'dtype', 'mtp.lambda_values',
                'mtp.lambda_boundaries', 'mtp.weights', 'mtp.detach_trunk'}
      diffs += [f'model.{k}: checkpoint {fo.get(k)!r} vs config {fn.get(k)!r}'
                for k in keys if k not in ignore and _norm(fo.get(k)) != _norm(fn.get(k))]
    elif _norm(old) != _norm(new):
      diffs.append(f'{field}: checkpoint {old!r} vs config {new!r}')
  if diffs:
    raise ConfigError(
        f'the workdir holds a checkpoint of an incompatible config ({directory}): '
        + '; '.join(diffs) + '. Use a new --workdir.')


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
