"""What the command lines share: the flag parser and the report of expected failures.

Importing this starts no JAX (argparse, absl flags and ml_collections only), so the commands
import it before parsing flags. The error types themselves live in errors.py.
"""
from __future__ import annotations

import argparse
import difflib
import math
import re
import sys

from absl import flags, logging
from ml_collections import config_flags

from mtp_jax import config_files
from mtp_jax.errors import ConfigError, RequestError, exit_code_of, one_line  # noqa: F401


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Names an option's default in --help unless it is unset (None) or a switch's off."""

  def _get_help_string(self, action):
    if action.default in (None, False) or action.default is argparse.SUPPRESS:
      return action.help
    return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
  """Flag errors as one `error: ...` line and exit code 2, like every other bad input;
  `--help` shows each option's default."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault('formatter_class', _HelpFormatter)
    super().__init__(*args, **kwargs)

  def error(self, message):  # argparse's default prints the whole usage first
    # A value check of the types below: '--top_k must be >= 0, got -1'.
    message = re.sub(r'^argument (\S+): must be ', r'\1 must be ', message)
    print(f'error: {message}', file=sys.stderr)
    sys.exit(2)

  def parse_args(self, args=None, namespace=None):
    args = sys.argv[1:] if args is None else list(args)
    self._check_flag_names(args)
    return super().parse_args(args, namespace)

  def _check_flag_names(self, args) -> None:
    """An unknown --flag is named with the closest real one (dashes read as underscores:
    --max-new-tokens -> --max_new_tokens), before argparse's other checks."""
    known = [o for a in self._actions for o in a.option_strings if o.startswith('--')]
    for token in args:
      if token == '--':
        return
      name = token.split('=', 1)[0]
      if not name.startswith('--') or ' ' in name or any(o.startswith(name) for o in known):
        continue  # a value (argparse reads one with a space as such), a flag, an abbreviation
      fixed = '--' + name[2:].replace('-', '_')
      close = [fixed] if fixed in known else difflib.get_close_matches(fixed, known, 1, 0.7)
      self.error(f'unrecognized arguments: {token}'
                 + (f' (did you mean {close[0]}?)' if close else ' (--help lists the options)'))


# -- value types of flags -------------------------------------------------------------------
# argparse `type=` functions: a flag's value is checked as it is parsed, before JAX starts,
# and a bad one is one line, e.g. 'error: --max_new_tokens must be > 0, got -5'.
def _number(kind, text: str):
  try:
    value = kind(text)
  except ValueError:
    what = 'an integer' if kind is int else 'a number'
    raise argparse.ArgumentTypeError(f'must be {what}, got {text!r}') from None
  if kind is float and not math.isfinite(value):
    raise argparse.ArgumentTypeError(f'must be a finite number, got {text!r}')
  return value


def _bounded(kind, text: str, strict: bool):
  value = _number(kind, text)
  if value < 0 or (strict and value == 0):
    raise argparse.ArgumentTypeError(f'must be {">" if strict else ">="} 0, got {value}')
  return value


def positive_int(text: str) -> int:
  return _bounded(int, text, strict=True)


def non_negative_int(text: str) -> int:
  return _bounded(int, text, strict=False)


def positive_float(text: str) -> float:
  return _bounded(float, text, strict=True)


def non_negative_float(text: str) -> float:
  return _bounded(float, text, strict=False)


def probability(text: str) -> float:
  """top-p: in (0, 1]."""
  value = _number(float, text)
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f'must be in (0, 1], got {value}')
  return value


def report_expected(e: BaseException) -> int:
  """For a script's `except`: print an expected failure as one `error:` line, return its
  exit code; anything else is a bug and is re-raised with its traceback."""
  code = exit_code_of(e)
  if code is None:
    raise e
  print(f'error: {one_line(e)}', file=sys.stderr)
  return code


