"""Honest figures and clean edges: an MFU that cannot read above 1, failed starts that
leave nothing behind, readers beside a live trainer.

Trainer runs use tiny.py on a small jsonl corpus written here, on one device.
"""
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import pytest

from helpers import REPO, load_config
from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import cli
from mtp_jax.commands import train as train_cmd
from mtp_jax.errors import ConfigError
from mtp_jax.runtime import peak as peak_lib
from mtp_jax.train import metrics as metrics_lib
from mtp_jax.train import resilience, train_and_evaluate

WORDS = ['alpha', 'beta', 'gamma', 'delta', 'def', 'return', 'class', 'import', 'while']


def write_jsonl(path, lines=30, bad_line=None):
  """`lines` records of word text; line `bad_line` (1-based) an unterminated JSON string."""
  with open(path, 'w') as f:
    for i in range(1, lines + 1):
      if i == bad_line:
        f.write('{"text": "unterminated\n')
      else:
        text = ' '.join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(60))
        f.write(json.dumps({'text': text}) + '\n')
  return str(path)


def jsonl_config(path, **train_fields):
  c = load_config('tiny')
  c.data.source, c.data.path, c.data.seq_len = 'jsonl', str(path), 32
  c.data.validation_percent = 20
  c.train.progress = False
  fields = dict(steps=4, log_every=2, eval_every=0, checkpoint_every=0, eval_batches=1)
  for k, v in {**fields, **train_fields}.items():
    c.train[k] = v
  return c


def rows_of(workdir):
  text = pathlib.Path(workdir, 'metrics.jsonl').read_text()
  return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def peak_cache(tmp_path, monkeypatch):
  """An empty peak cache of this test's own; MTP_JAX_CPU_PEAK_FLOPS unset."""
  monkeypatch.setenv(peak_lib.CACHE_DIR_ENV, str(tmp_path / 'peak_cache'))
  monkeypatch.delenv(peak_lib.PEAK_ENV, raising=False)
  return tmp_path / 'peak_cache' / 'cpu_peak_flops.json'


def poison(cache_file, flops, load=0.1, date='2026-01-01T00:00:00'):
  os.makedirs(os.path.dirname(cache_file), exist_ok=True)
  record = {'flops': flops, 'date': date, 'load_average': [load, load]}
  with open(cache_file, 'w') as f:
    json.dump({peak_lib.machine_key(jnp.float32): record}, f)


def cached(cache_file):
  return json.loads(pathlib.Path(cache_file).read_text())[peak_lib.machine_key(jnp.float32)]


# ------------------------------------------------------------------------------------ peak

def test_poisoned_peak_cache_keeps_the_trainers_mfu_at_most_one(devices, peak_cache, tmp_path,
                                                                 monkeypatch, capfd):
  """A cached peak of 1 kFLOP/s, and probes that read as low: the run's own FLOP/s raise it,
  perf/mfu stays <= 1, the console says so once and the peak used is in metrics.jsonl.
  The workdir also holds a stale train.lock of a process that is gone: no obstacle."""
  poison(peak_cache, 1e3)
  monkeypatch.setattr(peak_lib, 'matmul_probe', lambda *a, **k: 1e3)
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / resilience.LOCK_FILE).write_text(
      json.dumps({'pid': 2 ** 22 + 12345, 'host': 'gone', 'since': '2026-01-01'}) + '\n')
  train_and_evaluate(jsonl_config(write_jsonl(tmp_path / 'docs.jsonl'), steps=6),
                           str(workdir), devices=devices[:1])
  perf = [r for r in rows_of(workdir) if 'perf/mfu' in r]
  assert len(perf) == 3 and all(0 < r['perf/mfu'] <= 1 for r in perf)
  assert perf[0]['perf/peak_flops'] > 1e3 and perf[0]['perf/peak_date']
  stored = cached(peak_cache)  # raised to what the run achieved (by its fastest window)
  assert stored['flops'] == max(r['perf/peak_flops'] for r in perf if 'perf/peak_flops' in r)
  assert stored['flops'] > 1e6 and stored['replaced']['flops'] < stored['flops']
  err = capfd.readouterr().err
  assert err.count('above the peak') == 1, err


