"""Goodput: where a run's wall-clock time went, per attempt and across restarts.

Every second from the start of `train_and_evaluate` is given to exactly one bucket by
`Ledger.lap(bucket)` (the time since the previous lap): compiling, restoring, waiting for
input, training, evaluating, saving, other start-up work. Checkpoints carry the job's totals
(`meta['goodput']`); process 0 also keeps the newest totals in `WORKDIR/goodput.json`, so a
restart knows how much of the previous attempt came after the checkpoint it resumes from:
work that is done again, counted as `lost`. metrics.jsonl gets `perf/time/<bucket>` (this
attempt) and `perf/job_time/<bucket>` (all attempts), with `perf/goodput`, the job's share
of training time.

`host_step_times` gathers each process's step time and input time at a log line (a
collective, so every process calls it at the same steps); `straggler_line` names the slowest
host. `host_totals` gathers each process's buckets for the final block and the last row.
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


def spread(times, inputs=None) -> dict:
  """perf/ metrics of per-host step times and (inputs) seconds a step spent on the host
  drawing the batch (index = process)."""
  times = [float(t) for t in times]
  median = statistics.median(times)
  out = {'perf/step_time_host_min': min(times), 'perf/step_time_host_max': max(times),
         'perf/step_time_host_median': median, 'perf/slowest_host': float(np.argmax(times))}
  if inputs is not None:
    inputs = [float(t) for t in inputs]
    out.update({'perf/input_time_host_max': max(inputs),
                'perf/input_time_host_median': statistics.median(inputs),
                'perf/slowest_input_host': float(np.argmax(inputs))})
  return out


def straggler_line(step: int, times, inputs=None) -> str | None:
  """A line naming the slowest host, or None.

  Hosts in one job step in lockstep (every step's collectives wait for the last host), so
  their step times are alike and a slow host shows in its own host-side work: the input
  time a step (`inputs`), named when it exceeds the median host's by STRAGGLER_RATIO x and a
  tenth of the step. Step times that differ that much are named too.
  """
  times = [float(t) for t in times]
  if len(times) < 2:
    return None
  median = statistics.median(times)
  if inputs is not None:
    inputs = [float(t) for t in inputs]
    slow, mid = int(np.argmax(inputs)), statistics.median(inputs)
    if inputs[slow] >= STRAGGLER_RATIO * mid and inputs[slow] - mid > 0.1 * median:
      return (f'step {step}: host {slow} is a straggler: {inputs[slow]:.3g} s a step drawing '
              f'its input against a median of {mid:.3g} s over {len(times)} hosts '
              f'(step time {median:.3g} s)')
  slowest = int(np.argmax(times))
  if times[slowest] < STRAGGLER_RATIO * median:
    return None
  return (f'step {step}: host {slowest} is a straggler: {times[slowest]:.3g} s a step against '
          f'a median of {median:.3g} s over {len(times)} hosts')


def host_step_times(step_time: float, input_time: float | None = None):
  """Every process's step time (a collective with several processes); with `input_time`,
  (step times, input times)."""
  mine = [float(step_time)] + ([] if input_time is None else [float(input_time)])
  if jax.process_count() == 1:
    rows = np.asarray([mine])
  else:
    rows = np.asarray(multihost_utils.process_allgather(np.asarray(mine, np.float32)))
    rows = rows.reshape(jax.process_count(), len(mine))
  times = [float(x) for x in rows[:, 0]]
  return times if input_time is None else (times, [float(x) for x in rows[:, 1]])


def host_totals(totals: dict) -> list[dict]:
  """Every process's bucket totals (a collective with several processes), index = process."""
  mine = np.asarray([float(totals.get(b, 0.0)) for b in BUCKETS], np.float32)
  if jax.process_count() == 1:
    rows = mine[None]
  else:
    rows = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
  return [dict(zip(BUCKETS, (float(x) for x in row))) for row in rows]


def host_lines(per_host: list[dict]) -> list[str]:
  """'host 1: compile 3.1 s, input 9.0 s, ...' for each process of a multi-process job."""
  if len(per_host) < 2:
    return []
  return [f'host {i}: ' + ', '.join(f'{b} {t[b]:.1f} s' for b in BUCKETS if t[b] > 0)
          for i, t in enumerate(per_host)]
