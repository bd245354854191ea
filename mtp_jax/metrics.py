"""Where metrics go: metrics.jsonl, TensorBoard event files, a live console line."""
from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np


def _to_py(v):
  v = np.asarray(v)
  return v.item() if v.ndim == 0 else v.tolist()


class MetricWriter:
  """Writes one JSON object per call to metrics.jsonl and scalars to TensorBoard.

  Only the process that owns it writes (process 0 in multi-host jobs).
  """

  def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True):
    self.enabled = enabled
    self._tb = None
    self._file = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._file = open(os.path.join(workdir, 'metrics.jsonl'), 'a', buffering=1)
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, step: int, metrics: dict):
    if not self.enabled:
      return
    row = {'step': int(step)}
    row.update({k: _to_py(v) for k, v in sorted(metrics.items())})
    self._file.write(json.dumps(row) + '\n')
    if self._tb is not None:
      for k, v in row.items():
        if k != 'step' and isinstance(v, (int, float)) and math.isfinite(v):
          self._tb.add_scalar(k, v, int(step))

  def close(self):
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()


class Progress:
  """A single console line rewritten in place: step, loss, tokens/s, ETA."""

  def __init__(self, total_steps: int, *, enabled: bool = True, stream=None):
    self.total = total_steps
    self.enabled = enabled
    self.stream = stream or sys.stderr
    self.tty = getattr(self.stream, 'isatty', lambda: False)()
    self.start_time = time.time()
    self.start_step = None

  def update(self, step: int, loss: float, tokens_per_sec: float, extra: str = ''):
    if not self.enabled:
      return
    now = time.time()
    if self.start_step is None:
      self.start_step, self.start_time = step, now
    done = step - self.start_step
    rate = done / max(now - self.start_time, 1e-9)
    eta = (self.total - step) / rate if rate > 0 else float('nan')
    line = (f'step {step:>6d}/{self.total}  loss {loss:7.4f}  {tokens_per_sec:9.0f} tok/s  '
            f'ETA {_fmt_time(eta)}{("  " + extra) if extra else ""}')
    if self.tty:
      self.stream.write('\r' + line.ljust(100))
    else:
      self.stream.write(line + '\n')
    self.stream.flush()

  def message(self, text: str):
    if not self.enabled:
      return
    if self.tty:
      self.stream.write('\r' + ' ' * 100 + '\r')
    self.stream.write(text + '\n')
    self.stream.flush()

  def close(self):
    if self.enabled and self.tty:
      self.stream.write('\n')


def _fmt_time(s: float) -> str:
  if not math.isfinite(s):
    return '--:--'
  s = int(s)
  return f'{s // 3600:d}:{s // 60 % 60:02d}:{s % 60:02d}' if s >= 3600 else f'{s // 60:02d}:{s % 60:02d}'
