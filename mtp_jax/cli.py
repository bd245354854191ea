"""What the command lines share: the flag parser, RequestError and exit codes.

Importing this starts no JAX (argparse, errno and config_lib only), so scripts/ import
it before parsing flags.
"""
from __future__ import annotations

import argparse
import errno
import sys

from mtp_jax.config_lib import ConfigError


class ArgumentParser(argparse.ArgumentParser):
  """Flag errors as one `error: ...` line and exit code 2, like every other bad input."""

  def error(self, message):  # argparse's default prints the whole usage first
    print(f'error: {message}', file=sys.stderr)
    sys.exit(2)


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


def report_expected(e: BaseException) -> int:
  """For a script's `except`: print an expected failure as one `error:` line, return its
  exit code; anything else is a bug and is re-raised with its traceback."""
  code = exit_code_of(e)
  if code is None:
    raise e
  print(f'error: {one_line(e)}', file=sys.stderr)
  return code
