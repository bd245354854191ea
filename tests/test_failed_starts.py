"""A run that fails to start, or fails before its first checkpoint, leaves nothing behind: no
new workdir, an existing one as it was; a lock left by a process that has exited says so.

Trainer runs use tiny.py on a small jsonl corpus (helpers.write_jsonl), on one device.
"""
import os
import subprocess
import sys
import time

import pytest

from helpers import REPO, jsonl_config, write_jsonl
from mtp_jax import cli
from mtp_jax.commands import train as train_cmd
from mtp_jax.errors import ConfigError
from mtp_jax.train import resilience, train_and_evaluate


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
