"""Operating a run: a profiler trace of chosen steps, the persistent compilation cache, a
quiet start on a CPU machine with libtpu installed, the data checks made before compiling."""
import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys

import pytest

from helpers import REPO, load_config, local_url_scheme
from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import config_lib, errors
from mtp_jax.checkpoint import store as ckpt_store
from mtp_jax.config_lib import ConfigError
from mtp_jax.data import pipeline
from mtp_jax.runtime import signals
from mtp_jax.train import steps, train_and_evaluate


def _train(workdir, *flags, env=None):
  return subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'train.py'), '--config',
       os.path.join(REPO, 'configs', 'tiny.py'), '--workdir', str(workdir), *flags],
      capture_output=True, text=True, env=env, timeout=900, cwd=REPO)


def test_profile_window_and_compilation_cache(stdlib_data_dir, tmp_path):
  """profile_steps=2:4 leaves an xplane trace under WORKDIR/profile; a second start with a
  longer train.steps, its cache moved to another directory, finds every program it compiles
  in the cache (nothing new is written to it), though its AdamW settings differ too: the
  schedule and the optimizer's settings are inputs of the train step, and the key holds no
  path."""
  cache = tmp_path / 'cache'
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu',
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
  flags = [f'--config.data.data_dir={stdlib_data_dir}', '--config.train.steps=4',
           '--config.train.eval_every=0', '--config.train.checkpoint_every=0',
           '--config.train.eval_batches=1', '--config.train.progress=False',
           f'--config.train.compilation_cache_dir={cache}']
  first = _train(tmp_path / 'a', '--config.train.profile_steps=2:4', *flags, env=env)
  assert first.returncode == 0, first.stderr[-3000:]
  traces = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / 'a' / 'profile')
            for f in files if f.endswith('.xplane.pb')]
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
  assert 'Wrote a profiler trace of steps 2..3' in first.stderr
  entries = sorted(os.listdir(cache))
  assert any(e.startswith('jit_train_step-') for e in entries)  # also init and eval programs
  moved = tmp_path / 'moved_cache'
  os.rename(cache, moved)
  flags = [f.replace(str(cache), str(moved)).replace('steps=4', 'steps=7') for f in flags]
  optimizer = ['--config.train.b1=0.8', '--config.train.b2=0.99',
               '--config.train.weight_decay=0.05', '--config.train.grad_clip=0.5']
  second = _train(tmp_path / 'b', '--config.train.profile_steps=2:4', *flags, *optimizer,
                  env=env)
  assert second.returncode == 0, second.stderr[-3000:]
  assert sorted(os.listdir(moved)) == entries  # every compile was a cache hit


@pytest.mark.parametrize('text,words', [
    ('2', "must be 'A:B'"), ('4:2', "must be 'A:B'"), ('a:b', "must be 'A:B'"),
    ('20:30', 'starts after the last step'),
    ('3:6', 'step 4 inside the window is followed by a checkpoint save'),
])
def test_profile_steps_refused(text, words):
  config = config_lib.base_config()
  config.train.steps, config.train.checkpoint_every, config.train.eval_every = 10, 4, 0
  config.train.profile_steps = text
  with pytest.raises(ConfigError, match=words):
    config_lib.profile_window(config)


def test_profile_window_ends_before_a_save():
  config = config_lib.base_config()
  config.train.steps, config.train.checkpoint_every, config.train.eval_every = 10, 4, 4
  config.train.profile_steps = '2:5'  # steps 2, 3, 4; the save after step 4 is outside
  assert config_lib.profile_window(config) == (2, 5)


def test_read_options_follow_the_host():
  config = config_lib.base_config()
  assert pipeline.default_read_threads(2) == 2
  assert pipeline.default_read_threads(240) == 16
  config.data.read_threads, config.data.prefetch_buffer = 5, 0
  opts = pipeline.read_options(config.data)
  assert (opts.num_threads, opts.prefetch_buffer_size) == (5, 160)
  config.data.prefetch_buffer = 7
  assert pipeline.read_options(config.data).prefetch_buffer_size == 7


