"""Shared test setup: 8 fake CPU devices (before JAX starts), tiny configs."""
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import importlib.util  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from mtp_jax import config_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_DECODE = (4, 16)  # tiny_run's decode eval: prompts, new tokens each

# Many tests compile the same tiny programs (init, train step) in separate setups and
# subprocesses; a persistent cache shared by the session compiles each once.
_CACHE = os.environ.setdefault('JAX_COMPILATION_CACHE_DIR',
                               os.path.join(REPO, '.pytest_cache', 'jax_compilation_cache'))
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
# flops.cpu_peak caches this machine's CPU peak; a probe taken by a (loaded) test run must
# not become the peak that real runs divide by.
os.environ.setdefault('MTP_JAX_CACHE_DIR', os.path.join(REPO, '.pytest_cache', 'mtp_jax'))


def load_config(name: str):
  """configs/<name>.py's get_config()."""
  path = os.path.join(REPO, 'configs', f'{name}.py')
  spec = importlib.util.spec_from_file_location(f'configs_{name}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


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


@pytest.fixture(scope='session')
def stdlib_data_dir(tmp_path_factory):
  """python_stdlib prepared once per session in a temp data_dir."""
  from mtp_jax.data import stdlib_dataset
  data_dir = str(tmp_path_factory.mktemp('tfds'))
  stdlib_dataset.prepare_stdlib(data_dir=data_dir)
  return data_dir


@pytest.fixture(scope='session')
def tiny_run(stdlib_data_dir, tmp_path_factory):
  """scripts/train.py on configs/tiny.py for 40 steps, run once per session.

  Its evals also decode 4 validation prompts (eval/decode_*), which test_eval.py checks
  against scripts/eval.py. Returns (workdir, CompletedProcess); tests of outputs,
  notebooks, plots, evaluation and decoding share it.
  """
  import subprocess
  import sys
  workdir = tmp_path_factory.mktemp('tiny_run') / 'run'
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu')
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'train.py'),
       '--config', os.path.join(REPO, 'configs', 'tiny.py'), '--workdir', str(workdir),
       f'--config.data.data_dir={stdlib_data_dir}', '--config.train.steps=40',
       '--config.train.eval_every=20', '--config.train.checkpoint_every=20',
       f'--config.train.eval_decode_prompts={TINY_DECODE[0]}',
       f'--config.train.eval_decode_tokens={TINY_DECODE[1]}'],
      capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return workdir, proc


@pytest.fixture(scope='session')
def trained(devices, tmp_path_factory):
  """A D = 3 model trained briefly on test_decode's word language, and its workdir.

  Defined here, not in a test module, so the decode and token-source tests share one
  training run.
  """
  import test_decode  # pylint: disable=g-import-not-at-top
  return test_decode.train_word_model(devices, tmp_path_factory)
