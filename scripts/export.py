"""Exports a trained checkpoint as a Hugging Face-layout directory that serving code loads.

The same command as `mtp-export` (mtp_jax/commands/export.py); `--help` lists the options.
"""
from mtp_jax.commands.export import main

if __name__ == '__main__':
  raise SystemExit(main())
