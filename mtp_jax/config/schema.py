"""The schema check (every field a base_config() field of its type) and the one-line
refusal helpers the checks share."""
from __future__ import annotations

import difflib

import ml_collections

from mtp_jax.config.base import base_config
from mtp_jax.errors import ConfigError


def either(names) -> str:
  """The accepted values in a message: 'a', 'b' or 'c'."""
  quoted = [repr(n) for n in names]
  return quoted[0] if len(quoted) == 1 else ', '.join(quoted[:-1]) + ' or ' + quoted[-1]


def require(cond: bool, msg: str) -> None:
  """ConfigError(msg) unless cond."""
  if not cond:
    raise ConfigError(msg)


def require_positive_int(name: str, value) -> None:
  """ConfigError unless `value` is an int (not a bool) > 0; `name` is the dotted field."""
  require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
           f'{name} must be a positive integer, got {value!r}')


def type_name(v) -> str:
  return {bool: 'a boolean', int: 'an integer', float: 'a number', str: 'a string',
          tuple: 'a tuple', list: 'a tuple'}.get(type(v), type(v).__name__)


def check_schema(config, reference=None, prefix: str = '') -> None:
  """Every field must exist in base_config() and hold a value of its type.

  A config *file* may add fields freely (only command-line overrides are locked), so a
  misspelled `c.train.checkpoint_evry = 10` would otherwise be silently ignored.
  """
  reference = base_config() if reference is None else reference
  for key in config.keys():
    name = f'{prefix}{key}'
    if key not in reference:
      close = difflib.get_close_matches(key, list(reference.keys()), n=1)
      hint = f' (did you mean {prefix}{close[0]}?)' if close else ''
      raise ConfigError(f'unknown config field {name}{hint}')
    value, want = config[key], reference[key]
    if isinstance(want, ml_collections.ConfigDict):
      require(isinstance(value, ml_collections.ConfigDict),
               f'{name} must be a group of fields, got {value!r}')
      check_schema(value, want, name + '.')
      continue
    require(same_kind(value, want), f'{name} must be {type_name(want)}, got {value!r}')


def same_kind(value, want) -> bool:
  """value may stand where base_config() has `want` (an int for a float, a list for a tuple;
  anything for a None, whose own check reads it)."""
  if want is None:
    return True
  if isinstance(want, bool):
    return isinstance(value, bool)
  if isinstance(value, bool):
    return False
  if isinstance(want, float):
    return isinstance(value, (int, float))
  if isinstance(want, int):
    return isinstance(value, int)
  if isinstance(want, (tuple, list)):
    return isinstance(value, (tuple, list))
  return isinstance(value, type(want))
