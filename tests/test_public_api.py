"""The public face of each sub-package (its `__init__`), listed in docs/development.md, and
the module names of the earlier flat layout, which still import with a warning naming the
new place (or fail naming it)."""
import importlib
import json
import os
import re
import subprocess
import sys
import warnings

import pytest

import mtp_jax
from helpers import REPO
from mtp_jax import config_lib
from mtp_jax.data import tokenizers

PACKAGES = ('checkpoint', 'data', 'decode', 'interop', 'model', 'research', 'runtime', 'train',
            'train_state')


def test_the_short_imports_work():
  from mtp_jax.decode import Decoder, decoder
  from mtp_jax.model import ModelArgs, MTPModel, mtp
  from mtp_jax.train import loss, loss_and_metrics, train_and_evaluate
  assert (MTPModel, ModelArgs, Decoder) == (mtp.MTPModel, mtp.ModelArgs, decoder.Decoder)
  assert loss_and_metrics is loss.loss_and_metrics and train_and_evaluate.__module__ == (
      'mtp_jax.train.loop')


@pytest.mark.parametrize('name', PACKAGES)
def test_each_public_name_is_its_own_packages(name):
  package = importlib.import_module(f'mtp_jax.{name}')
  assert package.__doc__ and len(package.__doc__.strip()) > 40
  for public in package.__all__:
    obj = getattr(package, public)
    module = getattr(obj, '__module__', None)
    assert module is None or module.startswith(f'mtp_jax.{name}.'), (public, module)
  assert set(package.__all__) <= set(dir(package))


def _documented() -> dict:
  """{package: [names]} of the public-names table in docs/development.md."""
  with open(os.path.join(REPO, 'docs', 'development.md'), encoding='utf-8') as f:
    rows = [line for line in f if line.startswith('| `mtp_jax.')]
  out = {}
  for row in rows:
    cells = [c.strip() for c in row.strip().strip('|').split('|')]
    out[cells[0].strip('`')] = re.findall(r'`([A-Za-z_][A-Za-z0-9_]*)`', cells[1])
  return out


def test_the_development_guide_lists_every_public_name():
  documented = _documented()
  assert sorted(documented) == [f'mtp_jax.{p}' for p in PACKAGES]
  for name in PACKAGES:
    package = importlib.import_module(f'mtp_jax.{name}')
    assert sorted(documented[f'mtp_jax.{name}']) == sorted(package.__all__), name


def test_light_modules_and_every_package_face_start_no_jax():
  """Every face is lazy (mtp_jax/exports.py): importing one imports none of its modules."""
  modules = [f'mtp_jax.{p}' for p in PACKAGES] + [
      'mtp_jax.data.corpus', 'mtp_jax.runtime.host_memory', 'mtp_jax.research.stats',
      'mtp_jax.train.metrics']
  code = ('import sys\n' + ''.join(f'import {m}\n' for m in modules) +
          'print(sorted(m for m in ("jax", "flax", "grain", "tensorflow_datasets") '
          'if m in sys.modules))')
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       check=True, env=env)
  assert out.stdout.strip() == '[]'


# -- the flat layout's names ---------------------------------------------------------------
@pytest.mark.parametrize('old', sorted(mtp_jax.MOVED))
def test_a_flat_module_name_imports_the_new_module_with_a_warning(old, monkeypatch):
  new = mtp_jax.MOVED[old]
  monkeypatch.delitem(sys.modules, f'mtp_jax.{old}', raising=False)
  monkeypatch.delitem(vars(mtp_jax), old, raising=False)  # hasattr would import it
  with pytest.warns(DeprecationWarning, match=f'^mtp_jax.{old} moved to {re.escape(new)};'):
    module = importlib.import_module(f'mtp_jax.{old}')
  assert module is importlib.import_module(new)
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    assert getattr(mtp_jax, old) is module  # one warning per process, not per use


def test_the_warning_points_at_the_users_line_and_shows_by_default(tmp_path):
  script = tmp_path / 'old_user.py'
  script.write_text('import mtp_jax.state\nfrom mtp_jax import loss\n'
                    'print(mtp_jax.state.__name__, loss.__name__)\n')
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  env.pop('PYTHONWARNINGS', None)
  out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       check=True, env=env)
  assert out.stdout.split() == ['mtp_jax.train_state', 'mtp_jax.train.loss']
  lines = [l for l in out.stderr.splitlines() if 'DeprecationWarning' in l]
  assert lines == [
      f'{script}:1: DeprecationWarning: mtp_jax.state moved to mtp_jax.train_state; '
      'import it from there',
      f'{script}:2: DeprecationWarning: mtp_jax.loss moved to mtp_jax.train.loss; '
      'import it from there']


