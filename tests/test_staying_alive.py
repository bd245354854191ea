"""A run that says why it stopped: start-up signals, the step watchdog and SIGUSR1 dump, the
local checkpoint tier, goodput."""
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import jax
import numpy as np
import pytest

from helpers import REPO, quiet_tiny
from mtp_jax.runtime import signals
from mtp_jax.train import goodput, train_and_evaluate, watchdog

FIELDS = dict(steps=6, log_every=1, eval_every=0, checkpoint_every=4, eval_batches=1,
              async_checkpoint=False)


def tiny(data_dir, **train_fields):
  return quiet_tiny(data_dir, FIELDS, **train_fields)


def log_rows(workdir) -> list:
  rows = []
  for line in pathlib.Path(workdir, 'metrics.jsonl').read_text().splitlines():
    rows.append({k: v for k, v in json.loads(line).items() if not k.startswith('perf/')})
  return rows


def final_params(directory) -> list:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  step = max(int(n) for n in os.listdir(directory) if n.isdigit())
  with warnings.catch_warnings(), ocp.PyTreeCheckpointer() as c:
    warnings.simplefilter('ignore')
    tree = c.restore(os.path.join(directory, str(step), 'state'))
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ----------------------------------------------------------------------------- start-up signals

def _handler_installed(pid: int, sig: int) -> bool:
  """The process catches `sig` (its SigCgt mask in /proc): our recorder is in place."""
  try:
    for line in pathlib.Path(f'/proc/{pid}/status').read_text().splitlines():
      if line.startswith('SigCgt:'):
        return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
  except OSError:
    pass
  return False


def _start_and_signal(data_dir, workdir, sig, delay: float,
                      after_line: str | None = None) -> tuple[int, str]:
  """scripts/train.py on tiny.py, `sig` `delay` s after its recorder is installed, or, with
  `after_line`, as soon as it prints a line starting so (a moment of set-up on any host)."""
  cmd = [sys.executable, os.path.join(REPO, 'scripts', 'train.py'), '--config',
         os.path.join(REPO, 'configs', 'tiny.py'), f'--workdir={workdir}',
         f'--config.data.data_dir={data_dir}', '--config.train.steps=3',
         '--config.train.checkpoint_every=1', '--config.train.log_every=1',
         '--config.train.eval_batches=1', '--config.train.progress=True']
  proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                          env=dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu'), cwd=REPO)
  deadline = time.time() + 120
  while not _handler_installed(proc.pid, signal.SIGTERM):
    assert proc.poll() is None and time.time() < deadline, 'no handler installed'
    time.sleep(0.005)
  time.sleep(delay)
  seen = []
  if after_line:
    for line in proc.stderr:
      seen.append(line)
      if line.startswith(after_line):
        break
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=600)
  return proc.returncode, ''.join(seen) + err


def _assert_start_ended(code, err, workdir, sig):
  lines = [line for line in err.splitlines() if line.strip()]
  name = signal.Signals(sig).name
  assert code == 128 + sig, err[-3000:]
  assert lines[-1].startswith(f'error: {name} received while the run was starting'), err[-3000:]
  assert 'Traceback' not in err and 'Preempted' not in err, err[-3000:]  # no step trained
  assert not os.path.exists(workdir), os.listdir(workdir)


@pytest.mark.parametrize('sig,delay,after_line', [(signal.SIGTERM, 0.0, None),
                                                  (signal.SIGINT, 2.0, None),
                                                  (signal.SIGTERM, 0.0, 'devices:')])
def test_a_signal_during_start_up_ends_it_with_one_line(stdlib_data_dir, tmp_path, sig, delay,
                                                        after_line):
  """At chosen moments of start-up (as the recorder is installed, during imports, during
  set-up as the device line prints): exit 143 / 130, one `error:` line, no step trained,
  no workdir left. (A fixed delay cannot name set-up: a fast host trains its first step
  within 6 s.)"""
  workdir = tmp_path / 'new' / 'run'
  code, err = _start_and_signal(stdlib_data_dir, workdir, sig, delay, after_line)
  _assert_start_ended(code, err, workdir, sig)
  assert not (tmp_path / 'new').exists()


@pytest.mark.slow
def test_thirty_start_up_signals(stdlib_data_dir, tmp_path):
  """30 SIGTERMs at random moments between the recorder's installation and the first step
  (whose moment a signal-free start measures): 30 x exit 143 with one line, nothing left."""
  cmd = [sys.executable, os.path.join(REPO, 'scripts', 'train.py'), '--config',
         os.path.join(REPO, 'configs', 'tiny.py'), f'--workdir={tmp_path / "reference"}',
         f'--config.data.data_dir={stdlib_data_dir}', '--config.train.steps=3',
         '--config.train.eval_batches=1', '--config.train.progress=True']
  t0 = time.time()
  proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO,
                          env=dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu'))
  to_step = None
  for line in proc.stderr:
    if to_step is None and 'Compiled the train step' in line:
      to_step = time.time() - t0
  assert proc.wait() == 0 and to_step
  rng = random.Random(0)
  for i in range(30):
    workdir = tmp_path / f'run{i}'
    code, err = _start_and_signal(stdlib_data_dir, workdir, signal.SIGTERM,
                                  rng.uniform(0, 0.8 * to_step))
    _assert_start_ended(code, err, workdir, signal.SIGTERM)