def test_a_probe_above_the_cache_raises_it_and_a_loaded_cache_gives_way(peak_cache,
                                                                        monkeypatch):
  readings = []
  monkeypatch.setattr(peak_lib, 'matmul_probe', lambda *a, **k: readings.pop(0))
  load = [0.2]
  monkeypatch.setattr(os, 'getloadavg', lambda: (load[0], load[0], load[0]))
  busy = 4.0 * os.cpu_count()  # a load average that keeps every core busy
  # A cache 50 GFLOP/s; the quick probe reads 55: raised to 55, no full probe.
  poison(peak_cache, 50e9)
  readings[:] = [55e9]
  peak = peak_lib.job_peak()
  assert peak.flops == 55e9 and 'raised from 50.0 GFLOP/s by this run' in peak.line()
  assert not readings
  # A cache of 20 (taken under load); the quick probe reads 150: a full probe follows.
  poison(peak_cache, 20e9, load=busy)
  rounds = len(peak_lib.PROBE_SIZES)
  readings[:] = [150e9] + [190e9] * rounds
  peak = peak_lib.job_peak()
  assert peak.flops == 190e9 and not peak.loaded and not readings
  assert cached(peak_cache)['replaced']['flops'] == 20e9
  # A loaded cache and a quiet machine now: probed in full even when the quick one is
  # lower; a lower full probe confirms the cache, which is then no longer "loaded".
  poison(peak_cache, 200e9, load=busy)
  load[0] = 0.1
  readings[:] = [150e9] + [180e9] * rounds
  peak = peak_lib.job_peak()
  assert peak.flops == 200e9 and not peak.loaded and cached(peak_cache)['confirmed']
  assert f'load {busy:.1f}' in peak.line() and len(peak.line()) < 120
  # A loaded cache on a machine still loaded: reported as such, kept.
  poison(peak_cache, 60e9, load=busy)
  load[0] = busy * 0.75
  readings[:] = [40e9]
  peak = peak_lib.job_peak()
  assert peak.flops == 60e9 and peak.loaded and 'taken under load' in peak.line()


def test_benchmark_mfu_never_exceeds_one_and_raises_the_cache(peak_cache):
  """peak_lib.mfu: what a benchmark's MFU figure divides by."""
  poison(peak_cache, 100e9)
  told = []
  value, peak = peak_lib.mfu(50e9, source='a benchmark', notify=told.append)
  assert value == 0.5 and peak.flops == 100e9 and not told
  value, peak = peak_lib.mfu(250e9, source='a benchmark', notify=told.append)
  assert value == 1.0 and peak.flops == 250e9 and len(told) == 1 and 'a benchmark' in told[0]
  assert cached(peak_cache)['flops'] == 250e9
  assert peak_lib.mfu(125e9, source='a benchmark')[0] == 0.5  # divides by the raised peak
  assert peak.check(300e9, told.append) == 1.0 and len(told) == 1  # said once only


def test_an_accelerators_table_peak_also_caps_mfu_at_one():
  class Chip:
    platform, device_kind, process_index = 'gpu', 'NVIDIA H200', 0

  peak = peak_lib.job_peak(jnp.bfloat16, [Chip()] * 4)
  assert peak.flops == 4 * 989e12 and peak.kind == 'table'
  assert peak.line() == ('peak: 3.96 PFLOP/s for MFU (989 TFLOP/s per chip x 4, '
                         'data sheet)')
  told = []
  assert peak.check(2e15, told.append) == 2e15 / peak.flops
  assert peak.check(5e15, told.append) == 1.0 and len(told) == 1 and 'cache' not in told[0]


# ----------------------------------------------------------------------------- failed starts