def test_bad_jsonl_line_exits_quietly_before_compiling(tmp_path):
  """Line 101 of 201 malformed: exit 2, one stderr line naming it, nothing compiled. Run
  without JAX_PLATFORMS, as a user would: with libtpu installed (the test extra) on a machine
  without a TPU, libtpu's start-up error block must not appear either."""
  path = tmp_path / 'corpus.jsonl'
  good = [json.dumps({'text': f'document {i} with a few words'}) for i in range(100)]
  path.write_text('\n'.join(good + ['{"text": "unterminated'] + good) + '\n')
  env = {k: v for k, v in os.environ.items() if k not in ('JAX_PLATFORMS', 'XLA_FLAGS')}
  proc = _train(tmp_path / 'w', '--config.train.steps=200', '--config.data.source=jsonl',
                f'--config.data.path={path}', '--config.data.seq_len=32', env=env)
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines() == [
      f'error: data.path: {path} line 101 is not valid JSON (Unterminated string starting at: '
      'line 1 column 10 (char 9))']
  assert not (tmp_path / 'w').exists()


def _pins():
  text = open(os.path.join(REPO, 'pyproject.toml')).read()
  jax_pin = re.search(r'"jax>=([0-9.]+),', text).group(1)
  libtpu_pin = re.search(r'tpu = \["libtpu==([0-9.]+)"\]', text).group(1)
  return jax_pin, libtpu_pin


