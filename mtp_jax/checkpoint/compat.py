"""Whether a checkpoint fits a config: the fields whose change makes it unusable."""
from __future__ import annotations

import json
import os

from mtp_jax.config.base import base_config
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
_TRAINING_ONLY = {'remat', 'scan_layers', 'loss_chunk', 'dtype', 'dtype_requested',
                  'mtp.lambda_values',
                  'mtp.lambda_boundaries', 'mtp.lambda_schedule', 'mtp.weights',
                  'mtp.detach_trunk', 'mtp.stop_gradient', 'mtp.curriculum',
                  'mtp.curriculum_phase_steps'}
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
      default = _flatten(_norm(base_config().model.to_dict()))
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


# What the data stream of a run is: a checkpoint's data-iterator position indexes into it.
# Resuming on another stream is refused unless asked for (new_data=True, `--new_data`).
DATA_FIELDS = ('data.source', 'data.path', 'data.extensions', 'data.tokens_key',
               'data.dataset', 'data.corpus_dir', 'data.text_key', 'data.train_split',
               'data.eval_split', 'data.validation_percent', 'data.shuffle_seed')
# The tokenizer's file on resume: another one may map the same ids to other text.
_RESUME_ONLY = ('data.hf_tokenizer',)


def _field_diffs(saved_config: dict, config_dict: dict, fields) -> list[str]:
  """'field: checkpoint X vs config Y' for each of `fields` that differs (a field missing
  from an older checkpoint holds its base_config() default there)."""
  default = base_config().to_dict()
  diffs = []
  for field in fields:
    old, new = _lookup(saved_config, field), _lookup(config_dict, field)
    old = _lookup(default, field) if old is None else old
    new = _lookup(default, field) if new is None else new
    if _norm(old) != _norm(new):
      diffs.append(f'{field}: checkpoint {old!r} vs config {new!r}')
  return diffs


def check_compatible(saved_config: dict, config_dict: dict, directory: str,
                     new_data: bool = False) -> list[str]:
  """Raises ConfigError when resuming a checkpoint of `saved_config` as `config_dict` would
  train another model, tokenizer or sequence length, or (unless new_data) read another
  data stream. Returns the data fields that differ (accepted under new_data)."""
  workdir = os.path.dirname(os.path.abspath(directory))
  model = config_diffs(saved_config, config_dict) + _field_diffs(saved_config, config_dict,
                                                                 _RESUME_ONLY)
  clip = [_lookup(c, 'train.grad_clip') for c in (saved_config, config_dict)]
  if None not in clip and (clip[0] > 0) != (clip[1] > 0):  # clipping on/off: another state tree
    model.append(f'train.grad_clip: checkpoint {clip[0]!r} vs config {clip[1]!r} (clipping '
                 'switched on or off changes the optimizer state; other values may change)')
  data = _field_diffs(saved_config, config_dict, DATA_FIELDS)
  fresh = (f'start a new --workdir (with --init_from={workdir} to start from its weights)')
  if model:
    raise ConfigError(
        f'--workdir {workdir} holds checkpoints of an incompatible config (another model or '
        'tokenizer): '
        + '; '.join(model + data) + f'. To train this config, {fresh}.')
  if data and not new_data:
    raise ConfigError(
        f'--workdir {workdir} was trained on another data stream: ' + '; '.join(data)
        + f'. To train on this data, {fresh}, or resume this run on it with --new_data '
        '(model and optimizer continue, the data iterator starts at its beginning).')
  return data


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
