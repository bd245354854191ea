"""What the commands that read a trained workdir share: the sampling flags, and the start
that checks the workdir before JAX is imported.

Argparse and the standard library only, like the parsers that call it.
"""
from __future__ import annotations

import mtp_jax.commands.preflight as preflight
from mtp_jax import cli


def add_sampling_flags(p, *, max_new_tokens: int, temperature: float) -> None:
  """--max_new_tokens, --temperature, --top_k and --top_p, each checked as it is parsed."""
  p.add_argument('--max_new_tokens', type=cli.positive_int, default=max_new_tokens,
                 help='tokens to generate per prompt')
  p.add_argument('--temperature', type=cli.non_negative_float, default=temperature,
                 help='0: greedy')
  p.add_argument('--top_k', type=cli.non_negative_int, default=0, help='0: off')
  p.add_argument('--top_p', type=cli.probability, default=1.0, help='1: off')


def open_workdir(workdir: str, files: tuple = ()) -> int | None:
  """The exit code of the one-line error when `workdir` (or a (path, flag) of `files`) is not
  there to read, answered before JAX starts; else None, with the libraries' per-restore
  INFO logs (orbax) quieted to warnings."""
  try:
    preflight.read_workdir(workdir)
    for path, flag in files:
      preflight.readable_file(path, flag)
  except cli.RequestError as e:
    return cli.report_expected(e)
  cli.quiet_library_logs()
  return None
