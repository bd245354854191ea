"""Whether a checkpoint fits a config: the fields whose change makes it unusable."""
from __future__ import annotations

import json

from mtp_jax import config_lib
from mtp_jax.errors import ConfigError


# Fields whose change makes an old checkpoint unusable for this run.
_SHAPE_FIELDS = ('model', 'data.tokenizer', 'data.spm_model', 'data.seq_len')


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
