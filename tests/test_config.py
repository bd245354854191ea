"""Config validation: every bad value fails before compiling, with the field named."""
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
  with pytest.raises(ConfigError, match=r'mesh\.shape .* 4 devices but 8 are available'):
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


def test_every_config_validates():
  for name in sorted(os.listdir(os.path.join(REPO, 'configs'))):
    if name.endswith('.py') and not name.startswith('_'):
      config_lib.validate(load_config(name[:-3]))


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
  assert not os.path.exists(tmp_path / 'checkpoints')  # nothing ran
