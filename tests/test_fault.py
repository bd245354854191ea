"""Fault tolerance: preemption, broken checkpoints, non-finite steps, init-from, kill -9 chaos.

Every run uses tiny.py with the same train fields as test_train.py's exact-resume test,
so the persistent compilation cache compiles the train step once for the whole test run.
"""
import errno
import glob
import json
import os
import pathlib
import pickle
import shutil
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import REPO, quiet_tiny
from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import cli
from mtp_jax.checkpoint import store as ckpt_store
from mtp_jax.config_lib import ConfigError
from mtp_jax.train import goodput as goodput_lib
from mtp_jax.train import metrics as metrics_lib
from mtp_jax.train import resilience, train_and_evaluate
from mtp_jax.train import steps as steps_lib

FIELDS = dict(steps=6, log_every=2, eval_every=0, checkpoint_every=2, eval_batches=1)


def tiny(data_dir, **train_fields):
  return quiet_tiny(data_dir, FIELDS, **train_fields)


def run(config, workdir, devices, **kw):
  return train_and_evaluate(config, str(workdir), devices=devices[:1], **kw)


def log_rows(workdir) -> dict:
  """{step: {metric: value}} without timings; a step logged twice must log the same numbers."""
  out = {}
  for line in pathlib.Path(workdir, 'metrics.jsonl').read_text().splitlines():
    row = {k: v for k, v in json.loads(line).items() if not k.startswith('perf/')}
    step = row.pop('step')
    kind = 'eval' if any(k.startswith('eval/') for k in row) else 'train'
    if (step, kind) in out:
      assert out[(step, kind)] == row, f'step {step} logged differently after a resume'
    out[(step, kind)] = row
  return out


def saved_params(workdir, step=None) -> list:
  """Leaves of a checkpoint's state, read straight from disk (no model, no compile)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  directory = os.path.join(workdir, 'checkpoints')
  step = step if step is not None else max(int(n) for n in os.listdir(directory) if n.isdigit())
  with warnings.catch_warnings(), ocp.PyTreeCheckpointer() as c:
    warnings.simplefilter('ignore')  # 'sharding info from sharding file': same topology here
    tree = c.restore(os.path.join(directory, str(step), 'state'))
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_same_leaves(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


@pytest.fixture(scope='module')
def reference(devices, stdlib_data_dir, tmp_path_factory):
  """The uninterrupted 6-step run every interrupted run must reproduce bit for bit."""
  workdir = tmp_path_factory.mktemp('reference')
  run(tiny(stdlib_data_dir), workdir, devices)
  return {'workdir': str(workdir), 'rows': log_rows(workdir), 'params': saved_params(workdir)}


# ----------------------------------------------------------------------------- preemption

@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_the_current_step_and_resume_is_exact(sig, devices, stdlib_data_dir,
                                                           reference, tmp_path, capfd):
  """A signal during step 3 (mid log window): save at 3, return; the rerun equals the reference."""
  def preempt(step, batch):
    if step == 3:
      os.kill(os.getpid(), sig)
    return batch

  handler_before = signal.getsignal(sig)
  run(tiny(stdlib_data_dir), tmp_path, devices, batch_hook=preempt)
  assert signal.getsignal(sig) == handler_before  # handlers restored
  err = capfd.readouterr().err
  assert f'Preempted ({signal.Signals(sig).name}) at step 3' in err
  assert sorted(int(n) for n in os.listdir(tmp_path / 'checkpoints')) == [2, 3]
  run(tiny(stdlib_data_dir), tmp_path, devices)
  assert 'Resumed from' in capfd.readouterr().err
  assert log_rows(tmp_path) == reference['rows']  # the step-4 window spans the preemption
  assert_same_leaves(saved_params(tmp_path), reference['params'])


def test_cli_sigterm_exits_zero_after_saving(stdlib_data_dir, tmp_path):
  """scripts/train.py gets SIGTERM mid-run: exit 0, a checkpoint at the step it names."""
  proc = subprocess.Popen(
      [sys.executable, os.path.join(REPO, 'scripts', 'train.py'),
       '--config', os.path.join(REPO, 'configs', 'tiny.py'), f'--workdir={tmp_path}',
       *chaos_overrides(stdlib_data_dir)],
      stderr=subprocess.PIPE, text=True, env=dict(os.environ, XLA_FLAGS=''), cwd=REPO)
  metrics = tmp_path / 'metrics.jsonl'
  deadline = time.time() + 300
  while not (metrics.exists() and metrics.stat().st_size) and proc.poll() is None:
    assert time.time() < deadline, 'no training step within 300 s'
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  line = [l for l in err.splitlines() if l.startswith('Preempted (SIGTERM) at step')]
  assert line, err[-3000:]
  step = int(line[0].split('step ')[1].split(':')[0])
  assert 1 <= step < 40
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / 'checkpoints'))
  assert ckpt.latest_step() == step and ckpt.read_meta(step)['step'] == step
  ckpt.close()


_TWO_HOSTS = """
import os, signal, sys, time
import jax
jax.config.update('jax_num_cpu_devices', 1)
pid, port, sig = int(sys.argv[1]), sys.argv[2], getattr(signal, sys.argv[3])
jax.distributed.initialize(f'127.0.0.1:{port}', num_processes=2, process_id=pid)
from jax.experimental import multihost_utils
from mtp_jax.train import resilience
with resilience.PreemptionGuard(lambda text: None) as guard:
  for step in range(1, 1000):
    time.sleep(0.01 * (1 + pid))  # the hosts run at different speeds
    multihost_utils.process_allgather(jax.numpy.ones(()))  # a collective, like a train step
    if step == 10 and pid == 1:
      os.kill(os.getpid(), sig)  # only host 1 is told
    if guard.should_stop(step):
      print('STOP', step, guard.signal_name, flush=True)
      break
