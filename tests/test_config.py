"""Config validation: every bad value fails before compiling, with the field named."""
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, load_config
from mtp_jax import config_lib
from mtp_jax.config_lib import ConfigError


def _cfg():
  return load_config('tiny')


@pytest.mark.parametrize('mutate, words', [
    (lambda c: setattr(c.model.mtp, 'depth', -1), 'model.mtp.depth'),
    (lambda c: setattr(c.model.mtp, 'depth', 63), 'model.mtp.depth'),  # >= seq_len - 1
    (lambda c: setattr(c.model.mtp, 'kind', 'medusa'), 'model.mtp.kind'),
    (lambda c: setattr(c.model.mtp, 'weights', (0.1,)), 'model.mtp.weights'),
    (lambda c: setattr(c.model.mtp, 'lambda_values', (0.3, 0.1)), 'lambda_boundaries'),
    (lambda c: setattr(c.model.mtp, 'lambda_values', (-0.3,)), 'lambda_values'),
    (lambda c: setattr(c.model, 'n_kv_heads', 3), 'n_kv_heads'),
    (lambda c: setattr(c.model, 'head_dim', 15), 'model.head_dim'),
    (lambda c: setattr(c.model, 'loss_chunk', 7), 'model.loss_chunk'),
    (lambda c: setattr(c.model, 'dtype', 'int8'), 'model.dtype'),
    (lambda c: setattr(c.train, 'lr', -1.0), 'train.lr'),
    (lambda c: setattr(c.train, 'grad_accum', 0), 'train.grad_accum'),
    (lambda c: setattr(c.data, 'tokenizer', 'wordpiece'), 'data.tokenizer'),
    (lambda c: setattr(c.data, 'seq_len', 0), 'data.seq_len'),
    (lambda c: setattr(c.mesh, 'rules', (('batch', 'pipeline'),)), 'mesh.rules'),
])
def test_bad_values_name_their_field(mutate, words):
  c = _cfg()
  mutate(c)
  with pytest.raises(ConfigError, match=words.replace('.', r'\.')):
    config_lib.validate(c)


def test_mesh_and_batch_checks_against_device_count():
  c = _cfg()
  c.mesh.shape = (2, 2, 1)
  with pytest.raises(ConfigError, match=r'mesh data 2 x fsdp 2 has 4 devices but 8 are available'):
    config_lib.validate(c, num_devices=8)
  c.mesh.shape = (-1, 1, 1)
  c.data.batch_size = 12
  with pytest.raises(ConfigError, match=r'data\.batch_size \(12\) must be divisible'):
    config_lib.validate(c, num_devices=8)
  c.data.batch_size = 8
  c.train.grad_accum = 2
  with pytest.raises(ConfigError, match='grad_accum'):
    config_lib.validate(c, num_devices=8)
  c.train.grad_accum = 1
  c.mesh.shape = (4, 1, 2)
  c.model.n_kv_heads = 1
  c.model.n_heads = 1
  with pytest.raises(ConfigError, match='tensor axis'):
    config_lib.validate(c, num_devices=8)
  assert config_lib.resolved_mesh_shape((-1, 2, 1), 8) == (4, 2, 1)