def test_startup_recorder_acts_only_at_check():
  before = signal.getsignal(signal.SIGINT)
  s = signals.StartupSignals().install()
  try:
    os.kill(os.getpid(), signal.SIGINT)  # recorded, not raised here
    time.sleep(0.01)
    with pytest.raises(signals.StartupInterrupted) as e:
      s.check()
    assert e.value.exit_code == 130
  finally:
    s.uninstall()
  assert signal.getsignal(signal.SIGINT) is before


# ----------------------------------------------------------------------------- hangs

def test_hang_limit_rules():
  assert watchdog.hang_limit([1.0, 2.0], 10, 0) is None  # too few steps for a median
  assert watchdog.hang_limit([1.0, 2.0, 3.0], 10, 0) == 20.0
  assert watchdog.hang_limit([1.0, 2.0, 3.0], 10, 5) == 5.0
  assert watchdog.hang_limit([1.0, 2.0, 3.0], 10, 0, stepping=False) is None  # an eval
  assert watchdog.hang_limit([], 0, 0) is None


def test_watchdog_dumps_and_exits_after_the_median_rule(tmp_path):
  exits = []
  with open(tmp_path / 'log', 'w+') as log:
    dog = watchdog.StepWatchdog(5, 0, exit_on_hang=True, stream=log, exit_fn=exits.append,
                                poll=0.01).start()
    for step in range(1, 6):
      dog.beat(step)
      time.sleep(0.02)
    deadline = time.time() + 30
    while not exits and time.time() < deadline:  # no beat: a stall
      time.sleep(0.01)
    dog.stop()
    text = pathlib.Path(tmp_path / 'log').read_text()
  assert exits == [watchdog.HANG_EXIT_CODE]
  assert 'WATCHDOG: no training step for' in text and 'after step 5' in text
  assert 'test_watchdog_dumps_and_exits_after_the_median_rule' in text  # this thread's stack


def test_an_injected_stall_dumps_every_stack(stdlib_data_dir, tmp_path, devices, capfd):
  """A data source that sleeps 8 s at step 3 with train.hang_seconds=2: the log gets the
  watchdog's line and the stalled frame, and the run still finishes."""
  def stalling_source(step, batch):
    if step == 3:
      time.sleep(8)
    return batch

  config = tiny(stdlib_data_dir, steps=4, hang_seconds=2.0)
  train_and_evaluate(config, str(tmp_path), devices=devices[:1], batch_hook=stalling_source)
  err = capfd.readouterr().err
  assert 'WATCHDOG: no training step for' in err and 'after step 2' in err, err[-3000:]
  assert 'stalling_source' in err  # the main thread's stack, caught in the sleep


def test_sigusr1_dumps_every_stack(tmp_path):
  import faulthandler  # pylint: disable=g-import-not-at-top
  with open(tmp_path / 'log', 'w+') as f:
    assert signals.install_stack_dump(f)
    try:
      os.kill(os.getpid(), signal.SIGUSR1)
      time.sleep(0.1)
    finally:
      faulthandler.unregister(signal.SIGUSR1)
  assert 'test_sigusr1_dumps_every_stack' in (tmp_path / 'log').read_text()


# ----------------------------------------------------------------------------- checkpoint tiers

_KILLED_RUN = """
import os, signal, sys
import jax
from helpers import load_config
from mtp_jax.train import train_and_evaluate
c = load_config('tiny')
c.data.data_dir = {data!r}
c.train.progress = False
for k, v in {fields!r}.items():
  c.train[k] = v
def kill(step, batch):
  if step == 4:  # local step 3 is on disk (saves are synchronous), persistent step 4 is not
    os.kill(os.getpid(), signal.SIGKILL)
  return batch
train_and_evaluate(c, {workdir!r}, devices=jax.devices()[:1], batch_hook=kill)
"""


