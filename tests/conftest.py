"""Shared test setup: 8 fake CPU devices (before JAX starts), the compilation cache, fixtures.

Plain helpers (configs, the word language, batches) live in helpers.py, which tests
import; no test file imports another.
"""
import os
import tempfile

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import pytest  # noqa: E402

from helpers import REPO, TINY_DECODE, make_hf_model, train_word_model  # noqa: E402

# Many tests compile the same tiny programs (init, train step) in separate setups and
# subprocesses; a persistent cache shared by the whole test run compiles each once.
# It lives in the user's cache directory, never in the checkout (which may be read-only).
_CACHE = os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(
    os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'mtp_jax', 'jax_cache'))
jax.config.update('jax_compilation_cache_dir', _CACHE)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)
# flops.cpu_peak caches this machine's CPU peak; a probe taken by a (loaded) test run must
# not become the peak that real runs divide by.
os.environ.setdefault('MTP_JAX_CACHE_DIR',
                      os.path.join(tempfile.gettempdir(), 'mtp_jax_test_cache'))
# model.dtype = 'auto' (the default) resolves by a probe of the host's bf16 dot: pinned to
# float32 so the suite's reference values hold on any CPU (test_bf16.py tests the probe).
os.environ.setdefault('MTP_JAX_AUTO_DTYPE', 'float32')


@pytest.fixture(scope='session')
def devices():
  assert len(jax.devices()) == 8, 'tests expect 8 fake CPU devices (XLA_FLAGS set too late?)'
  return jax.devices()


@pytest.fixture(scope='session')
def stdlib_data_dir(tmp_path_factory):
  """python_stdlib prepared once per test run in a temp data_dir."""
  from mtp_jax.data import stdlib_dataset
  data_dir = str(tmp_path_factory.mktemp('tfds'))
  stdlib_dataset.prepare_stdlib(data_dir=data_dir)
  return data_dir


@pytest.fixture(scope='session')
def tiny_run(stdlib_data_dir, tmp_path_factory):
  """scripts/train.py on configs/tiny.py for 40 steps, run once per test run.

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
  """A M = 3 model trained briefly on the word language, and its workdir.

  Shared by the decode, token-source and ablation tests: one training run.
  """
  return train_word_model(devices, tmp_path_factory)


@pytest.fixture(scope='session')
def hf_models(tmp_path_factory):
  """{family: (directory, transformers model)}: tiny random Llama and Qwen2 checkpoints
  saved once per test run (helpers.HF_FAMILIES)."""
  out = {}
  for family in ('llama', 'qwen2'):
    directory = tmp_path_factory.mktemp(f'hf_{family}')
    out[family] = (str(directory), make_hf_model(str(directory), family))
  return out


# The warnings budget: an exception Python could only report as "ignored" (an event loop,
# file or generator left open somewhere) fails the run even when every test passed. Such
# reports are fixed where they start, never filtered.
_UNRAISABLE = []


def pytest_warning_recorded(warning_message, when, nodeid, location):
  del when, location
  if issubclass(warning_message.category, pytest.PytestUnraisableExceptionWarning):
    _UNRAISABLE.append(nodeid or '(outside a test)')


def pytest_sessionfinish(session, exitstatus):
  if _UNRAISABLE and exitstatus == pytest.ExitCode.OK:
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
  if _UNRAISABLE:
    terminalreporter.write_line(
        f'warnings budget exceeded: {len(_UNRAISABLE)} "Exception ignored" report(s), first '
        f'in {_UNRAISABLE[0]}; fix what leaves it open', red=True)
