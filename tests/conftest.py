"""Shared test setup: 8 fake CPU devices (before JAX starts), tiny configs."""
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import pytest  # noqa: E402

from mtp_jax import config_lib  # noqa: E402


def tiny_model_config(depth=2, kind='sequential', vocab=64, **model):
  """A config whose model is tiny; data fields untouched."""
  c = config_lib.base_config()
  c.model.vocab_size = vocab
  c.model.d_model = 32
  c.model.n_layers = 2
  c.model.n_heads = 4
  c.model.n_kv_heads = 2
  c.model.head_dim = 8
  c.model.mlp_dim = 64
  c.model.mtp.depth = depth
  c.model.mtp.kind = kind
  c.data.seq_len = 16
  c.data.batch_size = 8
  for k, v in model.items():
    c.model[k] = v
  return c


@pytest.fixture(scope='session')
def devices():
  assert len(jax.devices()) == 8, 'tests expect 8 fake CPU devices (XLA_FLAGS set too late?)'
  return jax.devices()
