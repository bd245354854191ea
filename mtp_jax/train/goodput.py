"""Goodput: where a run's wall-clock time went, per attempt and across restarts.

Every second from the start of `train_and_evaluate` is given to exactly one bucket by
`Ledger.lap(bucket)` (the time since the previous lap): compiling, restoring, waiting for
input, training, evaluating, saving, other start-up work. Checkpoints carry the job's totals
(`meta['goodput']`); process 0 also keeps the newest totals in `WORKDIR/goodput.json`, so a
restart knows how much of the previous attempt came after the checkpoint it resumes from:
work that is done again, counted as `lost`. metrics.jsonl gets `perf/time/<bucket>` (this
attempt) and `perf/job_time/<bucket>` (all attempts), with `perf/goodput`, the job's share
of training time.

`host_spread` gathers each process's step time at a log line (a collective, so every
process calls it at the same steps) and names the slowest host.
"""
from __future__ import annotations

import json
import os
import statistics
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

BUCKETS = ('compile', 'restore', 'input', 'train', 'eval', 'save', 'lost', 'other')
SIDE_FILE = 'goodput.json'
STRAGGLER_RATIO = 1.25  # a host this much slower than the median host is named


class Ledger:
  """Seconds per bucket for this attempt, plus the job's totals before it (`base`)."""

  def __init__(self, clock=time.monotonic):
    self.clock = clock
    self.attempt = dict.fromkeys(BUCKETS, 0.0)
    self.base = dict.fromkeys(BUCKETS, 0.0)
    self._last = clock()

  def lap(self, bucket: str) -> float:
    """Gives the time since the previous lap to `bucket`; returns it."""
    now = self.clock()
    seconds, self._last = now - self._last, now
    self.attempt[bucket] += seconds
    return seconds

  def job(self) -> dict:
    return {b: self.base[b] + self.attempt[b] for b in BUCKETS}

  def resume(self, saved: dict | None, newest: dict | None) -> float:
    """Continues the job's totals from a checkpoint's `saved` ones; what `newest` (the
    side file, written later by the attempt that was cut short) holds beyond them was
    redone, and counts as lost. Returns those lost seconds."""
    saved = {b: float((saved or {}).get(b, 0.0)) for b in BUCKETS}
    lost = 0.0
    if newest:
      lost = max(0.0, sum(float(newest.get(b, 0.0)) for b in BUCKETS) - sum(saved.values()))
    self.base = dict(saved, lost=saved['lost'] + lost)
    return lost

  def metrics(self) -> dict:
    job = self.job()
    out = {f'perf/time/{b}': self.attempt[b] for b in BUCKETS}
    out.update({f'perf/job_time/{b}': job[b] for b in BUCKETS})
    out['perf/goodput'] = job['train'] / max(sum(job.values()), 1e-9)
    return out

  def summary(self) -> str:
    """'time: train 12.3 s (61 %), compile 4.1 s, ...' over the job (all attempts)."""
    job = self.job()
    total = max(sum(job.values()), 1e-9)
    parts = [f'{b} {job[b]:.1f} s ({100 * job[b] / total:.0f} %)' for b in BUCKETS if job[b] > 0]
    return f'time over {total:.1f} s: ' + ', '.join(parts)


def read_side_file(workdir: str) -> dict | None:
  try:
    with open(os.path.join(workdir, SIDE_FILE)) as f:
      data = json.load(f)
    return data if isinstance(data, dict) else None
  except (OSError, ValueError):
    return None


def write_side_file(workdir: str, totals: dict) -> None:
  path = os.path.join(workdir, SIDE_FILE)
  with open(path + '.tmp', 'w') as f:
    json.dump(totals, f)
  os.replace(path + '.tmp', path)


def spread(times) -> dict:
  """perf/ metrics of per-host step times (index = process)."""
  times = [float(t) for t in times]
  median = statistics.median(times)
  slowest = int(np.argmax(times))
  return {'perf/step_time_host_min': min(times), 'perf/step_time_host_max': max(times),
          'perf/step_time_host_median': median, 'perf/slowest_host': float(slowest)}


def straggler_line(step: int, times) -> str | None:
  """A line naming the slowest host when it is STRAGGLER_RATIO x slower than the median."""
  times = [float(t) for t in times]
  if len(times) < 2:
    return None
  median = statistics.median(times)
  slowest = int(np.argmax(times))
  if times[slowest] < STRAGGLER_RATIO * median:
    return None
  return (f'step {step}: host {slowest} is a straggler: {times[slowest]:.3g} s a step against '
          f'a median of {median:.3g} s over {len(times)} hosts')


def host_step_times(step_time: float) -> list[float]:
  """Every process's step time (a collective with several processes)."""
  if jax.process_count() == 1:
    return [float(step_time)]
  gathered = multihost_utils.process_allgather(np.float32(step_time))
  return [float(x) for x in np.asarray(gathered).ravel()]
