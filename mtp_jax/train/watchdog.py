"""The step-time watchdog: a stalled training loop says where it is stuck.

A daemon thread watches the time since the last finished step. When it passes the limit,
`train.hang_factor` times the median step time or `train.hang_seconds` (whichever rule is on
and trips first; the median rule only while steps run, not during an eval or a save), it
writes one line and every thread's Python stack (faulthandler) to stderr, the log of this
host: each process of a job runs its own watchdog, so a collective stuck on one host shows
on all of them. With `train.hang_exit` it then exits with HANG_EXIT_CODE, so that a
supervisor (the pod launcher's --watch) restarts the job from its newest checkpoint.
"""
from __future__ import annotations

import collections
import faulthandler
import os
import statistics
import sys
import threading
import time
import traceback

import jax

HANG_EXIT_CODE = 124  # as timeout(1): the job ran past its time
MIN_STEPS = 3  # step times seen before the median rule is armed
WINDOW = 100  # step times the median is taken over


def hang_limit(step_times, factor: float, seconds: float, stepping: bool = True) -> float | None:
  """Seconds without a step that count as a hang (None: no rule is armed).

  factor x the median of `step_times` (while `stepping`, once MIN_STEPS were seen), and
  `seconds`; 0 turns a rule off; with both on, the smaller limit applies.
  """
  limits = []
  if factor > 0 and stepping and len(step_times) >= MIN_STEPS:
    limits.append(factor * statistics.median(step_times))
  if seconds > 0:
    limits.append(float(seconds))
  return min(limits) if limits else None


class StepWatchdog:
  """Call `beat()` after every step, `pause()` / `resume()` around evals and saves (only
  hang_seconds applies there), `stop()` at the end. Off (no thread) when both rules are 0."""

  def __init__(self, factor: float, seconds: float, exit_on_hang: bool = False, *,
               stream=None, exit_fn=os._exit, poll: float = 0.2):
    self.factor, self.seconds, self.exit_on_hang = float(factor), float(seconds), exit_on_hang
    self.stream = stream or sys.stderr
    self.exit_fn = exit_fn
    self.poll = poll
    self.step_times = collections.deque(maxlen=WINDOW)
    self.step = None  # the last finished step
    self.fired = 0  # hangs reported
    self._last = None  # time of the last beat (None: not armed before the first step)
    self._stepping = True
    self._reported = False  # this stall was reported already
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = None

  @property
  def enabled(self) -> bool:
    return self.factor > 0 or self.seconds > 0

  def start(self) -> StepWatchdog:
    if self.enabled and self._thread is None:
      self._thread = threading.Thread(target=self._run, name='mtp-step-watchdog', daemon=True)
      self._thread.start()
    return self

  def beat(self, step: int) -> None:
    now = time.monotonic()
    with self._lock:
      if self._last is not None and self._stepping:
        self.step_times.append(now - self._last)
      self._last, self.step, self._stepping, self._reported = now, step, True, False

  def pause(self) -> None:
    """An eval or a save starts: only the hang_seconds rule applies until resume()."""
    with self._lock:
      self._stepping = False

  def resume(self) -> None:
    with self._lock:
      if self._last is not None:
        self._last = time.monotonic()  # the next step is timed from here
      self._stepping, self._reported = True, False

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
      self._thread = None

  def _run(self):
    while not self._stop.wait(self.poll):
      with self._lock:
        if self._last is None or self._reported:
          continue
        idle = time.monotonic() - self._last
        limit = hang_limit(self.step_times, self.factor, self.seconds, self._stepping)
        if limit is None or idle < limit:
          continue
        self._reported = True
        median = statistics.median(self.step_times) if self.step_times else None
        where = 'steps' if self._stepping else 'an eval or a save'
        step = self.step
      self.fired += 1
      self._report(step, idle, limit, median, where)
      if self.exit_on_hang:
        self.exit_fn(HANG_EXIT_CODE)

  def _report(self, step, idle, limit, median, where):
    med = f'{median:.3g} s' if median is not None else 'not measured yet'
    then = (f'exiting with code {HANG_EXIT_CODE} (train.hang_exit)' if self.exit_on_hang
            else 'still waiting')
    line = (f'WATCHDOG: no training step for {idle:.1f} s after step {step} (limit '
            f'{limit:.1f} s: train.hang_factor={self.factor:g} x median step {med}, '
            f'train.hang_seconds={self.seconds:g}; during {where}); process {jax.process_index()} '
            f'pid {os.getpid()}; every thread\'s stack follows, then {then}')
    try:
      self.stream.write(line + '\n')
      self.stream.flush()
      try:
        faulthandler.dump_traceback(file=self.stream, all_threads=True)
      except (OSError, ValueError):  # a stream without a file descriptor
        for ident, frame in sys._current_frames().items():  # pylint: disable=protected-access
          self.stream.write(f'Thread {ident:#x}:\n' + ''.join(traceback.format_stack(frame)))
      self.stream.flush()
    except (OSError, ValueError):  # a closed log: the exit (if asked) still happens
      pass