def expect_exit_2(fn, *words):
  with pytest.raises(Exception) as e:
    fn()
  assert cli.exit_code_of(e.value) == 2, repr(e.value)
  line = cli.one_line(e.value)
  for w in words:
    assert w in line, (w, line)
  return line


def test_a_failure_during_training_leaves_no_workdir_until_a_checkpoint(devices, tmp_path):
  """A bad line past the first is found before the run starts (nothing written); a failure
  some steps in takes a new workdir away (lock included); a workdir that existed keeps
  exactly what it held; once a checkpoint exists, all stays."""
  bad = write_jsonl(tmp_path / 'bad.jsonl', bad_line=3)
  workdir = tmp_path / 'new' / 'run'
  expect_exit_2(lambda: train_and_evaluate(jsonl_config(bad, steps=40), str(workdir),
                                                 devices=devices[:1]),
                'bad.jsonl line 3 is not valid JSON')
  assert not (tmp_path / 'new').exists()

  docs = write_jsonl(tmp_path / 'docs.jsonl')

  def fail_at_step_3(step, batch):
    if step == 3:
      raise ConfigError('data: a record went bad at step 3')
    return batch

  config = jsonl_config(docs, steps=40, log_every=5)
  run = lambda wd: train_and_evaluate(config, str(wd), devices=devices[:1],  # noqa: E731
                                            batch_hook=fail_at_step_3)
  expect_exit_2(lambda: run(workdir), 'went bad at step 3')
  assert not (tmp_path / 'new').exists()

  mine = tmp_path / 'mine'
  mine.mkdir()
  (mine / 'notes.txt').write_text('keep me')
  expect_exit_2(lambda: run(mine), 'went bad at step 3')
  assert os.listdir(mine) == ['notes.txt']

  kept = tmp_path / 'kept'
  config = jsonl_config(docs, steps=40, log_every=5, checkpoint_every=2)
  expect_exit_2(lambda: run(kept), 'went bad at step 3')
  assert os.listdir(kept / 'checkpoints') and (kept / 'metrics.jsonl').exists()


def test_an_empty_data_directory_and_a_bad_config_key_leave_no_workdir(devices, tmp_path,
                                                                      monkeypatch):
  (tmp_path / 'empty').mkdir()
  workdir = tmp_path / 'run'
  config = jsonl_config(tmp_path / 'empty')
  line = expect_exit_2(lambda: train_and_evaluate(config, str(workdir),
                                                        devices=devices[:1]),
                       'contains no .jsonl files', 'point data.path at')
  assert not workdir.exists(), line

  monkeypatch.chdir(tmp_path)  # the default workdir would be runs/tiny here
  rc = train_cmd.main(['--config', os.path.join(REPO, 'configs', 'tiny.py'),
                       '--workdir', str(workdir), '--config.train.stepz=3'])
  assert rc == 2 and not workdir.exists() and not (tmp_path / 'runs').exists()


def test_a_lock_held_by_an_orphan_says_so_and_frees_when_it_goes(tmp_path):
  """A trainer that exited while a process it forked lives on: the refusal says so; once
  that process is gone, the same workdir locks at once."""
  lock = tmp_path / resilience.LOCK_FILE
  script = (
      'import fcntl, json, os, socket, sys, time\n'
      'fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n'
      'fcntl.flock(fd, fcntl.LOCK_EX)\n'
      'os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), '
      '"since": "then"}).encode())\n'
      'if os.fork():\n'
      '  os._exit(0)\n'
      'print(os.getpid(), flush=True)\n'
      'time.sleep(120)\n')
  proc = subprocess.Popen([sys.executable, '-c', script, str(lock)], stdout=subprocess.PIPE,
                          text=True)
  child = int(proc.stdout.readline())
  proc.wait()
  proc.stdout.close()
  try:
    with pytest.raises(resilience.WorkdirError, match='which has exited; a process it started'):
      resilience.WorkdirLock(str(tmp_path)).acquire()
  finally:
    os.kill(child, 9)
  deadline = time.time() + 30
  while True:
    try:
      resilience.WorkdirLock(str(tmp_path)).acquire().release()
      break
    except resilience.WorkdirError:
      assert time.time() < deadline
      time.sleep(0.05)


