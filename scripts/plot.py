"""Writes PNG figures of a run or of a sweep.

The same command as `mtp-plot` (mtp_jax/commands/plot.py); `--help` lists the options.
"""
import sys

from mtp_jax.commands.plot import main

if __name__ == '__main__':
  sys.exit(main())