def test_named_mesh_axes_and_the_older_positional_shape():
  """mesh.axes names every axis (outermost first); the older mesh.shape (data, fsdp,
  tensor) of configs and saved config.json files reads as those three axes."""
  c = _cfg()
  assert config_lib.MESH_AXES == ('data', 'stage', 'fsdp', 'context', 'tensor')
  assert config_lib.resolved_mesh_axes(c.mesh, 8) == {
      'data': 8, 'stage': 1, 'fsdp': 1, 'context': 1, 'tensor': 1}
  c.mesh.axes.fsdp, c.mesh.axes.context = 2, 2
  assert tuple(config_lib.resolved_mesh_axes(c.mesh, 8).values()) == (2, 1, 2, 2, 1)
  c = _cfg()
  c.mesh.shape = (-1, 2, 1)  # the older form; axes may add context beside it
  c.mesh.axes.context = 2
  assert config_lib.resolved_mesh_axes(c.mesh, 8) == {
      'data': 2, 'stage': 1, 'fsdp': 2, 'context': 2, 'tensor': 1}
  c.mesh.axes.tensor = 2
  with pytest.raises(ConfigError, match=r'mesh\.shape \(-1, 2, 1\) and mesh\.axes\.tensor'):
    config_lib.validate(c, num_devices=8)
  c = _cfg()
  c.mesh.axes.fsdp = -1
  with pytest.raises(ConfigError, match='only one axis may be -1'):
    config_lib.validate(c)
  c.mesh.axes.fsdp = 1
  c.mesh.axes.stage = 2  # pipeline stages must share the trunk's layers evenly
  n_layers, c.model.n_layers = c.model.n_layers, 3
  with pytest.raises(ConfigError, match='do not divide into mesh.axes.stage = 2'):
    config_lib.validate(c)
  c.mesh.axes.stage, c.model.n_layers = 1, n_layers
  c.mesh.axes.data = 0
  with pytest.raises(ConfigError, match='mesh.axes.data must be a positive integer or -1'):
    config_lib.validate(c)


def test_saved_config_json_of_either_mesh_form_reads_back(tmp_path):
  """A config.json saved before the axes were named (mesh.shape, no mesh.axes) gives the
  same mesh as before; one saved now (mesh.axes, shape null) round-trips."""
  from mtp_jax import config_files
  old = json.loads(_cfg().to_json_best_effort())
  del old['mesh']['axes']
  old['mesh']['shape'] = [2, 2, 1]
  (tmp_path / 'old.json').write_text(json.dumps(old))
  loaded = config_files.load_saved(str(tmp_path / 'old.json'))
  config_lib.validate(loaded, num_devices=4)
  assert config_lib.resolved_mesh_axes(loaded.mesh, 4) == {
      'data': 2, 'stage': 1, 'fsdp': 2, 'context': 1, 'tensor': 1}
  c = _cfg()
  c.mesh.axes.data, c.mesh.axes.context = 2, 4
  (tmp_path / 'new.json').write_text(c.to_json_best_effort())
  loaded = config_files.load_saved(str(tmp_path / 'new.json'))
  assert loaded.mesh.shape is None
  assert config_lib.resolved_mesh_axes(loaded.mesh, 8)['context'] == 4


def test_every_config_validates():
  for name in sorted(os.listdir(os.path.join(REPO, 'configs'))):
    if name.endswith('.py') and not name.startswith('_'):
      config_lib.validate(load_config(name[:-3]))


def test_cpu_devices_auto_rule(monkeypatch):
  """--cpu_devices: numbers as given; auto = 2 only for a single-process CPU job on 2+
  cores whose config is valid with 2 and whose device count nobody fixed already."""
  from mtp_jax.runtime import distributed
  tiny = load_config('tiny')
  assert distributed.resolve_cpu_devices('4', tiny) == 4
  assert distributed.resolve_cpu_devices(None, tiny) is None
  for bad in ('0', '-2', 'two'):
    with pytest.raises(ValueError, match='--cpu_devices must be a positive integer or auto'):
      distributed.resolve_cpu_devices(bad, tiny)
  # conftest fixes 8 devices through XLA_FLAGS: auto leaves that alone
  assert distributed.resolve_cpu_devices('auto', tiny) is None
  monkeypatch.setenv('XLA_FLAGS', '')
  for var in ('JAX_PLATFORMS', 'JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'SLURM_NTASKS',
              'SLURM_STEP_NUM_TASKS', 'OMPI_COMM_WORLD_SIZE', 'TPU_WORKER_HOSTNAMES'):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setattr(distributed.machine, 'usable_cores', lambda: 2)
  assert distributed.resolve_cpu_devices('auto', tiny) == 2
  assert distributed.resolve_cpu_devices('auto', None) == 2
  odd = load_config('tiny')
  odd.data.batch_size = 7  # not divisible by 2 data-parallel devices: stay on one
  assert distributed.resolve_cpu_devices('auto', odd) is None
  assert distributed.resolve_cpu_devices('auto', tiny, coordinator_address='h:1') is None
  assert distributed.resolve_cpu_devices('auto', tiny, num_processes=2) is None
  assert distributed.resolve_cpu_devices('auto', tiny, mode='on') is None
  monkeypatch.setattr(distributed.machine, 'usable_cores', lambda: 1)
  assert distributed.resolve_cpu_devices('auto', tiny) is None
  monkeypatch.setattr(distributed.machine, 'usable_cores', lambda: 2)
  monkeypatch.setenv('JAX_PLATFORMS', 'cuda')
  assert distributed.resolve_cpu_devices('auto', tiny) is None


