"""Reading a run never harms it: decode, eval and --init_from read checkpoints
read-only and verified, fall back past a broken newest step, and one trainer owns a workdir;
exports of a live trainer's newest checkpoint succeed while it removes old ones.

The corruption tests copy the test run's trained tiny workdir (conftest.tiny_run: steps 20
and 40) and run scripts/decode.py and scripts/eval.py in-process, as test_eval.py does.
"""
import asyncio
import glob
import hashlib
import importlib
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import REPO, load_config, write_jsonl
from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import cli, train_state
from mtp_jax.checkpoint import reader as checkpoint_reader
from mtp_jax.checkpoint import store as checkpoint_store
from mtp_jax.model.mtp import shift_left
from mtp_jax.train import resilience, train_and_evaluate


def _script(name):
  """The command module of scripts/<name>.py."""
  return importlib.import_module(f'mtp_jax.commands.{COMMANDS.get(name, name)}')


COMMANDS = {'eval': 'evaluate'}  # script name -> module of mtp_jax.commands


def _main(name, argv, capsys):
  """(exit code, stdout, stderr lines) of scripts/<name>.py run in-process."""
  try:
    code = _script(name).main(argv)
  except SystemExit as e:
    code = e.code
  out = capsys.readouterr()
  return code, out.out, out.err.strip().splitlines()


DECODE = ['--mode', 'ar', '--prompt', 'def main(', '--max_new_tokens', '4', '--json']
EVAL = ['--num_prompts', '0', '--eval_batches', '1', '--json']


def _hashes(root) -> dict:
  """{relative path: sha256} of every file under root, and the directories (as None)."""
  out = {}
  for d, dirs, files in os.walk(root):
    for n in dirs:
      out[os.path.relpath(os.path.join(d, n), root)] = None
    for n in files:
      path = os.path.join(d, n)
      out[os.path.relpath(path, root)] = hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
  return out


def _largest_array_file(step_dir):
  files = glob.glob(os.path.join(step_dir, 'state', '**', 'd', '*'), recursive=True)
  return max(files, key=os.path.getsize)


