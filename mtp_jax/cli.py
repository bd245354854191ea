"""Command-line helpers shared by scripts/ (argparse only: importing this starts no JAX)."""
import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
  """Flag errors as one `error: ...` line and exit code 2, like every other bad input."""

  def error(self, message):  # argparse's default prints the whole usage first
    print(f'error: {message}', file=sys.stderr)
    sys.exit(2)
