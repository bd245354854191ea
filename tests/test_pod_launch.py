"""scripts/launch_tpu_pod.sh against a fake `gcloud` (tests/fake_gcloud.py) whose workers are
directories on this machine and whose trainer is a small script: the watch sees a trainer
that died on a live VM, restarts it once and gives up at its cap; --stop reaches every slice
it can; a FAILED queued resource ends the wait; flags with quotes arrive intact; a worker
that cannot use the bucket stops the launch before anything starts."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO

SCRIPT = os.path.join(REPO, 'scripts', 'launch_tpu_pod.sh')

# Stands in for scripts/train.py on a worker: records its flags, runs until ~/finish exists
# (then prints the final block's first line), exits 0 on SIGTERM as the trainer does after
# saving, exits 2 at once where the home holds bad_input. --check_storage fails on a worker
# whose home holds no_bucket.
FAKE_TRAINER = '''
import json, os, signal, sys, time
home = os.path.expanduser('~')
if '--check_storage' in sys.argv:
  if os.path.exists(os.path.join(home, 'no_bucket')):
    print('error: train.checkpoint_dir cannot be written and read back on ' + home,
          file=sys.stderr)
    sys.exit(2)
  print('storage ok on ' + home)
  sys.exit(0)
with open(os.path.join(home, 'argv.jsonl'), 'a') as f:
  f.write(json.dumps(sys.argv[1:]) + '\\n')
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
if os.path.exists(os.path.join(home, 'bad_input')):
  print('error: data.path does not exist', file=sys.stderr)
  sys.exit(2)
print('training', flush=True)
while not os.path.exists(os.path.join(home, 'finish')):
  time.sleep(0.05)
print('done: step 4 in runs/x', flush=True)
'''

FLAGS = ['--config', 'configs/tiny.py', "--config.train.note=it's a \"test\" $HOME"]


@pytest.fixture
def pod(tmp_path):
  """(env, root): a fake gcloud and python3 on PATH, state under root."""
  root = tmp_path / 'gcloud'
  (root / 'slices').mkdir(parents=True)
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  trainer = tmp_path / 'fake' / 'scripts' / 'train.py'  # the name the launcher checks for
  trainer.parent.mkdir(parents=True)
  trainer.write_text(FAKE_TRAINER)
  gcloud = bin_dir / 'gcloud'
  gcloud.write_text(f'#!/bin/bash\nexec {sys.executable} '
                    f'{os.path.join(REPO, "tests", "fake_gcloud.py")} "$@"\n')
  # python3 on a worker: pip installs are recorded, scripts/train.py is the fake trainer.
  python3 = bin_dir / 'python3'
  python3.write_text(
      '#!/bin/bash\n'
      'if [ "$1" = -m ] && [ "$2" = pip ]; then echo "$*" >> ~/pip.log; exit 0; fi\n'
      f'if [ "$1" = scripts/train.py ]; then shift; exec {sys.executable} {trainer} "$@"; fi\n'
      f'exec {sys.executable} "$@"\n')
  for f in (gcloud, python3):
    f.chmod(0o755)
  env = dict(os.environ, PATH=f'{bin_dir}:{os.environ["PATH"]}', FAKE_GCLOUD_ROOT=str(root),
             MTP_QUEUED_POLL_SECONDS='0.05')
  yield env, root
  for pid_file in root.glob('slices/*/w*/mtp_jax_train.pid'):  # nothing outlives the test
    pid = int(pid_file.read_text().split()[0])
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def _slice(root, name, workers=2):
  (root / 'slices' / name).mkdir()
  (root / 'slices' / name / 'workers').write_text(str(workers))
  for w in range(workers):
    (root / 'slices' / name / f'w{w}' / 'mtp_jax').mkdir(parents=True)


def _launch(env, *args, wait=True):
  cmd = ['bash', SCRIPT, 'pod', 'zone-a', *args]
  if not wait:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
  return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=REPO)


def _until(condition, what, timeout=120):
  end = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < end, f'timed out waiting for {what}'
    time.sleep(0.05)


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:  # a zombie (exited, not yet reaped) is not alive
    with open(f'/proc/{pid}/stat') as f:
      return f.read().split(') ')[-1][0] != 'Z'
  except FileNotFoundError:
    return False


def _trainer_pid(home):
  """The worker's running trainer, or None."""
  try:
    pid = int((home / 'mtp_jax_train.pid').read_text().split()[0])
  except (FileNotFoundError, ValueError, IndexError):
    return None
  return pid if _alive(pid) and not (home / 'mtp_jax_train.exit').exists() else None


def _starts(home):
  path = home / 'argv.jsonl'
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_watch_restarts_a_killed_trainer_once_then_gives_up_at_its_cap(pod):
  env, root = pod
  _slice(root, 'pod')
  homes = [root / 'slices' / 'pod' / f'w{w}' for w in range(2)]
  proc = _launch(env, '--watch', '1', '--max_restarts', '1', '--backoff', '0', '--', *FLAGS,
                 wait=False)
  try:
    _until(lambda: all(_trainer_pid(h) and _starts(h) for h in homes), 'the first start')
    first = [_trainer_pid(h) for h in homes]
    for h in homes:  # the quoted flag reached the trainer as it was given
      assert _starts(h) == [['--distributed=on', *FLAGS]]
    os.kill(first[0], signal.SIGKILL)  # worker 0's trainer dies; its VM lives on
    _until(lambda: all(len(_starts(h)) == 2 and _trainer_pid(h) for h in homes),
           'the restart on both workers')
    second = [_trainer_pid(h) for h in homes]
    assert not set(second) & set(first) and not _alive(first[1])  # one trainer per worker
    assert (homes[0] / 'mtp_jax_train.pid').read_text().split()[0] == str(second[0])
    os.kill(second[1], signal.SIGKILL)  # dies again: the cap (1 restart) is reached
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 1, (out, err)
  assert out.count('the job stopped before its last step') == 1, out
  assert 'restart 1 of 1' in out
  gave_up = [line for line in err.splitlines() if line.startswith('error:')]
  assert len(gave_up) == 1 and 'after 1 restarts (--max_restarts 1): giving up' in gave_up[0]
  assert all(len(_starts(h)) == 2 for h in homes)  # no third start
  _until(lambda: not any(_alive(p) for p in second), 'the last trainer to be stopped')


