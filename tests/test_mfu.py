"""MFU never reads above 1: the peak it divides by is raised by any faster reading (a
run's own FLOP/s, a probe, a benchmark), a cache taken under load gives way, and a data-sheet
peak caps it too.

Trainer runs use tiny.py on a small jsonl corpus (helpers.write_jsonl), on one device.
"""
import json
import os
import pathlib

import jax.numpy as jnp
import pytest

from helpers import jsonl_config, write_jsonl
from mtp_jax.runtime import peak as peak_lib
from mtp_jax.train import resilience, train_and_evaluate


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
