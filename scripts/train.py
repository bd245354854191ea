"""Trains an MTP model: `python scripts/train.py --config configs/stdlib_mtp.py [--workdir DIR]`.

The same command as `mtp-train` (mtp_jax/commands/train.py); `--help` lists the options.
"""
import sys

from mtp_jax.runtime import signals

# Before the heavy imports: a SIGTERM / SIGINT from here on ends the start-up in one line.
signals.install_for_process()

from mtp_jax.commands.train import main  # noqa: E402

if __name__ == '__main__':
  sys.exit(main())