def test_the_split_converter_is_an_error_naming_its_parts():
  with pytest.raises(ImportError, match='from_hf .* mtp_jax.interop.params_from_hf') as e:
    import mtp_jax.convert  # noqa: F401  pylint: disable=unused-import
  assert '\n' not in str(e.value)
  with pytest.raises(ImportError, match='mtp_jax.interop.to_hf_tensors'):
    from mtp_jax import convert  # noqa: F401  pylint: disable=unused-import
  with pytest.raises(ModuleNotFoundError):
    import mtp_jax.no_such_module  # noqa: F401  pylint: disable=unused-import


def test_the_old_int_resolve_vocab_size_warns_and_still_returns_the_int():
  import mtp_jax.model
  c = config_lib.base_config()
  with pytest.warns(DeprecationWarning, match='mtp_jax.data.model_vocab_size'):
    old = mtp_jax.model.resolve_vocab_size
  assert old(c) == tokenizers.model_vocab_size(c) == 320 and c.model.vocab_size == 0
  assert tokenizers.resolve_vocab_size(c) is c and c.model.vocab_size == 320


# -- the previous release's names ------------------------------------------------------------
def _previous_release() -> dict:
  """{module: [public names]} of the release before this one: every module of its
  sub-package layout and the classes, functions and constants each defined."""
  with open(os.path.join(REPO, 'tests', 'previous_release_names.json'), encoding='utf-8') as f:
    return json.load(f)


def test_every_name_of_the_previous_release_imports_or_names_its_new_place():
  """Each still imports (a moved one with a DeprecationWarning naming where it went), or is
  an ImportError that says what replaced it; never a bare ImportError."""
  moved, removed = [], []
  for module_name, names in _previous_release().items():
    try:
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        module = importlib.import_module(module_name)
    except ImportError as e:  # a split module: the error names each part's new module
      assert 'mtp_jax.interop.' in str(e) and module_name in str(e), (module_name, e)
      removed.append(module_name)
      continue
    for w in caught:
      assert 'moved to mtp_jax.' in str(w.message), (module_name, w.message)
    for name in names:
      try:
        with warnings.catch_warnings(record=True) as caught:
          warnings.simplefilter('always')
          getattr(module, name)
      except ImportError as e:
        assert f'{module_name}.{name} was removed: ' in str(e) and 'mtp_jax.' in str(e), e
        removed.append(f'{module_name}.{name}')
        continue
      notes = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
      if notes:
        assert notes[0].startswith(f'{module_name}.{name} moved to mtp_jax.'), notes
        moved.append(f'{module_name}.{name}')
  assert 'mtp_jax.checkpoint.partial.InitFrom' in moved
  assert 'mtp_jax.commands.ablation.aggregate' in moved
  assert sorted(removed) == sorted(['mtp_jax.interop.convert', *mtp_jax.REMOVED_NAMES])
  assert sorted(moved) == sorted(mtp_jax.MOVED_NAMES)


def test_three_moved_names_import_from_their_old_places(monkeypatch):
  import mtp_jax.model
  from mtp_jax import train_state
  from mtp_jax.research import families
  monkeypatch.delitem(sys.modules, 'mtp_jax.model.state', raising=False)
  monkeypatch.delitem(vars(mtp_jax.model), 'state', raising=False)
  with pytest.warns(DeprecationWarning, match='mtp_jax.model.state moved to mtp_jax.train_state'):
    import mtp_jax.model.state as old_state
  assert old_state is train_state  # the same module object, not a second copy of it
  assert sys.modules['mtp_jax.train_state'] is train_state
  with pytest.warns(DeprecationWarning, match='moved to mtp_jax.train_state.InitFrom'):
    from mtp_jax.checkpoint.partial import InitFrom
  assert InitFrom is train_state.InitFrom
  with pytest.warns(DeprecationWarning, match='moved to mtp_jax.research.families.aggregate'):
    from mtp_jax.commands.ablation import aggregate
  assert aggregate is families.aggregate
  with pytest.raises(ImportError, match='bitwise_thresholds=False'):
    from mtp_jax.decode.sampling import BITWISE_THRESHOLDS  # noqa: F401
  with pytest.raises(AttributeError):
    mtp_jax.moved_name('mtp_jax.train.flops', 'no_such_name')
