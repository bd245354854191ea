"""A JAX profiler trace of a window of training steps (train.profile_steps='A:B').

The trace starts just before step A is dispatched and stops once step B-1 has finished on
the device, so it holds training only: the step is compiled before the window opens, and
config_lib.profile_window refuses a window with an evaluation or a checkpoint save inside.
It is written under WORKDIR/profile/ (plugins/profile/<time>/<host>.xplane.pb), by process
0 or, with train.profile_all_processes, by every process. Open it with TensorBoard's
profile plugin or xprof: `tensorboard --logdir WORKDIR/profile`.
"""
from __future__ import annotations

import os

import jax

# The named scopes (jax.named_scope) that a step's parts are traced under, so a profile
# (train/step_profile.py) can tell them apart: their ops' HLO op_name holds the scope.
ATTENTION_SCOPE = 'attention_core'
LOSS_SCOPE = 'loss_head'
OPTIMIZER_SCOPE = 'optimizer_update'


class StepProfiler:
  """Starts and stops jax.profiler around the steps of one window."""

  def __init__(self, window: tuple[int, int] | None, directory: str, *,
               all_processes: bool = False, notify=None):
    wanted = all_processes or jax.process_index() == 0
    self.window = window if wanted else None
    self.directory = directory
    self.notify = notify
    self.active = False
    self.done = False

  def before_step(self, step: int) -> None:
    """Called with the 1-based number of the step about to be dispatched."""
    if self.window is None or self.active or self.done:
      return
    first, end = self.window
    if first <= step < end:
      os.makedirs(self.directory, exist_ok=True)
      jax.profiler.start_trace(self.directory)
      self.active = True

  def after_step(self, step: int, outputs, *, stopping: bool = False) -> None:
    """Called once `step` was dispatched; stops at the window's last step (or an early end),
    after waiting for the device so the trace holds the step's whole execution."""
    if not self.active:
      return
    if step >= self.window[1] - 1 or stopping:
      self.stop(outputs)

  def stop(self, outputs=None) -> None:
    if not self.active:
      return
    if outputs is not None:
      jax.block_until_ready(outputs)
    jax.profiler.stop_trace()
    self.active, self.done = False, True
    if self.notify is not None:
      self.notify(f'Wrote a profiler trace of steps {self.window[0]}..{self.window[1] - 1} '
                  f'under {self.directory} (tensorboard --logdir {self.directory}).')
