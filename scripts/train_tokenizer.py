"""Trains a SentencePiece BPE: `mtp-train-tokenizer --output runs/tokenizer/spm.model`.

The same command as `mtp-train-tokenizer` (mtp_jax/commands/train_tokenizer.py); `--help`
lists the options.
"""
import sys

from mtp_jax.commands.train_tokenizer import main

if __name__ == '__main__':
  sys.exit(main())
