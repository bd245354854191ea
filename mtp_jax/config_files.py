"""Config files by path: `configs/tiny.py`, or `configs/ablation.py:d1` as ml_collections'
config flags read them (the text after the first ':' is get_config's argument), or a run's
saved `WORKDIR/config.json` (what self-distill and export print to train on).

The one loader of config files: the commands' `--config`, the research sweep's variant
tables, the benchmarks and the tests all load through it.
"""
import difflib
import glob
import importlib.util
import json
import os

from mtp_jax.config.base import base_config
from mtp_jax.errors import ConfigError


def split_spec(spec: str) -> tuple[str, str | None]:
  """('configs/ablation.py', 'd1') of 'configs/ablation.py:d1'; (path, None) without ':'."""
  path, sep, argument = spec.partition(':')
  return path, (argument if sep else None)


def load_module(path: str):
  """The module of a config file (or of a file a config shares); ConfigError (one line)
  for a missing or broken file."""
  if not os.path.isfile(path):
    raise ConfigError(f'cannot load --config {path!r}: No such file or directory'
                      + _did_you_mean(path))
  name = 'config_' + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # pylint: disable=broad-except
    raise ConfigError(f'bad --config file {path} ({type(e).__name__}): {_clean(e)}') from e
  return module


def load_saved(path: str):
  """The ConfigDict of a run's saved config (a workdir's config.json) over base_config(): a
  field added since it was saved holds its default. ConfigError (one line) if unreadable."""
  try:
    with open(path, encoding='utf-8') as f:
      saved = json.load(f)
    config = base_config()
    config.update(saved)
  except OSError as e:
    raise ConfigError(f'cannot load --config {path!r}: {e.strerror}') from e
  except (ValueError, TypeError, AttributeError, KeyError) as e:
    raise ConfigError(f'bad --config file {path} (not a saved run config): {_clean(e)}') from e
  return config


def load(spec: str):
  """The ConfigDict of 'path' (get_config()) or 'path:argument' (get_config(argument)), or
  of a run's saved config.json (load_saved)."""
  if spec.endswith('.json'):
    return load_saved(spec)
  path, argument = split_spec(spec)
  module = load_module(path)
  if not callable(getattr(module, 'get_config', None)):
    raise ConfigError(f'bad --config file {path}: it defines no get_config()')
  try:
    config = module.get_config() if argument is None else module.get_config(argument)
  except ConfigError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    what = f'argument {argument!r}' if argument is not None else 'get_config()'
    raise ConfigError(f'bad --config {spec} ({what}): {_clean(e)}') from e
  if config is None:
    raise ConfigError(f'bad --config file {path}: get_config() returned None')
  return config


def _did_you_mean(path: str) -> str:
  """' (did you mean configs/tiny.py?)': the closest config file under the path's own folder,
  ./configs or the folder of the config files shipped with this checkout."""
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  folders = [os.path.dirname(path) or '.', 'configs', os.path.join(here, 'configs')]
  known = []
  for folder in folders:
    for f in sorted(glob.glob(os.path.join(folder, '*.py'))):
      shown = os.path.relpath(f) if not os.path.relpath(f).startswith('..') else f
      if shown not in known:
        known.append(shown)
  names = {os.path.basename(k): k for k in reversed(known)}
  base = os.path.basename(path) if path.endswith('.py') else os.path.basename(path) + '.py'
  close = difflib.get_close_matches(base, list(names), 1, 0.7)
  if close:
    return f' (did you mean {names[close[0]]}?)'
  return ''


def _clean(e: BaseException) -> str:
  return ' '.join(str(e).split())
