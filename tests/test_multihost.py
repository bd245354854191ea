"""Two JAX processes on this machine (CPU, 4 devices each, gloo) train like one 8-device process.

The two-process job runs 2 steps, stops with a checkpoint (orbax across processes, one
grain iterator state per process), and a second launch through scripts/train.py resumes
it to step 4. The single-process reference sees the same global batches: its data
iterator concatenates the two processes' shards.
"""
import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from helpers import MULTIHOST_STEPS, REPO, job_config


class _Concat:
  """Iterates several per-process iterators as one: their batches side by side."""

  def __init__(self, iterators):
    self.iterators = iterators

  def __next__(self):
    batches = [next(it) for it in self.iterators]
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

  def get_state(self) -> bytes:  # grain's checkpoint handler stores these bytes
    return json.dumps([it.get_state() for it in self.iterators]).encode()

  def set_state(self, state: bytes):
    for it, s in zip(self.iterators, json.loads(state)):
      it.set_state(s)

  def start_prefetch(self):
    pass


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _launch(commands, timeout=600):
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu')
  procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO) for cmd in commands]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=timeout)
      outs.append((p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()  # reaps it and closes its pipes
  for i, (rc, out, err) in enumerate(outs):
    assert rc == 0, f'process {i} failed:\n{out[-2000:]}\n{err[-4000:]}'
  return outs


def _rows(workdir):
  text = pathlib.Path(workdir, 'metrics.jsonl').read_text()
  return [json.loads(line) for line in text.splitlines()]


@pytest.mark.slow
def test_two_processes_equal_one_process_of_eight_devices(devices, stdlib_data_dir, tmp_path,
                                                          monkeypatch):
  multi = str(tmp_path / 'multi')
  worker = os.path.join(REPO, 'tests', 'multihost_worker.py')
  port = _free_port()
  first = _launch([[sys.executable, worker, str(i), '2', str(port), multi, stdlib_data_dir, '2']
                   for i in range(2)])
  assert 'process 1 of 2: 4 local / 8 global cpu devices' in first[1][1]
  assert os.listdir(os.path.join(multi, 'checkpoints')) == ['2']
  data_files = sorted(f for f in os.listdir(os.path.join(multi, 'checkpoints', '2', 'data'))
                      if f.endswith('.json'))
  assert data_files == ['process_0-of-2.json', 'process_1-of-2.json']

  # The second launch is the real entry script: flags, jax.distributed, resume.
  port = _free_port()
  flags = [f'--config.data.data_dir={stdlib_data_dir}',
           f'--config.train.steps={MULTIHOST_STEPS}',
           '--config.train.log_every=1', '--config.train.eval_every=0',
           '--config.train.checkpoint_every=0', '--config.train.eval_batches=1']
  second = _launch([[sys.executable, os.path.join(REPO, 'scripts', 'train.py'),
                     '--config', os.path.join(REPO, 'configs', 'tiny.py'), '--workdir', multi,
                     f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2',
                     f'--process_id={i}', '--cpu_devices=4', *flags] for i in range(2)])
  assert 'Resumed from' in second[0][2] and 'tok/s' in second[0][2]
  assert 'tok/s' not in second[1][2]  # only process 0 reports

  from mtp_jax.data import pipeline
  from mtp_jax.train import train_and_evaluate
  make_train_iter, make_eval_batches = pipeline.make_train_iter, pipeline.make_eval_batches

  def train_iter(config, *, process_index=0, process_count=1):
    assert process_count == 1
    return _Concat([make_train_iter(config, process_index=p, process_count=2) for p in range(2)])

  def eval_batches(config, *, num_batches, process_index=0, process_count=1):
    shards = [make_eval_batches(config, num_batches=num_batches, process_index=p,
                                process_count=2) for p in range(2)]
    return [{k: np.concatenate([s[i][k] for s in shards]) for k in shards[0][i]}
            for i in range(num_batches)]

  monkeypatch.setattr(pipeline, 'make_train_iter', train_iter)
  monkeypatch.setattr(pipeline, 'make_eval_batches', eval_batches)
  single = str(tmp_path / 'single')
  config = job_config(stdlib_data_dir)
  config.train.progress = False
  train_and_evaluate(config, single, devices=devices)

  got, want = _rows(multi), _rows(single)
  loss = lambda rows: {r['step']: r['train/loss'] for r in rows if 'train/loss' in r}
  assert sorted(loss(got)) == sorted(loss(want)) == list(range(1, MULTIHOST_STEPS + 1))
  np.testing.assert_allclose([loss(got)[s] for s in range(1, MULTIHOST_STEPS + 1)],
                             [loss(want)[s] for s in range(1, MULTIHOST_STEPS + 1)], rtol=2e-5)
  ev = lambda rows: [r for r in rows if 'eval/loss_main' in r][-1]
  for key in ('eval/loss_main', 'eval/loss_mtp_1', 'eval/loss_mtp_2', 'eval/bpb_main'):
    np.testing.assert_allclose(ev(got)[key], ev(want)[key], rtol=2e-5, err_msg=key)
  train_rows = [r for r in got if 'train/loss' in r]
  # Present and positive; one-step windows time the gap between two metric fetches,
  # so their values are not meaningful (benchmarks/train_throughput.py measures MFU).
  assert all(np.isfinite(r['perf/mfu']) and r['perf/mfu'] > 0 for r in train_rows)


# ----------------------------------------------------------------------------- local tier, goodput

# No compilation cache: both processes compile alike, so neither reaches a collective more
# than gloo's 30 s context timeout ahead of the other on a loaded machine.
TIER_TRAIN = dict(steps=6, log_every=1, eval_every=0, checkpoint_every=4, local_checkpoint_every=1,
                  async_checkpoint=False, eval_batches=1, compilation_cache_dir='')
SLOW_HOST_SECONDS = 0.5  # process 1 sleeps this long before each batch: a straggler


def _workers(workdir, data_dir, extra):
  worker = os.path.join(REPO, 'tests', 'multihost_worker.py')
  port = _free_port()
  return [[sys.executable, worker, str(i), '2', str(port), str(workdir), data_dir, '0',
           json.dumps(extra)] for i in range(2)]


@pytest.fixture(scope='module')
def two_process_reference(stdlib_data_dir, tmp_path_factory):
  """An uninterrupted two-process run of TIER_TRAIN whose process 1 is slow to draw batches."""
  workdir = tmp_path_factory.mktemp('reference')
  outs = _launch(_workers(workdir, stdlib_data_dir,
                          {'train': TIER_TRAIN, 'sleep': {'1': SLOW_HOST_SECONDS}}))
  return workdir, outs


def _without_perf(rows):
  return [{k: v for k, v in r.items() if not k.startswith('perf/')} for r in rows]


@pytest.mark.slow
def test_two_processes_report_goodput_and_name_the_slow_host(two_process_reference):
  """Every bucket's seconds for the job and for each host, in the last row and the final
  block; every row's per-host spread names process 1, whose input is slow, as a straggler."""
  workdir, outs = two_process_reference
  err = outs[0][2]
  rows = [r for r in _rows(workdir) if 'perf/step_time' in r]
  assert [r['step'] for r in rows] == list(range(1, 7))
  last = rows[-1]
  for host in (0, 1):
    assert last[f'perf/host{host}_job_time/train'] > 0
    assert last[f'perf/host{host}_job_time/compile'] > 0
  # Process 1 waited SLOW_HOST_SECONDS a batch on its input; process 0 waited for it.
  assert last['perf/host1_job_time/input'] >= 6 * SLOW_HOST_SECONDS
  assert last['perf/host0_job_time/input'] < SLOW_HOST_SECONDS
  assert 0 < last['perf/goodput'] < 1 and last['perf/job_time/save'] > 0
  for r in rows[1:]:  # the first window holds the compile
    assert r['perf/slowest_input_host'] == 1.0
    assert r['perf/input_time_host_max'] >= SLOW_HOST_SECONDS > r['perf/input_time_host_median'] / 2
    assert r['perf/step_time_host_min'] > 0
  assert 'host 1 is a straggler' in err and 'drawing its input' in err, err[-3000:]
  summary = err[err.index('time over'):]
  assert '\nhost 0: compile' in summary and '\nhost 1: compile' in summary, summary[:2000]
  assert 'straggler' not in outs[1][2]  # only process 0 reports


@pytest.mark.slow
def test_two_processes_killed_between_tiers_resume_from_their_local_one(
    two_process_reference, stdlib_data_dir, tmp_path):
  """local_checkpoint_every=1, checkpoint_every=4: both processes SIGKILLed as step 4 starts,
  each holding local steps 2 and 3 in its own directory and no persistent step; the relaunch
  resumes from local step 3 on both and logs the rows of the uninterrupted run."""
  reference, _ = two_process_reference
  workdir = tmp_path / 'killed'
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu')
  procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
           for cmd in _workers(workdir, stdlib_data_dir, {'train': TIER_TRAIN, 'kill_at': 4})]
  codes, errs = [], []
  for p in procs:
    try:
      errs.append(p.communicate(timeout=600)[1])
    finally:
      if p.poll() is None:
        p.kill()
        p.communicate()
    codes.append(p.returncode)
  assert codes[0] == -9, (codes, errs[0][-3000:])  # process 1 may end by the lost coordinator
  assert not [n for n in os.listdir(workdir / 'checkpoints') if n.isdigit()]
  for i in range(2):
    assert sorted(os.listdir(workdir / 'local_checkpoints' / f'process_{i}')) == ['2', '3']
  outs = _launch(_workers(workdir, stdlib_data_dir, {'train': TIER_TRAIN}))
  resumed = f'Resumed from {workdir / "local_checkpoints" / "process_0"} at step 3.'
  assert resumed in outs[0][2], outs[0][2][-3000:]
  got, want = _without_perf(_rows(workdir)), _without_perf(_rows(reference))
  assert [r['step'] for r in got] == [r['step'] for r in want]
  diffs = [(a['step'], k, a.get(k), b.get(k)) for a, b in zip(got, want)
           for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
  assert not diffs, diffs[:8]
  assert sorted(n for n in os.listdir(workdir / 'checkpoints') if n.isdigit())[-1] == '6'
  last = [r for r in _rows(workdir) if 'perf/job_time/compile' in r][-1]  # both attempts
  assert last['perf/job_time/compile'] > last['perf/time/compile'] > 0