"""


@pytest.mark.parametrize('sig', ['SIGTERM', 'SIGINT'])
def test_two_processes_stop_at_the_same_step(sig):
  """Several processes: a signal to one host stops every host at one agreed step (JAX's
  preemption sync point), so they all save the same checkpoint."""
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = str(s.getsockname()[1])
  env = dict(os.environ, XLA_FLAGS='', PYTHONPATH=REPO)
  procs = [subprocess.Popen([sys.executable, '-c', _TWO_HOSTS, str(i), port, sig],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
           for i in range(2)]
  outs = [p.communicate(timeout=240) for p in procs]
  assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
  stops = [[l.split() for l in o[0].splitlines() if l.startswith('STOP')] for o in outs]
  assert len(stops[0]) == len(stops[1]) == 1, outs
  assert stops[0][0][:2] == stops[1][0][:2] and int(stops[0][0][1]) > 10, outs


def test_metrics_log_cut_by_a_kill_is_repaired(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 1}\n{"step": 2, "train/lo')
  metrics_lib.repair_jsonl(str(path))
  assert path.read_text() == '{"step": 1}\n'
  metrics_lib.repair_jsonl(str(tmp_path / 'missing.jsonl'))  # nothing to do


# ----------------------------------------------------------------------------- broken checkpoints

def _flip_a_byte_of_the_largest_array_file(step_dir):
  files = [f for f in glob.glob(os.path.join(step_dir, 'state', '**', 'd', '*'), recursive=True)]
  path = max(files, key=os.path.getsize)
  data = bytearray(pathlib.Path(path).read_bytes())
  data[len(data) // 2] ^= 0x40
  pathlib.Path(path).write_bytes(bytes(data))


def _truncate(path):
  data = pathlib.Path(path).read_bytes()
  pathlib.Path(path).write_bytes(data[:len(data) // 2])


def test_corrupted_latest_falls_back_to_the_previous_good_one(devices, stdlib_data_dir, reference,
                                                              tmp_path, capfd, monkeypatch):
  """Flipped bytes (which orbax restores silently) and a truncated file: both reported, the
  previous checkpoint restored, the redone steps identical; an incomplete save is ignored;
  nothing is unpickled."""
  def no_pickle(*a, **k):
    raise AssertionError('a checkpoint load unpickled something')
  for name in ('load', 'loads', 'Unpickler'):
    monkeypatch.setattr(pickle, name, no_pickle)

  workdir = tmp_path / 'run'
  shutil.copytree(reference['workdir'], workdir)
  ckpts = workdir / 'checkpoints'
  _flip_a_byte_of_the_largest_array_file(str(ckpts / '6'))
  os.makedirs(ckpts / '8.orbax-checkpoint-tmp' / 'state')  # a save killed half way
  run(tiny(stdlib_data_dir), workdir, devices)
  err = capfd.readouterr().err
  assert 'Ignoring incomplete checkpoint save(s)' in err and '8.orbax-checkpoint-tmp' in err
  assert 'checkpoint 6 is broken' in err and 'restored arrays differ' in err
  assert 'Resumed from' in err and 'at step 4' in err
  assert os.listdir(workdir / ckpt_lib.QUARANTINE_DIR)[0].startswith('6-')
  assert not (ckpts / '8.orbax-checkpoint-tmp').exists()
  assert_same_leaves(saved_params(workdir), reference['params'])
  assert log_rows(workdir) == reference['rows']

  _truncate(str(ckpts / '6' / 'meta' / 'metadata'))  # the JSON of the new step 6
  run(tiny(stdlib_data_dir), workdir, devices)
  err = capfd.readouterr().err
  assert 'checkpoint 6 is broken' in err and 'JSONDecodeError' in err and 'at step 4' in err
  assert len(os.listdir(workdir / ckpt_lib.QUARANTINE_DIR)) == 2
  assert_same_leaves(saved_params(workdir), reference['params'])

  # Valid JSON, wrong data position: caught by the data-state hash, not by any parser.
  data_json = glob.glob(str(ckpts / '6' / 'data' / '*.json'))[0]
  state = json.loads(pathlib.Path(data_json).read_text())
  state['parent_state']['next_index'] += 1
  pathlib.Path(data_json).write_text(json.dumps(state))
  run(tiny(stdlib_data_dir), workdir, devices)
  err = capfd.readouterr().err
  assert 'checkpoint 6 is broken' in err and 'data-iterator state differs' in err
  assert_same_leaves(saved_params(workdir), reference['params'])
  assert log_rows(workdir) == reference['rows']


def test_no_restorable_checkpoint_is_an_error_and_changes_nothing(devices, stdlib_data_dir,
                                                                  reference, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(reference['workdir'], workdir)
  for step in (2, 4, 6):
    _truncate(str(workdir / 'checkpoints' / str(step) / 'state' / '_METADATA'))
  with pytest.raises(ckpt_lib.CheckpointError) as e:
    run(tiny(stdlib_data_dir), workdir, devices)
  msg = str(e.value)
  assert 'no checkpoint' in msg and all(f'step {s}:' in msg for s in (2, 4, 6)) and '\n' not in msg
  assert cli.exit_code_of(e.value) == 2
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['2', '4', '6']  # never a silent restart
  assert not (workdir / ckpt_lib.QUARANTINE_DIR).exists()


# ----------------------------------------------------------------------------- non-finite

def test_nonfinite_update_is_dropped_inside_the_step(devices, stdlib_data_dir):
  """Depth 2's head norm poisoned with NaN: the jitted step returns its input state bit for
  bit, flags the step, and the halt message names the step and depth mtp_2 only."""
  ts, state = steps_lib.setup(tiny(stdlib_data_dir), devices[:1])
  from flax import nnx  # pylint: disable=g-import-not-at-top
  model, opt = nnx.merge(ts.graphdef, state)
  model.mtp[1].shared_head.norm.scale[...] = jnp.full_like(model.mtp[1].shared_head.norm.scale[...],
                                                           jnp.nan)
  state = nnx.state((model, opt))
  before = [np.asarray(x) for x in jax.tree.leaves(state)]
  batch = {k: np.asarray(v) for k, v in _batch(stdlib_data_dir).items()}
  new_state, m = steps_lib.run_step(ts, state, batch)
  m = jax.device_get(m)
  assert int(m['skipped']) == 1
  per_depth = m['loss_sum'] / m['count']
  assert np.isfinite(per_depth[:2]).all() and np.isnan(per_depth[2])
  assert_same_leaves([np.asarray(x) for x in jax.tree.leaves(new_state)], before)
  with pytest.raises(resilience.NonFiniteError, match=r'step 7: .*non-finite: mtp_2\)') as e:
    resilience.NonFiniteMonitor('halt', 10).check(7, m, last_checkpoint=6)
  assert 'last checkpoint is step 6' in str(e.value)
  assert cli.exit_code_of(e.value) == 1


def _batch(data_dir):
  from mtp_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  return next(pipeline.make_train_iter(tiny(data_dir)))


def _bad_token_at(*steps):
  """A corrupted batch (token id past the vocabulary: the embedding gather yields NaN)."""
  def hook(step, batch):
    if step in steps:
      batch = dict(batch, tokens=batch['tokens'].copy())
      batch['tokens'][0, 5] = 10_000
    return batch
  return hook


def test_nonfinite_skip_counts_and_continues(devices, stdlib_data_dir, tmp_path, capfd):
  config = tiny(stdlib_data_dir, nonfinite='skip', checkpoint_every=1, max_to_keep=10)
  run(config, tmp_path, devices, batch_hook=_bad_token_at(3))
  assert 'step 3: non-finite, update skipped (1 so far)' in capfd.readouterr().err
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / 'checkpoints'))
  metas = {s: ckpt.read_meta(s) for s in ckpt.all_steps()}
  ckpt.close()
  assert sorted(metas) == [1, 2, 3, 4, 5, 6]
  assert metas[3]['fingerprint'] == metas[2]['fingerprint']  # step 3 changed nothing
  assert metas[4]['fingerprint'] != metas[3]['fingerprint']  # and training went on
  assert [metas[s]['skipped_total'] for s in range(1, 7)] == [0, 0, 1, 1, 1, 1]
  rows = log_rows(tmp_path)
  assert rows[(4, 'train')]['train/skipped_steps'] == 1
  assert np.isfinite(rows[(4, 'train')]['train/loss'])
  assert all(np.isfinite(x).all() for x in saved_params(tmp_path))

  # Non-finite steps in a row beyond train.max_consecutive_skips stop the run anyway.
  config = tiny(stdlib_data_dir, nonfinite='skip', max_consecutive_skips=2)
  with pytest.raises(resilience.NonFiniteError,
                     match='2 non-finite steps in a row, the last at step 4'):
    run(config, tmp_path / 'again', devices, batch_hook=_bad_token_at(3, 4, 5, 6))


def test_nonfinite_halt_names_step_and_depths_and_saves_nothing_bad(devices, stdlib_data_dir,
                                                                    tmp_path):
  with pytest.raises(resilience.NonFiniteError) as e:
    run(tiny(stdlib_data_dir, nonfinite='halt'), tmp_path, devices, batch_hook=_bad_token_at(3))
  msg = str(e.value)
  assert msg.startswith('non-finite training step 3: ') and 'non-finite: main, mtp_1, mtp_2' in msg
  assert 'last checkpoint is step 2' in msg and '\n' not in msg
  assert sorted(int(n) for n in os.listdir(tmp_path / 'checkpoints')) == [2]


# ----------------------------------------------------------------------------- init from

def test_init_from_adds_an_mtp_depth(devices, stdlib_data_dir, reference, tmp_path, capfd):
  """M = 2 run -> M = 3: trunk, embedding/head and depths 1-2 loaded, depth 3 fresh; trains."""
  deeper = tiny(stdlib_data_dir)
  deeper.model.mtp.depth = 3
  with pytest.raises(ConfigError, match=r'incompatible config.*model\.mtp\.depth.*--init_from'):
    run(deeper, reference['workdir'], devices)  # the same workdir: a clear error

  workdir = tmp_path / 'deeper'
  run(deeper, workdir, devices, init_from=reference['workdir'], stop_after=0)
  assert 'Initialised from' in capfd.readouterr().err
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings(), ocp.PyTreeCheckpointer() as c:
    warnings.simplefilter('ignore')
    old = c.restore(os.path.join(reference['workdir'], 'checkpoints', '6', 'state'))['0']
    new = c.restore(str(workdir / 'checkpoints' / '0' / 'state'))
  np.testing.assert_array_equal(new['0']['embed']['embedding']['value'],
                                old['embed']['embedding']['value'])
  for a, b in zip(jax.tree.leaves(new['0']['layers']), jax.tree.leaves(old['layers'])):
    np.testing.assert_array_equal(a, b)
  for k in ('0', '1'):
    for a, b in zip(jax.tree.leaves(new['0']['mtp'][k]), jax.tree.leaves(old['mtp'][k])):
      np.testing.assert_array_equal(a, b)
  _, fresh = steps_lib.setup(deeper, devices[:1])  # depth 3 keeps the fresh init of this config
  fresh_mtp3 = jax.tree.leaves(fresh[0]['mtp'][2])
  for a, b in zip(jax.tree.leaves(new['0']['mtp']['2']), fresh_mtp3):
    np.testing.assert_array_equal(a, np.asarray(b))
  assert int(np.asarray(new['1']['step']['value'])) == 0  # a new run: fresh optimizer

  out = run(deeper, workdir, devices, init_from=reference['workdir'])  # resumes its own step 0
  assert 'init_from ignored' in capfd.readouterr().err
  assert out['train/loss_mtp_3'] > 0 and np.isfinite(out['train/loss'])

  wider = tiny(stdlib_data_dir)
  wider.model.d_model = 128
  with pytest.raises(ConfigError, match=r'trunk differs.*model\.d_model'):
    run(wider, tmp_path / 'wider', devices, init_from=reference['workdir'])


# ----------------------------------------------------------------------------- disk full

@pytest.fixture
def small_tmpfs(tmp_path):
  """A 12 MiB tmpfs (needs root / CAP_SYS_ADMIN): a filesystem that really fills up."""
  mnt = tmp_path / 'mnt'
  mnt.mkdir()
  proc = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=12m', 'tmpfs', str(mnt)],
                        capture_output=True, text=True)
  if proc.returncode:
    pytest.skip(f'cannot mount a tmpfs here ({proc.stderr.strip()}): disk-full test needs root')
  yield mnt
  subprocess.run(['umount', '-l', str(mnt)], check=False)


@pytest.mark.parametrize('side_write_first', [False, True])
def test_disk_full_during_save_is_reported_and_the_last_checkpoint_survives(
    devices, stdlib_data_dir, reference, small_tmpfs, monkeypatch, side_write_first):
  """side_write_first: goodput.json's rewrite beside the save of step 4 finds the disk full
  before that save has failed; the lost checkpoint is still what the one line names."""
  workdir = small_tmpfs / 'run'
  ballast = small_tmpfs / 'ballast'
  if side_write_first:
    save, write_side_file = ckpt_store.Checkpointer.save, goodput_lib.write_side_file
    in_flight = []

    def noting_save(self, step, *args, **kw):
      out = save(self, step, *args, **kw)
      in_flight.append(step)
      return out

    def full_while_step_4_saves(directory, totals):
      if 4 in in_flight:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
      write_side_file(directory, totals)

    monkeypatch.setattr(ckpt_store.Checkpointer, 'save', noting_save)
    monkeypatch.setattr(goodput_lib, 'write_side_file', full_while_step_4_saves)

  def fill_disk(step, batch):
    if step == 3:  # leave 256 KiB: metric lines still fit, the ~2.8 MB checkpoint does not
      deadline = time.time() + 60
      while not (workdir / 'checkpoints' / '2').exists():  # the async save of step 2 is done
        assert time.time() < deadline
        time.sleep(0.01)
      with open(ballast, 'wb') as f:
        while os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize > 256 << 10:
          f.write(b'\0' * (64 << 10))
          f.flush()
    return batch

  config = tiny(stdlib_data_dir, max_to_keep=1)
  with pytest.raises(ckpt_lib.CheckpointError) as e:
    run(config, workdir, devices, batch_hook=fill_disk)
  msg = str(e.value)
  assert msg.startswith('disk full: could not save the checkpoint of step 4') and '\n' not in msg
  assert cli.exit_code_of(e.value) == 2
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['2', '4.orbax-checkpoint-tmp']

  os.remove(ballast)  # space freed: the same command resumes at 2 and ends where it should
  monkeypatch.undo()
  run(config, workdir, devices)
  assert_same_leaves(saved_params(str(workdir)), reference['params'])


# ----------------------------------------------------------------------------- chaos

def chaos_overrides(data_dir):
  return [f'--config.data.data_dir={data_dir}', '--config.train.steps=40',
          '--config.train.log_every=1', '--config.train.checkpoint_every=4',
          '--config.train.eval_every=20', '--config.train.eval_batches=1']


@pytest.mark.slow
def test_chaos_kill9_many_times_loses_nothing(stdlib_data_dir, tmp_path):
  """scripts/chaos_train.py: >= 10 SIGKILLs (some during saves), final params and loss log
  identical to an uninterrupted run."""
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'chaos_train.py'), f'--workdir={tmp_path}',
       '--kills=10', '--seed=1', f'--data_dir={stdlib_data_dir}'],
      capture_output=True, text=True, env=dict(os.environ, XLA_FLAGS=''), timeout=1500, cwd=REPO)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = dict(line.split(': ', 1) for line in proc.stdout.splitlines() if ': ' in line)
  assert report['identical'] == 'true'
  assert int(report['kills']) >= 10 and int(report['kills during saves']) >= 2
  restarts = (int(report['resumes'])
              + int(report['restarts from scratch (killed before the first checkpoint)'])
              + int(report['restarts killed during start-up, before restoring']))
  assert restarts == int(report['kills']) and int(report['resumes']) >= 3
