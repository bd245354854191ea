"""The project's expected errors and how they read: one line, an exit code.

Bad input raises ConfigError (a config value) or RequestError (flags, prompts, a workdir);
the command lines print either as one `error: ...` line and exit 2. Standard library only,
so every layer can import it.
"""
from __future__ import annotations

import errno


class ConfigError(ValueError):
  """A configuration value that cannot work; the message names the field."""


class RequestError(ValueError):
  """A request (flags, prompts, a workdir) that cannot run; the message names the problem
  (CLI exit code 2)."""
  exit_code = 2


def exit_code_of(e: BaseException) -> int | None:
  """The CLI exit code for an expected failure (2: bad input / environment), else None.

  Expected failures carry their code as a class attribute `exit_code`
  (checkpoint.CheckpointError, resilience.NonFiniteError); a ConfigError is 2.
  """
  if isinstance(e, ConfigError):
    return 2
  code = getattr(e, 'exit_code', None)
  if code is not None:
    return code
  if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS,
                                            errno.EACCES, errno.EPERM, errno.ENOTDIR):
    return 2  # e.g. metrics.jsonl on a full disk: the environment, not a bug
  return None


def one_line(e: BaseException) -> str:
  """The error as one line; the type name is left out for the project's own expected errors."""
  text = ' '.join(str(e).split())
  expected = isinstance(e, ConfigError) or getattr(e, 'exit_code', None) is not None
  return text if expected else f'{type(e).__name__}: {text}'
