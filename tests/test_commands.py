"""The user commands: each console entry point resolves, `--help` names its options with
their defaults, and no script or test reaches the package by a path hack."""
import importlib
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

from helpers import REPO

with open(os.path.join(REPO, 'pyproject.toml'), 'rb') as f:
  ENTRY_POINTS = tomllib.load(f)['project']['scripts']


@pytest.mark.parametrize('name', sorted(ENTRY_POINTS))
def test_help_of_every_command(name, capsys):
  module, func = ENTRY_POINTS[name].split(':')
  main = getattr(importlib.import_module(module), func)
  with pytest.raises(SystemExit) as e:
    main(['--help'])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith(f'usage: {name} ') and '--' in out
  assert 'default:' in out or name in ('mtp-plot',), out  # options with defaults name them


@pytest.mark.parametrize('name', sorted(ENTRY_POINTS))
def test_scripts_are_thin_wrappers_of_the_commands(name):
  module = ENTRY_POINTS[name].split(':')[0]
  script = os.path.join(REPO, 'scripts', module.rsplit('.', 1)[1].replace('evaluate', 'eval')
                        + '.py')
  text = pathlib.Path(script).read_text(encoding='utf-8')
  assert f'from {module} import main' in text
  assert len(text.splitlines()) <= 15, f'{script} is more than a wrapper'


def test_no_path_hacks():
  hits = subprocess.run(['git', 'grep', '-nE', r'sys\.path\.(insert|append)|spec_from_file_location'
                         r"\(.*scripts", '--', '*.py'], cwd=REPO, capture_output=True, text=True)
  assert hits.stdout == '', hits.stdout


def test_bad_flag_is_one_line(capsys):
  from mtp_jax.commands import decode
  with pytest.raises(SystemExit) as e:
    decode.main(['--workdir', 'x', '--mode', 'fast'])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith('error: ') and '--mode' in err[0]


def test_import_mtp_jax_starts_no_heavy_library():
  code = ('import sys, mtp_jax, mtp_jax.cli; '
          'print(sorted(m for m in ("jax", "tensorflow_datasets", "torch") if m in sys.modules))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == '[]'
