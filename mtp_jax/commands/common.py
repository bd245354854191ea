"""What the commands that read a trained workdir share: the sampling flags, and the run
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


def run_on_workdir(workdir: str, job, files: tuple = ()) -> int:
  """A reading command's run: `workdir` (and each (path, flag) of `files`) checked before
  JAX starts, the libraries' per-restore INFO logs (orbax) quieted to warnings, then
  `job()` (which imports JAX and the library, does the work, prints and returns the exit
  code). Bad input or a broken checkpoint, before or inside the job: one line and 2."""
  try:
    preflight.read_workdir(workdir)
    for path, flag in files:
      preflight.readable_file(path, flag)
  except cli.RequestError as e:
    return cli.report_expected(e)
  cli.quiet_library_logs()
  try:
    return job()
  except Exception as e:  # pylint: disable=broad-except
    return cli.report_expected(e)  # re-raised unless expected: a bug keeps its traceback
