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