# ---------------------------------------------------------------------------------- readers

def test_a_step_removed_while_it_is_read_gives_way_to_a_newer_one(tmp_path):
  """newest_first against the trainer's max_to_keep: step 2 loses its files (its
  directory last) while read; the reader waits it out and takes step 4. A step that
  stays on disk and fails otherwise is broken at once, and named."""
  for step in (2, 4):
    (tmp_path / str(step)).mkdir()
  reader = ckpt_lib.CheckpointReader(str(tmp_path), notify=lambda text: None)

  removal = threading.Timer(0.2, shutil.rmtree, [tmp_path / '2'])

  def action(step):
    if step == 2:
      if not removal.is_alive() and (tmp_path / '2').exists():
        removal.start()
      raise FileNotFoundError(f'{tmp_path}/2/meta/metadata')
    return 'read'

  assert reader.newest_first(action, newest=2)[:2] == (4, 'read')
  removal.join()
  (tmp_path / '2').mkdir()  # asked for by number: one line naming it, even mid-removal

  def missing(step):
    raise FileNotFoundError(f'{tmp_path}/{step}/meta/metadata')

  with pytest.raises(ckpt_lib.CheckpointError, match='checkpoint 2 in .* was removed while'):
    reader.newest_first(missing, step=2)

  def broken(step):
    raise ValueError(f'step {step}: restored arrays differ from the saved ones')

  t0 = time.time()
  with pytest.raises(ckpt_lib.CheckpointError, match='step 4: ValueError: step 4: restored'):
    reader.newest_first(broken)
  assert time.time() - t0 < 0.5
  with pytest.raises(ckpt_lib.CheckpointError, match='checkpoint 4 in .* is broken'):
    reader.newest_first(broken, step=4)