def test_a_kill_between_tiers_resumes_from_the_local_one(stdlib_data_dir, tmp_path, devices,
                                                         capfd):
  """local_checkpoint_every=1, checkpoint_every=4: SIGKILL before step 4, with only the
  local tier holding steps; the rerun resumes from local step 3 and ends bit-identical to an
  uninterrupted run (params and every logged row), its goodput counted over both attempts.
  A third start finds nothing to do and writes no TensorBoard event file."""
  fields = {**FIELDS, 'local_checkpoint_every': 1}
  reference = tmp_path / 'reference'
  train_and_evaluate(tiny(stdlib_data_dir, **fields), str(reference), devices=devices[:1])
  workdir = tmp_path / 'killed'
  script = _KILLED_RUN.format(repo=REPO, data=stdlib_data_dir, fields=fields,
                              workdir=str(workdir))
  # The same CPU client as this process's (8 devices, one used): XLA:CPU's thread split, and
  # with it the last bits of a reduction, follows the client's device count.
  proc = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                        cwd=REPO, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS='cpu',
                                 PYTHONPATH=os.pathsep.join([os.path.join(REPO, 'tests'), REPO])))
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  assert not [n for n in os.listdir(workdir / 'checkpoints') if n.isdigit()]
  assert '3' in os.listdir(workdir / 'local_checkpoints')
  capfd.readouterr()
  train_and_evaluate(tiny(stdlib_data_dir, **fields), str(workdir), devices=devices[:1])
  err = capfd.readouterr().err
  assert f'Resumed from {workdir / "local_checkpoints"} at step 3.' in err, err[-2000:]
  assert 'time over' in err  # the goodput summary before the final block
  rows, ref_rows = log_rows(workdir), log_rows(reference)  # rows 1-3 before the kill, 4-6 after
  diffs = [(r['step'], k, r.get(k), q.get(k)) for r, q in zip(rows, ref_rows)
           for k in sorted(set(r) | set(q)) if r.get(k) != q.get(k)]
  assert len(rows) == len(ref_rows) and not diffs, diffs[:8]
  for a, b in zip(final_params(workdir / 'checkpoints'), final_params(reference / 'checkpoints'),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  events = sorted(os.listdir(workdir / 'tensorboard'))  # a finished workdir: nothing to do
  train_and_evaluate(tiny(stdlib_data_dir, **fields), str(workdir), devices=devices[:1])
  assert 'Nothing to do' in capfd.readouterr().err
  assert sorted(os.listdir(workdir / 'tensorboard')) == events  # no new event file
  last = [json.loads(line) for line in pathlib.Path(workdir, 'metrics.jsonl').read_text()
          .splitlines() if 'perf/goodput' in line][-1]
  assert last['perf/job_time/train'] > 0 and 0 < last['perf/goodput'] < 1
  assert last['perf/job_time/restore'] >= last['perf/time/restore'] > 0


# ----------------------------------------------------------------------------- goodput

def test_ledger_counts_redone_work_as_lost():
  now = [0.0]
  ledger = goodput.Ledger(clock=lambda: now[0])
  now[0] = 2.0
  ledger.lap('compile')
  now[0] = 5.0
  ledger.lap('train')
  saved = {'compile': 10.0, 'train': 30.0}  # the checkpoint's totals
  newest = {'compile': 10.0, 'train': 42.0, 'save': 1.0}  # the side file, written later
  assert ledger.resume(saved, newest) == pytest.approx(13.0)
  job = ledger.job()
  assert job['compile'] == 12.0 and job['train'] == 33.0 and job['lost'] == 13.0
  m = ledger.metrics()
  assert m['perf/time/train'] == 3.0 and m['perf/job_time/lost'] == 13.0
  assert m['perf/goodput'] == pytest.approx(33.0 / 58.0)
  assert ledger.summary().startswith('time over 58.0 s: compile 12.0 s')


def test_side_file_round_trip():
  with tempfile.TemporaryDirectory() as d:
    assert goodput.read_side_file(d) is None
    goodput.write_side_file(d, {'train': 1.5})
    assert goodput.read_side_file(d) == {'train': 1.5}


def test_host_spread_names_the_straggler():
  times = [0.10, 0.11, 0.30, 0.10]
  out = goodput.spread(times)
  assert out['perf/slowest_host'] == 2.0 and out['perf/step_time_host_max'] == 0.30
  assert out['perf/step_time_host_median'] == pytest.approx(0.105)
  line = goodput.straggler_line(7, times)
  assert line.startswith('step 7: host 2 is a straggler: 0.3 s a step')
  assert goodput.straggler_line(7, [0.10, 0.11, 0.12]) is None
  assert goodput.straggler_line(7, [0.10]) is None
  assert goodput.host_step_times(0.5) == [0.5]  # one process: no collective
  # Hosts in lockstep: alike step times, and host 1's input wait names it.
  steps, inputs = [0.8, 0.81, 0.8], [0.01, 0.5, 0.02]
  assert goodput.straggler_line(9, steps, inputs).startswith(
      'step 9: host 1 is a straggler: 0.5 s a step drawing its input')
  assert goodput.spread(steps, inputs)['perf/slowest_input_host'] == 1.0
  assert goodput.straggler_line(9, steps, [0.001, 0.003, 0.001]) is None  # under a tenth
  assert goodput.host_step_times(0.5, 0.1) == ([0.5], [0.1])
  lines = goodput.host_lines(goodput.host_totals({'train': 2.0}) * 2)
  assert lines == ['host 0: train 2.0 s', 'host 1: train 2.0 s']


def test_one_process_agrees_with_itself():
  from mtp_jax.checkpoint import store  # pylint: disable=g-import-not-at-top
  assert store.common_steps([5, 3]) == [3, 5] and store.common_steps([]) == []
  assert store.agreed(True) and not store.agreed(False)
