"""Decodes with a trained checkpoint: speculative (MTP drafts), plain autoregressive, or both.

The same command as `mtp-decode` (mtp_jax/commands/decode.py); `--help` lists the options.
"""
import sys

from mtp_jax.commands.decode import main

if __name__ == '__main__':
  sys.exit(main())
