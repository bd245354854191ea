"""Evaluates a trained checkpoint: teacher-forced per-depth figures and free-running decoding.

The same command as `mtp-eval` (mtp_jax/commands/evaluate.py); `--help` lists the options.
"""
import sys

from mtp_jax.commands.evaluate import main

if __name__ == '__main__':
  sys.exit(main())