# -- config files ------------------------------------------------------------------------
# Every command takes its flags with argparse (the standard library: `main(argv)` runs in a
# test's process, and `--help` lists each option with its default). A config is a Python
# file with get_config(), overridden field by field as `--config.train.steps=100`; those
# overrides are parsed by ml_collections' own config flag, so their syntax and type
# checks are the library's.
CONFIG_HELP = ('config file with get_config() (configs/*.py), or a run\'s saved '
               'WORKDIR/config.json; override any field with '
               '--config.KEY=VALUE, e.g. --config.train.steps=100')


def parse_with_config(parser: argparse.ArgumentParser, argv=None):
  """(args, ['--config.KEY=VALUE', ...]): the parser's flags, and the config overrides."""
  argv = sys.argv[1:] if argv is None else list(argv)
  overrides, rest, i = [], [], 0
  while i < len(argv):
    a = argv[i]
    if a.startswith('--config.'):
      if '=' not in a and i + 1 < len(argv):  # `--config.train.steps 100`
        a, i = f'{a}={argv[i + 1]}', i + 1
      overrides.append(a)
    else:
      rest.append(a)
    i += 1
  args = parser.parse_args(rest)
  return args, overrides


def load_config(spec: str, overrides=()):
  """The locked ConfigDict of a config file ('path' or 'path:argument', config_files.load)
  with `--config.KEY=VALUE` overrides applied.

  ConfigError (one line) for a missing or broken file, a bad argument, an unknown key or a
  bad value.
  """
  config = config_files.load(spec)
  values = flags.FlagValues()
  argv = ['mtp_jax'] + list(overrides)
  try:
    # sys_argv: the overrides are these, not the process's own argv (main(argv) in a test).
    holder = config_flags.DEFINE_config_dict('config', config, 'config file',
                                             flag_values=values, lock_config=True, sys_argv=argv)
    values(argv)
    config = holder.value
  except flags.Error as e:
    raise ConfigError(_bad_value(e, config, overrides)) from e
  except AttributeError as e:  # ml_collections: an unknown --config.x key
    raise ConfigError(_unknown_field(e, overrides)) from e
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f'bad --config override ({type(e).__name__}): {_clean(e)}') from e
  return config


def _unknown_field(e: AttributeError, overrides) -> str:
  """'unknown config field train.stepz (--config.train.stepz=3): did you mean "steps"?'."""
  text = _clean(e).strip('\'"')
  name, _, hint = text.partition('. ')
  for o in overrides:
    key = o.split('=', 1)[0][len('--config.'):]
    if key == name or key.endswith('.' + name):
      hint = hint.split(' instead of ')[0].replace('Did you mean', 'did you mean')
      return (f'unknown config field {key} ({o})' + (f': {hint}?' if hint else '')).replace(
          '??', '?')
  return f'unknown config field in a --config.* override: {text}'


def _bad_value(e: BaseException, config, overrides) -> str:
  """'--config.train.steps=abc: train.steps takes an integer (300 in the config), got
  'abc'' for a value the field's type cannot read; the library's words otherwise."""
  text = _clean(e)
  for o in overrides:
    key, _, value = o[len('--config.'):].partition('=')
    if f'{o}:' not in text and f'{o} ' not in text + ' ':
      continue
    node = config
    try:
      for part in key.split('.'):
        node = node[part]
    except (KeyError, TypeError, AttributeError):
      break
    kind = {bool: 'True or False', int: 'an integer', float: 'a number', str: 'a string',
            tuple: 'a tuple such as (1, 2)', list: 'a list'}.get(type(node))
    if kind is not None:
      return f'{o}: {key} takes {kind} ({node!r} in the config), got {value!r}'
  return f'bad --config override: {text}'


def _clean(e: BaseException) -> str:
  return ' '.join(str(e).replace('\\n', '. ').replace("\\'", '').split())


def quiet_library_logs() -> None:
  """orbax and grain log every save and restore at INFO through absl: warnings only."""
  logging.set_verbosity(logging.WARNING)