def test_watch_ends_when_the_run_finishes(pod):
  env, root = pod
  _slice(root, 'pod', workers=1)
  home = root / 'slices' / 'pod' / 'w0'
  proc = _launch(env, '--watch', '1', '--backoff', '0', '--', *FLAGS, wait=False)
  try:
    _until(lambda: _trainer_pid(home) and _starts(home), 'the start')
    (home / 'finish').touch()
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 0, (out, err)
  assert 'the run finished' in out and len(_starts(home)) == 1


def test_watch_does_not_restart_a_trainer_that_refused_its_input(pod):
  env, root = pod
  _slice(root, 'pod', workers=1)
  home = root / 'slices' / 'pod' / 'w0'
  (home / 'bad_input').touch()
  proc = _launch(env, '--watch', '1', '--backoff', '0', '--', *FLAGS)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1].startswith(
      'error: the trainer refused its input or its checkpoints (exit 2): not restarting')
  assert len(_starts(home)) == 1


def test_stop_reaches_every_slice_it_can_and_names_the_one_it_cannot(pod):
  env, root = pod
  for i in range(2):
    _slice(root, f'pod-{i}')
  homes = {i: [root / 'slices' / f'pod-{i}' / f'w{w}' for w in range(2)] for i in range(2)}
  started = _launch(env, '--num_slices', '2', '--', *FLAGS)
  assert started.returncode == 0, started.stderr
  _until(lambda: all(_trainer_pid(h) and _starts(h) for hs in homes.values() for h in hs),
         'the starts')
  (root / 'slices' / 'pod-0' / 'unreachable').touch()
  stop = _launch(env, '--num_slices', '2', '--stop')
  assert stop.returncode == 1
  assert stop.stderr.strip().splitlines()[-1] == (
      'error: could not reach pod-0 to stop it (the other slices were stopped)')
  # stopped: the worker's wrapper writes the exit status just after its trainer ends
  _until(lambda: all((h / 'mtp_jax_train.exit').exists() for h in homes[1]), 'slice 1 to stop')
  assert all((h / 'mtp_jax_train.exit').read_text().strip() == '0' for h in homes[1])
  assert all(_trainer_pid(h) for h in homes[0])
  (root / 'slices' / 'pod-0' / 'unreachable').unlink()
  stop = _launch(env, '--num_slices', '2', '--slice', '0', '--stop')
  assert stop.returncode == 0, stop.stderr
  _until(lambda: not any(_trainer_pid(h) for h in homes[0]), 'slice 0 to stop')


def test_a_failed_queued_resource_ends_the_wait_in_one_line(pod):
  env, root = pod
  (root / 'queued' / 'pod').mkdir(parents=True)
  (root / 'queued' / 'pod' / 'states').write_text('ACCEPTED\nPROVISIONING\nFAILED\n')
  proc = _launch(env, '--queued', 'v5p-8', '--', *FLAGS)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      'error: queued resource pod is FAILED (gcloud compute tpus queued-resources describe '
      'pod --zone zone-a tells why)']
  assert 'tpu-vm ssh' not in (root / 'calls.log').read_text()  # nothing started


def test_a_worker_that_cannot_use_the_bucket_stops_the_launch(pod):
  env, root = pod
  _slice(root, 'pod')
  (root / 'slices' / 'pod' / 'w1' / 'no_bucket').touch()
  proc = _launch(env, '--', *FLAGS)
  assert proc.returncode == 2
  assert 'cannot be written and read back' in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(
      'error: a worker of pod cannot use the checkpoint location')
  assert not any(_starts(root / 'slices' / 'pod' / f'w{w}') for w in range(2))


def test_watch_recreates_a_lost_queued_slice_and_sets_it_up(pod):
  env, root = pod
  proc = _launch(env, '--queued', 'v5p-8', '--setup', '--watch', '1', '--backoff', '0', '--',
                 *FLAGS, wait=False)
  homes = [root / 'slices' / 'pod' / f'w{w}' for w in range(2)]
  try:
    _until(lambda: all(_trainer_pid(h) and _starts(h) for h in homes), 'the first start')
    first = _trainer_pid(homes[0])
    # A spot preemption: the resource is suspended and the VMs go with their processes.
    (root / 'queued' / 'pod' / 'states').write_text('SUSPENDED\n')
    for h in homes:
      os.kill(_trainer_pid(h), signal.SIGKILL)
    _until(lambda: all(len(_starts(h)) == 2 and _trainer_pid(h) for h in homes),
           'the restart on the recreated slice')
    assert _trainer_pid(homes[0]) != first
  finally:
    proc.kill()
    proc.communicate()
  calls = (root / 'calls.log').read_text()
  assert calls.count('queued-resources create pod') == 2
  assert 'queued-resources delete pod' in calls
  installs = (homes[0] / 'pip.log').read_text().splitlines()
  assert len(installs) == 2 and all("'.[gcs]'" in i or '.[gcs]' in i for i in installs)
