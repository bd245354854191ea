"""Self-distilled MTP training data: samples continuations from a trained trunk (FastMTP).

The same command as `mtp-self-distill` (mtp_jax/commands/self_distill.py); `--help` lists
the options.
"""
import sys

from mtp_jax.commands.self_distill import main

if __name__ == '__main__':
  sys.exit(main())