def _export_main():
  """The export command's main(argv), wherever it lives."""
  path = os.path.join(REPO, 'scripts', 'export.py')
  spec = importlib.util.spec_from_file_location('export_script', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main


def test_exports_in_a_loop_beside_a_live_trainer(tmp_path, capfd):
  """A trainer checkpointing every 2 steps and keeping 2; exports of the newest checkpoint
  run while it removes old ones: every export and the trainer succeed."""
  docs = write_jsonl(tmp_path / 'docs.jsonl', lines=60)
  workdir = tmp_path / 'run'
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu')
  trainer = subprocess.Popen(
      [sys.executable, os.path.join(REPO, 'scripts', 'train.py'),
       '--config', os.path.join(REPO, 'configs', 'tiny.py'), '--workdir', str(workdir),
       '--cpu_devices=1', '--config.data.source=jsonl', f'--config.data.path={docs}',
       '--config.data.seq_len=32', '--config.data.validation_percent=20',
       '--config.train.steps=400', '--config.train.checkpoint_every=2',
       '--config.train.max_to_keep=2', '--config.train.eval_every=0',
       '--config.train.log_every=50', '--config.train.progress=False'],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
  export = _export_main()
  results, live = [], 0
  try:
    deadline = time.time() + 300
    while not os.path.isdir(workdir / 'checkpoints') or not [
        n for n in os.listdir(workdir / 'checkpoints') if n.isdigit()]:
      assert trainer.poll() is None, trainer.communicate()[1][-2000:]
      assert time.time() < deadline
      time.sleep(0.2)
    while trainer.poll() is None and len(results) < 8:
      out = tmp_path / f'export_{len(results)}'
      results.append(export(['--workdir', str(workdir), '--out', str(out), '--layout', 'mimo',
                             '--json']))

      live += trainer.poll() is None
  finally:
    if trainer.poll() is None and len(results) >= 8:
      trainer.terminate()  # enough exports: SIGTERM saves and exits 0
    _, trainer_err = trainer.communicate(timeout=300)
  err = capfd.readouterr().err
  assert results == [0] * len(results) and len(results) >= 2, err[-2000:]
  assert 'Traceback' not in err, err[-3000:]  # a read abandoned under a trainer stays quiet
  assert live >= 2, 'the trainer finished before the exports could race it'
  assert trainer.returncode == 0, trainer_err[-2000:]


# ---------------------------------------------------------------------------------- console

def test_each_command_the_final_block_suggests_is_installed(tmp_path):
  """After `pip install -e '.[tensorboard]'` (the README's install) each `next:` command
  exists beside this interpreter and answers --help: the project's console scripts, and
  tensorboard from the `tensorboard` extra."""
  import tomllib
  project = tomllib.loads(pathlib.Path(REPO, 'pyproject.toml').read_text())['project']
  assert any(r.startswith('tensorboard>') for r in project['optional-dependencies']['tensorboard'])
  block = metrics_lib.final_block(str(tmp_path), 1, 1, 'def ').splitlines()
  commands = [line.split()[0] for line in block[block.index('next:') + 1:]]
  assert commands == ['mtp-decode', 'mtp-eval', 'tensorboard']
  bindir = os.path.dirname(sys.executable)
  for name in commands:
    assert name in project['scripts'] or name == 'tensorboard', name
    path = shutil.which(name, path=bindir)
    assert path, f'{name} is not installed in {bindir}'
    proc = subprocess.run([path, '--help'], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (name, proc.stderr[-500:])
    assert ('--logdir' if name == 'tensorboard' else '--workdir') in proc.stdout, name


def test_console_lines_name_their_units_and_the_final_block_what_to_run_next(tmp_path):
  line = metrics_lib.eval_line(40, {'eval/loss_main': 3.2, 'eval/loss_mtp_1': 3.9,
                                    'eval/bpb_main': 1.5, 'eval/acc_main': 0.4,
                                    'eval/decode_tau': 2.25})
  assert line == ('eval @ 40: loss main 3.2000 mtp_1 3.9000 nats/token | bpb main 1.5000 '
                  'bits per byte | tau 2.250 tokens per verify step')
  rows = [{'step': 10, 'train/loss': 5.0, 'perf/tokens_per_sec': 900.0, 'perf/mfu': 0.4},
          {'step': 10, 'eval/bpb_main': 2.0, 'eval/loss_main': 1.4},
          {'step': 20, 'train/loss': 4.0, 'perf/tokens_per_sec': 1000.0, 'perf/mfu': 0.5},
          {'step': 20, 'eval/bpb_main': 2.5, 'eval/loss_main': 1.7}]
  workdir = tmp_path / 'my run'
  workdir.mkdir()
  (workdir / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  block = metrics_lib.final_block(str(workdir), 20, 20, "# It's a").splitlines()
  assert block[0] == f'done: step 20 in {workdir} (checkpoint 20)'
  assert 'last train loss 4.0000 nats/token (step 20), 1000 tokens/s, MFU 0.50' in block[1]
  assert 'bits per byte, main model: last 2.5000 (step 20), best 2.0000 (step 10)' in block[2]
  quoted = f"'{workdir}'"
  assert (f'  mtp-decode --workdir {quoted} --mode compare --prompt '
          + "'# It'\"'\"'s a'") in block  # the run's own text, quoted for the shell
  assert f'  mtp-eval --workdir {quoted}' in block
  assert f"  tensorboard --logdir '{workdir}/tensorboard'" in block
  assert any('--prompts_file' in line for line in metrics_lib.final_block(str(workdir), 20, 20)
             .splitlines())  # no text from the run: a prompts file, not a made-up prompt
  config = jsonl_config('docs.jsonl')
  assert metrics_lib.data_line(config) == ('data: jsonl docs.jsonl, byte tokenizer, batches of '
                                           '8 x 32 tokens')