def _truncate(path):
  data = pathlib.Path(path).read_bytes()
  pathlib.Path(path).write_bytes(data[:len(data) // 2])


def _flip_a_byte(path):
  data = bytearray(pathlib.Path(path).read_bytes())
  data[len(data) // 2] ^= 0x40
  pathlib.Path(path).write_bytes(bytes(data))


@pytest.fixture
def run_copy(tiny_run, tmp_path):
  """A private copy of the trained tiny workdir (checkpoints 20 and 40)."""
  workdir = tmp_path / 'run'
  shutil.copytree(tiny_run[0], workdir)
  return workdir


def _meta_file(workdir, step):
  return os.path.join(workdir, 'checkpoints', str(step), 'meta', 'metadata')


# -- fallback past a broken newest step -------------------------------------------------------
@pytest.mark.parametrize('damage', ['truncated_array', 'corrupted_meta'])
def test_broken_latest_falls_back_with_one_warning(damage, run_copy, capsys):
  """decode and eval use step 20 instead of a broken 40, say so in one line, exit 0, and
  leave the workdir as it was (no quarantine: only the trainer moves files)."""
  if damage == 'truncated_array':
    _truncate(_largest_array_file(os.path.join(run_copy, 'checkpoints', '40')))
    why = 'checkpoint 40'
  else:
    with open(_meta_file(run_copy, 40), 'r+') as f:
      f.seek(10)
      f.write('}{not json')
    why = 'JSONDecodeError'
  before = _hashes(run_copy)
  for name, argv in [('decode', DECODE), ('eval', EVAL)]:
    code, out, err = _main(name, ['--workdir', str(run_copy)] + argv, capsys)
    assert code == 0, (name, err)
    warnings = [line for line in err if line.startswith('warning:')]
    assert len(warnings) == 1, (name, err)
    assert 'checkpoint 40' in warnings[0] and why in warnings[0], warnings
    assert 'using step 20 instead' in warnings[0], warnings
    assert json.loads(out)['step'] == 20
  assert _hashes(run_copy) == before


def test_every_step_broken_is_exit_2_and_changes_nothing(run_copy, capsys):
  """Arrays truncated in every step: decode exits 2 with one line naming each step; metas
  corrupted in every step: eval does, before compiling. No file changes."""
  for step in (20, 40):
    _truncate(_largest_array_file(os.path.join(run_copy, 'checkpoints', str(step))))
  before = _hashes(run_copy)
  code, out, err = _main('decode', ['--workdir', str(run_copy)] + DECODE, capsys)
  assert code == 2 and out == '' and len(err) == 1, err
  assert err[0].startswith('error: no checkpoint in'), err
  assert 'step 40:' in err[0] and 'step 20:' in err[0], err
  assert _hashes(run_copy) == before

  for step in (20, 40):
    _truncate(_meta_file(run_copy, step))
  before = _hashes(run_copy)
  code, out, err = _main('eval', ['--workdir', str(run_copy)] + EVAL, capsys)
  assert code == 2 and out == '' and len(err) == 1, err
  assert 'JSONDecodeError' in err[0] and 'Nothing was changed' in err[0]
  assert _hashes(run_copy) == before


def test_flipped_byte_is_caught_by_the_fingerprint(run_copy, capsys):
  """Orbax restores flipped bytes silently; the reader compares the recorded fingerprints:
  the raw read raises, the model restore falls back, and eval --step 40 is a one-line error."""
  _flip_a_byte(_largest_array_file(os.path.join(run_copy, 'checkpoints', '40')))
  directory = os.path.join(run_copy, 'checkpoints')
  with pytest.raises(ValueError, match='restored arrays differ'):
    ckpt_lib.read_state_arrays(directory, 40)
  assert len(ckpt_lib.read_state_arrays(directory, 20)) > 10  # the intact step verifies

  config, step = ckpt_lib.load_workdir(str(run_copy))
  assert step == 40  # its meta is fine: only the arrays tell
  seen = []
  _, restored = train_state.restore_model_at(config, str(run_copy), step, fallback=True,
                                           notify=seen.append)
  assert restored == 20 and len(seen) == 1 and 'restored arrays differ' in seen[0], seen
  with pytest.raises(ckpt_lib.CheckpointError, match='checkpoint 40 .* is broken'):
    train_state.restore_model(config, str(run_copy), 40)

  code, out, err = _main('eval', ['--workdir', str(run_copy), '--step', '40'] + EVAL, capsys)
  assert code == 2 and out == '' and len(err) == 1, err
  assert 'checkpoint 40' in err[0] and 'restored arrays differ' in err[0]


def test_arrays_read_in_a_process_with_other_devices(tiny_run):
  """read_state_arrays needs no template: a 1-device process reads the checkpoint of the
  trainer's --cpu_devices auto run (2 devices on a 2+ core host) and gets the arrays this
  8-device process gets, bit for bit (orbax alone would rebuild the saved shardings)."""
  directory = os.path.join(tiny_run[0], 'checkpoints')
  here = hashlib.sha256(b''.join(a.tobytes() for a in ckpt_lib.read_state_arrays(directory, 40)))
  code = ('import hashlib, sys; from mtp_jax import checkpoint as c; import jax; '
          'assert len(jax.devices()) == 1; print(hashlib.sha256(b"".join(a.tobytes() for a in '
          'c.read_state_arrays(sys.argv[1], 40))).hexdigest())')
  proc = subprocess.run([sys.executable, '-c', code, directory], capture_output=True, text=True,
                        env=dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu', PYTHONPATH=REPO),
                        timeout=300, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split()[-1] == here.hexdigest()


def test_init_from_reads_without_harm(run_copy, stdlib_data_dir, tmp_path, devices, capfd):
  """--init_from on a workdir whose newest meta is broken and which holds an incomplete
  save: it loads step 20's trunk (verified) with one warning, and changes nothing there."""
  with open(_meta_file(run_copy, 40), 'w') as f:
    f.write('{"step": 40, "config": ')
  os.makedirs(run_copy / 'checkpoints' / '41.orbax-checkpoint-tmp-123' / 'state')
  before = _hashes(run_copy)
  config = load_config('tiny')
  config.data.data_dir = stdlib_data_dir
  config.train.progress = False
  config.model.mtp.depth = 1
  workdir = tmp_path / 'fresh'
  train_and_evaluate(config, str(workdir), devices=devices[:1], stop_after=0,
                           init_from=str(run_copy))
  warnings = [l for l in capfd.readouterr().err.splitlines() if 'checkpoint 40' in l]
  assert len(warnings) == 1 and 'using step 20 instead' in warnings[0], warnings
  assert _hashes(run_copy) == before
  meta = ckpt_lib.CheckpointReader(str(workdir / 'checkpoints')).read_meta(0)
  assert 'Initialised from' in meta['init_from'] and '/20:' in meta['init_from']


# -- one writer per workdir ---------------------------------------------------------------------
def test_a_second_trainer_is_refused(stdlib_data_dir, tmp_path, devices):
  """While the lock is held the trainer stops (exit-2 error naming the holder) before
  writing anything; once the holder is gone, even by kill -9, the lock is free."""
  workdir = tmp_path / 'run'
  workdir.mkdir()
  config = load_config('tiny')
  config.data.data_dir = stdlib_data_dir
  holder = resilience.WorkdirLock(str(workdir)).acquire()
  try:
    with pytest.raises(resilience.WorkdirError) as e:
      train_and_evaluate(config, str(workdir), devices=devices[:1])
  finally:
    holder.release()
  line = cli.one_line(e.value)
  assert cli.exit_code_of(e.value) == 2 and f'pid {os.getpid()} on host' in line, line
  assert sorted(os.listdir(workdir)) == [resilience.LOCK_FILE]  # no checkpoints/, no log

  code = ('import sys, time; from mtp_jax.train import resilience; '
          'resilience.WorkdirLock(sys.argv[1]).acquire(); print("locked", flush=True); '
          'time.sleep(600)')
  proc = subprocess.Popen([sys.executable, '-c', code, str(workdir)],
                          stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'))
  try:
    assert proc.stdout.readline().strip() == 'locked'
    with pytest.raises(resilience.WorkdirError, match=f'pid {proc.pid} on host'):
      resilience.WorkdirLock(str(workdir)).acquire()
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
  resilience.WorkdirLock(str(workdir)).acquire().release()  # stale after kill -9


# -- the minor items ----------------------------------------------------------------------------
def test_a_file_as_workdir_is_not_a_directory(tmp_path, capsys):
  (tmp_path / 'a_file').write_text('x')
  for name, argv in [('decode', DECODE), ('eval', EVAL)]:
    code, _, err = _main(name, ['--workdir', str(tmp_path / 'a_file')] + argv, capsys)
    assert code == 2 and len(err) == 1 and 'is not a directory' in err[0], (name, err)


def test_eval_prompt_len_of_a_whole_sequence_fails_fast(tiny_run, capsys, monkeypatch):
  """--prompt_len 64 on seq_len 64 leaves no room: named at once, before anything compiles."""
  from mtp_jax.train import steps as steps_lib  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(steps_lib, 'setup', lambda *a, **k: pytest.fail('compiled first'))
  code, _, err = _main('eval', ['--workdir', str(tiny_run[0]), '--prompt_len', '64'], capsys)
  assert code == 2 and len(err) == 1 and '--prompt_len (64)' in err[0], err
  assert 'max_new_tokens' not in err[0]


def test_failed_validation_leaves_no_new_workdir(stdlib_data_dir, tmp_path, devices):
  """A start that fails its preflight after the workdir was made (here: a frozen trunk
  with nothing to load) removes the directories it created, and only those."""
  config = load_config('tiny')
  config.data.data_dir = stdlib_data_dir
  config.model.mtp.freeze_trunk = True
  workdir = tmp_path / 'runs' / 'new'
  with pytest.raises(Exception) as e:
    train_and_evaluate(config, str(workdir), devices=devices[:1])
  assert 'freeze_trunk' in str(e.value)
  assert os.listdir(tmp_path) == []  # neither runs/ nor runs/new/ (nor checkpoints/)
  existing = tmp_path / 'mine'
  existing.mkdir()
  with pytest.raises(Exception, match='freeze_trunk'):
    train_and_evaluate(config, str(existing), devices=devices[:1])
  assert existing.is_dir()  # a workdir that existed stays


def test_shift_left_keeps_the_length_when_k_exceeds_it():
  x = np.arange(6).reshape(2, 3)
  for k, want in [(1, [[1, 2, 0], [4, 5, 0]]), (3, [[0, 0, 0], [0, 0, 0]]),
                  (5, [[-1, -1, -1], [-1, -1, -1]])]:
    got = shift_left(jax.numpy.asarray(x), k, fill=0 if k < 5 else -1)
    assert got.shape == (2, 3) and np.asarray(got).tolist() == want, (k, got)


# -- reading while training ---------------------------------------------------------------------
@pytest.mark.slow
def test_reading_while_training_harms_nothing(stdlib_data_dir, tmp_path):
  """A trainer saving every step; meanwhile decode and eval read the workdir in a loop and
  a second trainer tries the same workdir. The trainer exits 0 with every checkpoint
  intact; each reader succeeds or prints one line; the second trainer exits 2."""
  workdir = tmp_path / 'run'
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu')
  train_cmd = [sys.executable, os.path.join(REPO, 'scripts', 'train.py'),
               '--config', os.path.join(REPO, 'configs', 'tiny.py'), f'--workdir={workdir}',
               f'--config.data.data_dir={stdlib_data_dir}', '--config.train.steps=120',
               '--config.train.checkpoint_every=1', '--config.train.eval_every=0',
               '--config.train.log_every=10', '--config.train.progress=False']
  trainer = subprocess.Popen(train_cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
  readers = []
  try:
    deadline = time.time() + 300
    while not glob.glob(str(workdir / 'checkpoints' / '[0-9]*')):
      assert trainer.poll() is None, trainer.stderr.read()[-3000:]
      assert time.time() < deadline, 'no checkpoint within 300 s'
      time.sleep(0.05)
    second = subprocess.run(train_cmd, capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=300)
    while trainer.poll() is None:
      for name, argv in [('decode', DECODE), ('eval', EVAL)]:
        if trainer.poll() is not None:
          break
        proc = subprocess.run([sys.executable, os.path.join(REPO, 'scripts', f'{name}.py'),
                               '--workdir', str(workdir)] + argv,
                              capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        readers.append((name, proc.returncode, proc.stderr.strip().splitlines()))
    _, err = trainer.communicate(timeout=300)
  finally:
    if trainer.poll() is None:
      trainer.kill()
      trainer.communicate()  # reaps it and closes its pipe
  assert trainer.returncode == 0, err[-3000:]
  assert second.returncode == 2, second.stderr[-3000:]
  lines = second.stderr.strip().splitlines()
  assert len(lines) == 1 and f'pid {trainer.pid} on host' in lines[0], lines
  assert {'decode', 'eval'} <= {name for name, _, _ in readers}, readers
  for name, code, err_lines in readers:
    assert code == 0 or (code == 2 and len(err_lines) == 1), (name, code, err_lines[-20:])
  assert sum(code == 0 for _, code, _ in readers) >= 1, readers
  reader = ckpt_lib.CheckpointReader(str(workdir / 'checkpoints'))
  assert reader.steps()[-1] == 120
  for step in reader.steps():
    reader.read_arrays(step)  # intact: every fingerprint matches
  assert not [n for n in os.listdir(workdir / 'checkpoints') if ckpt_lib.TMP_MARKER in n]
  assert not (workdir / ckpt_lib.QUARANTINE_DIR).exists()
  print(f'readers during training: {[(n, c) for n, c, _ in readers]}')


# ----------------------------------------------------------- readers beside a live trainer

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

  tried = []

  def broken(step):
    tried.append(step)
    raise ValueError(f'step {step}: restored arrays differ from the saved ones')

  with pytest.raises(ckpt_lib.CheckpointError, match='step 4: ValueError: step 4: restored'):
    reader.newest_first(broken)
  assert tried == [4, 2]  # one pass, newest first: nothing is being removed, so no wait
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


def test_a_read_finishing_after_its_loop_closed_is_dropped_quietly():
  """A TensorStore read that becomes ready as its loop closes delivers into a closed loop
  from a TensorStore thread; a checkpoint loop drops it instead of an "Exception ignored"."""
  with checkpoint_store.draining_loops():
    loop = asyncio.new_event_loop()
  loop.close()
  delivered = []
  late = threading.Thread(target=lambda: delivered.append(
      loop.call_soon_threadsafe(lambda: None)))
  late.start()
  late.join()
  assert delivered == [None]
  plain = asyncio.SelectorEventLoop()  # other loops still refuse, as asyncio does
  plain.close()
  with pytest.raises(RuntimeError, match='closed'):
    plain.call_soon_threadsafe(lambda: None)


def test_every_metadata_read_runs_on_a_checkpoint_loop(tiny_run, monkeypatch):
  """Metadata reads (array order, numpy restores) run on orbax loops as restores do; a
  plain loop abandoned mid-read is what reports a late delivery as "Exception ignored"."""
  seen = []
  metadata = ocp.PyTreeCheckpointHandler.metadata

  def recording(self, directory):
    seen.append(type(asyncio.get_event_loop_policy()).__name__)
    return metadata(self, directory)

  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, 'metadata', recording)
  reader = ckpt_lib.CheckpointReader(os.path.join(tiny_run[0], 'checkpoints'))
  step = reader.steps()[-1]
  assert reader.tree_order(step)
  checkpoint_reader._restore_as_numpy(reader._dir(step, 'state'))  # pylint: disable=protected-access
  assert seen == ['_DrainingPolicy'] * 2
