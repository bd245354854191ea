"""Shared test setup: 8 fake CPU devices (before JAX starts), tiny configs."""
import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import importlib.util  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from mtp_jax import checkpoint as ckpt_lib  # noqa: E402
from mtp_jax import config_lib  # noqa: E402
from mtp_jax import steps as steps_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_DECODE = (4, 16)  # tiny_run's decode eval: prompts, new tokens each

# Many tests compile the same tiny programs (init, train step) in separate setups and
# subprocesses; a persistent cache shared by the session compiles each once.
# It lives in the user's cache directory, never in the checkout (which may be read-only).
_CACHE = os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(
    os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'mtp_jax', 'jax_cache'))
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


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


# -- the word language: tiny byte-level models that learn it reach high acceptance ----------
WORDS = ['abc', 'defg', 'hij', 'klmno', 'pqr', 'stuv', 'wxyz', '0123']  # disjoint letters


def byte_config(depth=3, kind='sequential'):
  """A tiny model over the byte tokenizer's vocabulary (258 -> 320), so the CLI can run it."""
  return tiny_model_config(depth, kind, vocab=0)


def byte_ids(text):
  return [b + 2 for b in text.encode()]


def word_text(rng, n_chars):
  """Random words separated by spaces: deterministic inside a word, random at its start."""
  out = ''
  while len(out) < n_chars:
    out += WORDS[rng.integers(len(WORDS))] + ' '
  return out


def train_word_model(devices, tmp_path_factory):
  """A D = 3 model trained briefly on the word language (high acceptance), and its workdir.

  The workdir holds a checkpoint written exactly as train_and_evaluate writes one
  (model + optimizer state, meta with the config) and config.json.
  """
  config = byte_config(3)
  config.data.seq_len, config.data.batch_size = 64, 16
  config.train.steps, config.train.warmup_steps, config.train.lr = 100, 10, 1e-2
  config.model.mtp.weights = (1.0, 1.0, 1.0)
  config.mesh.shape = (1, 1, 1)
  ts, state = steps_lib.setup(config, devices[:1])
  rng = np.random.default_rng(0)
  pos = np.broadcast_to(np.arange(64, dtype=np.int32), (16, 64))
  for _ in range(config.train.steps):
    tokens = np.array([byte_ids(word_text(rng, 80)[(s := rng.integers(8)):s + 64])
                       for _ in range(16)], np.int32)
    batch = {'tokens': tokens, 'segment_ids': np.ones_like(tokens), 'positions': pos}
    state, metrics = steps_lib.run_step(ts, state, batch)
  # Entropy floor: log(8) at each word start (1 position in 4.6), 0 elsewhere: 0.45 per depth.
  per_depth = metrics['loss_sum'] / metrics['count']
  assert np.all(per_depth < 0.6), per_depth
  workdir = str(tmp_path_factory.mktemp('decode_workdir'))
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, 'checkpoints'), async_save=False)
  meta = {'step': config.train.steps, 'config': json.loads(config.to_json_best_effort())}
  ckpt.save(config.train.steps, state, meta=meta, force=True)
  ckpt.close()
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2))
  model, _ = nnx.merge(ts.graphdef, state)
  return model, workdir


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
  """A D = 3 model trained briefly on the word language, and its workdir.

  Shared by the decode, token-source and ablation tests: one training run.
  """
  return train_word_model(devices, tmp_path_factory)
