"""SIGTERM / SIGINT while a run starts, and the manual stack dump (standard library only).

`StartupSignals` is installed first thing by the trainer's command line, before JAX or any
other heavy module is imported. Its handler only records the signal; the start-up code calls
`check()` at safe points (between its phases, and last just before the first step), which
raises `StartupInterrupted`: the run ends with one `error:` line and exit 143 (SIGTERM) or
130 (SIGINT), never trains, and the trainer undoes a workdir it created. Raising from the
handler itself would land wherever the main thread is, inside JAX's compilation-cache read
or a garbage-collection hook that swallow or mangle it.

`install_stack_dump()` makes SIGUSR1 print every thread's Python stack to stderr
(faulthandler), for a process that looks stuck.
"""
from __future__ import annotations

import faulthandler
import signal
import sys
import threading

STARTUP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StartupInterrupted(RuntimeError):
  """SIGTERM / SIGINT while a run was starting, before its first step: nothing to save."""

  def __init__(self, signum: int):
    self.signal_name = signal.Signals(signum).name
    self.exit_code = 128 + int(signum)  # what a shell reports: 143 SIGTERM, 130 SIGINT
    super().__init__(f'{self.signal_name} received while the run was starting, before its '
                     'first step: nothing was trained or saved; the same command starts it again')


class StartupSignals:
  """Records SIGTERM / SIGINT from install() on; check() raises StartupInterrupted at a
  safe point once one arrived. A second signal of the same kind after the first restores
  that signal's default action and re-sends it: a user who insists gets out at once."""

  def __init__(self):
    self.received: int | None = None
    self._previous = {}

  def install(self) -> StartupSignals:
    if threading.current_thread() is threading.main_thread():
      for sig in STARTUP_SIGNALS:
        self._previous[sig] = signal.signal(sig, self._record)
    return self

  @property
  def installed(self) -> bool:
    return bool(self._previous)

  def uninstall(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def release(self, sig: int) -> None:
    """Stops recording `sig` without putting back what was there before: another owner
    (JAX's preemption service takes SIGTERM when a multi-process job starts) holds it now."""
    self._previous.pop(sig, None)

  def _record(self, signum, frame):
    del frame
    if self.received == signum:  # the second of its kind: the default action, now
      signal.signal(signum, signal.SIG_DFL)
      signal.raise_signal(signum)
      return
    self.received = self.received or signum

  def check(self) -> None:
    """StartupInterrupted when a signal arrived since install()."""
    if self.received is not None:
      raise StartupInterrupted(self.received)


_PROCESS = [None]  # the instance the command line installed, for the trainer to continue


def install_for_process() -> StartupSignals:
  """The process's start-up recorder, installed once (by the command line, before heavy
  imports); later calls return the same one."""
  if _PROCESS[0] is None or not _PROCESS[0].installed:
    _PROCESS[0] = StartupSignals().install()
  return _PROCESS[0]


def for_process() -> StartupSignals | None:
  """The recorder install_for_process installed, if it is still installed."""
  s = _PROCESS[0]
  return s if s is not None and s.installed else None


def install_stack_dump(file=None) -> bool:
  """SIGUSR1 dumps every thread's Python stack to `file` (stderr) and the process goes on.
  False where there is no SIGUSR1 (Windows)."""
  if not hasattr(signal, 'SIGUSR1'):
    return False
  file = file or sys.stderr
  try:
    file.fileno()
  except (AttributeError, OSError, ValueError):  # a captured stderr (io.StringIO) has no fd
    file = sys.__stderr__
  faulthandler.register(signal.SIGUSR1, file=file, all_threads=True, chain=False)
  return True