def test_launch_tpu_pod_dry_run_prints_detached_pinned_commands():
  script = os.path.join(REPO, 'scripts', 'launch_tpu_pod.sh')
  proc = subprocess.run(
      ['bash', script, 'my-v5p-64', 'us-east5-a', '--dry_run', '--setup', '--queued', 'v5p-64',
       '--num_slices', '2', '--watch', '60', '--', '--config', 'configs/tpu_pod_1b.py',
       '--workdir', 'runs/pod', '--config.train.checkpoint_dir=gs://bucket/pod'],
      capture_output=True, text=True, timeout=60, cwd=REPO)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  commands = [line for line in lines if line.startswith('+ ')]
  jax_pin, libtpu_pin = _pins()
  creates = [c for c in commands if 'queued-resources create my-v5p-64' in c]
  assert creates and all('--node-count 2' in c for c in creates)
  installs = [c for c in commands if 'pip\\ install' in c]
  assert len(installs) >= 2  # every slice
  for c in installs:
    assert f'jax=={jax_pin}' in c and f'libtpu=={libtpu_pin}' in c, c
  starts = [c for c in commands if 'scripts/train.py --distributed=on' in c.replace('\\', '')]
  checks = [c for c in commands if '--check_storage' in c]
  assert {c.split()[6] for c in checks} == {'my-v5p-64-0', 'my-v5p-64-1'}
  assert {s.split()[6] for s in starts} == {'my-v5p-64-0', 'my-v5p-64-1'}
  for c in starts:
    assert '--worker=all' in c and 'nohup\\ setsid' in c and '~/mtp_jax_train.log' in c, c
    assert 'gs://bucket/pod' in c
  # The watch: a stopped job is started again (the dry run shows one such restart).
  restart = next(i for i, line in enumerate(lines)
                 if line.startswith('the job stopped before its last step'))
  assert 'recreating my-v5p-64 (queued resource SUSPENDED)' in lines[restart:]
  assert any('--distributed=on' in c for c in lines[restart:])
  bad = subprocess.run(['bash', script, 'tpu', 'zone', '--bogus', '--', '--config', 'x'],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
  assert bad.returncode == 2 and 'error: unknown option --bogus' in bad.stderr


_LocalSchemePath = local_url_scheme('mtptest')  # 'mtptest://bucket/run': root/bucket/run


def test_checkpoints_at_a_url_pass_to_orbax_untouched(devices, stdlib_data_dir, tmp_path,
                                                      monkeypatch):
  """train.checkpoint_dir=<URL>: the trainer saves and resumes there, the workdir keeps the
  local files only, and the readers (export, decode, eval) find the checkpoints through
  the workdir's config.json."""
  monkeypatch.setattr(_LocalSchemePath, 'root', str(tmp_path / 'store'))
  seen = []
  manager = ckpt_store.ocp.CheckpointManager

  def spy(directory, *args, **kwargs):
    seen.append(directory)
    return manager(directory, *args, **kwargs)

  monkeypatch.setattr(ckpt_store.ocp, 'CheckpointManager', spy)
  config = load_config('tiny')
  config.data.data_dir = stdlib_data_dir
  config.data.seq_len, config.data.batch_size = 32, 2
  config.train.steps, config.train.checkpoint_every, config.train.eval_every = 4, 2, 0
  config.train.eval_batches, config.train.progress = 1, False
  config.train.checkpoint_dir = 'mtptest://bucket/run'
  workdir = tmp_path / 'work'
  train_and_evaluate(config, str(workdir), devices=devices[:1], stop_after=2)
  assert seen == ['mtptest://bucket/run']
  assert sorted(os.listdir(tmp_path / 'store' / 'bucket' / 'run')) == ['2']
  assert not (workdir / 'checkpoints').exists()
  assert {'config.json', 'metrics.jsonl', 'train.lock'} <= set(os.listdir(workdir))
  train_and_evaluate(config, str(workdir), devices=devices[:1])  # resumes at step 2
  rows = [json.loads(line) for line in open(workdir / 'metrics.jsonl')]
  assert [r['step'] for r in rows if 'train/loss' in r][-1] == 4
  loaded, step = ckpt_lib.load_workdir(str(workdir))
  assert step == 4 and loaded.train.checkpoint_dir == 'mtptest://bucket/run'
  reader = ckpt_lib.CheckpointReader('mtptest://bucket/run')
  assert reader.directory == 'mtptest://bucket/run' and reader.steps() == [2, 4]


def test_a_broken_checkpoint_reason_is_one_readable_line():
  error = ValueError('DATA_LOSS: reading <bound method TensorStore.spec of TensorStore({\n'
                     '  "driver": "zarr", ...})>')
  assert ckpt_store.short(error) == 'ValueError: DATA_LOSS: reading'
  error = ValueError('cannot open <TensorStore object at 0x7f> for step 3')
  assert ckpt_store.short(error) == 'ValueError: cannot open TensorStore for step 3'


def test_sigterm_while_starting_is_one_line_and_leaves_nothing(devices, stdlib_data_dir,
                                                               tmp_path, monkeypatch):
  """SIGTERM during set-up (here: as the model is built and compiled), before the loop's
  preemption guard exists: StartupInterrupted (exit 143, one line), the new workdir removed,
  and SIGTERM's handler given back."""
  setup = steps.setup

  def setup_then_sigterm(*args, **kwargs):
    out = setup(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    return out

  monkeypatch.setattr(steps, 'setup', setup_then_sigterm)
  config = load_config('tiny')
  config.data.data_dir = stdlib_data_dir
  config.data.seq_len, config.data.batch_size = 32, 2
  config.train.steps, config.train.progress = 2, False
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(signals.StartupInterrupted) as e:
    train_and_evaluate(config, str(tmp_path / 'new'), devices=devices[:1])
  assert errors.exit_code_of(e.value) == 143
  assert errors.one_line(e.value).startswith('SIGTERM received while the run was starting')
  assert not (tmp_path / 'new').exists()
  assert signal.getsignal(signal.SIGTERM) is before


def test_a_callback_after_a_closed_loop_is_not_reported(capfd):
  """What an abandoned checkpoint read can leave behind is dropped; other asyncio errors
  still reach the log."""
  handler = logging.StreamHandler()
  logger = logging.getLogger('asyncio')
  logger.addHandler(handler)
  try:
    loop = asyncio.new_event_loop()
    loop.close()
    try:
      loop.call_soon(lambda: None)
    except RuntimeError as e:
      logger.error('Exception in callback', exc_info=(type(e), e, e.__traceback__))
    logger.error('Exception in callback', exc_info=(ValueError, ValueError('real'), None))
  finally:
    logger.removeHandler(handler)
  err = capfd.readouterr().err
  assert 'Event loop is closed' not in err and 'ValueError: real' in err