def _run_train(*args):
  env = dict(os.environ, XLA_FLAGS='')
  return subprocess.run([sys.executable, os.path.join(REPO, 'scripts', 'train.py'),
                         '--config', os.path.join(REPO, 'configs', 'tiny.py'), *args],
                        capture_output=True, text=True, env=env, timeout=120, cwd=REPO)


def test_cli_misspelled_key_and_bad_value(tmp_path):
  proc = _run_train('--config.model.mtp.dept=2', f'--workdir={tmp_path}')
  assert proc.returncode != 0 and 'dept' in proc.stderr
  proc = _run_train('--config.model.mtp.depth=-2', f'--workdir={tmp_path}')
  assert proc.returncode == 2
  assert 'error: model.mtp.depth must be a non-negative integer' in proc.stderr
  proc = _run_train('--host_malloc=tcmalloc', f'--workdir={tmp_path}')
  assert proc.returncode == 2
  assert proc.stderr.strip() == ("error: bad flag: --host_malloc must be one of auto, keep, "
                                 "system, got tcmalloc")
  assert not os.path.exists(tmp_path / 'checkpoints')  # nothing ran


def test_config_file_argument_selects_the_variant():
  """`--config path:argument` is get_config(argument), as in ml_collections' config flags."""
  from mtp_jax import cli, config_files
  ablation = config_files.load_module(os.path.join(REPO, 'configs', 'ablation.py'))
  c = cli.load_config(os.path.join(REPO, 'configs', 'ablation.py:d1'), ['--config.train.steps=2'])
  want = ablation.get_config('d1')
  assert c.model.mtp.depth == 1 and want.model.mtp.depth == 1 and c.train.steps == 2
  want.train.steps = 2
  assert c.to_dict() == want.to_dict()
  assert config_files.load(os.path.join(REPO, 'configs', 'ablation.py:d3p')).model.mtp.kind == (
      'parallel')
  assert config_files.split_spec('a/b.py:x,y') == ('a/b.py', 'x,y')
  assert config_files.split_spec('a/b.py') == ('a/b.py', None)


@pytest.mark.parametrize('text, spec_tail, words', [
    (None, ':d1', ['cannot load --config', 'No such file or directory']),
    ('x = 1\n', '', ['defines no get_config()']),
    ('import nothing_here\n', '', ['bad --config file', 'ModuleNotFoundError']),
    ('def get_config(arg):\n  raise ValueError(f"unknown variant {arg!r}")\n', ':d9',
     ['bad --config', "argument 'd9'", "unknown variant 'd9'"]),
    ('def get_config():\n  return None\n', '', ['get_config() returned None']),
])
def test_config_file_errors_are_one_line(tmp_path, text, spec_tail, words):
  from mtp_jax import config_files
  path = tmp_path / 'c.py'
  if text is not None:
    path.write_text(text)
  with pytest.raises(ConfigError) as e:
    config_files.load(f'{path}{spec_tail}')
  message = str(e.value)
  assert '\n' not in message and all(w in message for w in words), message


def test_a_runs_saved_config_json_is_a_config_file(tmp_path):
  """--config WORKDIR/config.json: the saved config over base_config(), overrides applied."""
  from mtp_jax import cli  # pylint: disable=g-import-not-at-top
  saved = load_config('tiny')
  path = tmp_path / 'config.json'
  path.write_text(saved.to_json_best_effort(indent=2))
  config = cli.load_config(str(path), ['--config.train.steps=3'])
  assert config.train.steps == 3 and config.model.d_model == saved.model.d_model
  assert config.model.mtp.depth == saved.model.mtp.depth
  path.write_text('[1, 2]')
  with pytest.raises(ConfigError, match='not a saved run config'):
    cli.load_config(str(path))
