"""What the command lines share: the flag parser and the report of expected failures.

Importing this starts no JAX (argparse and the standard library only), so the commands
import it before parsing flags. The error types themselves live in errors.py.
"""
from __future__ import annotations

import argparse
import sys

from mtp_jax.errors import ConfigError, RequestError, exit_code_of, one_line  # noqa: F401


class ArgumentParser(argparse.ArgumentParser):
  """Flag errors as one `error: ...` line and exit code 2, like every other bad input."""

  def error(self, message):  # argparse's default prints the whole usage first
    print(f'error: {message}', file=sys.stderr)
    sys.exit(2)


def report_expected(e: BaseException) -> int:
  """For a script's `except`: print an expected failure as one `error:` line, return its
  exit code; anything else is a bug and is re-raised with its traceback."""
  code = exit_code_of(e)
  if code is None:
    raise e
  print(f'error: {one_line(e)}', file=sys.stderr)
  return code
