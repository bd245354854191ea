"""Multi-seed MTP ablations: every variant x seed, resumable, tabulated as mean ± std.

The same command as `mtp-ablation` (mtp_jax/commands/ablation.py); `--help` lists the options.
"""
import sys

from mtp_jax.commands.ablation import main

if __name__ == '__main__':
  sys.exit(main())
