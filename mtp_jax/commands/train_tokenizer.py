"""Trains a SentencePiece BPE: `mtp-train-tokenizer --output runs/tokenizer/spm.model`.

Trains on the train split only (python_stdlib by default, or --config's data settings),
then checks decode(encode(text)) == text on the eval split. Use the model with
--config.data.tokenizer=sentencepiece --config.data.spm_model=PATH. The logic lives in
mtp_jax/data/tokenizers.py.
"""
from __future__ import annotations

import sys

from mtp_jax import cli


def parser() -> cli.ArgumentParser:
  p = cli.ArgumentParser(prog='mtp-train-tokenizer', description=__doc__.splitlines()[0])
  p.add_argument('--output', required=True, help='where to write the .model file')
  p.add_argument('--config', metavar='FILE',
                 help='optional config file; only its data.* fields are used (' +
                 cli.CONFIG_HELP.split('; ', 1)[1] + ')')
  p.add_argument('--vocab_size', type=cli.positive_int, default=8192,
                 help='vocabulary size (incl. pad, eos, unk, 256 bytes)')
  p.add_argument('--max_mb', type=cli.positive_float, default=20.0,
                 help='MB of train-split text to sample for training')
  p.add_argument('--seed', type=int, default=0, help='seed of the document sample')
  return p


def main(argv=None) -> int:
  args, overrides = cli.parse_with_config(parser(), argv)
  from mtp_jax.config.base import base_config  # pylint: disable=g-import-not-at-top
  from mtp_jax.data import tokenizers  # pylint: disable=g-import-not-at-top
  try:
    if args.config:
      config = cli.load_config(args.config, overrides)
    elif overrides:
      raise cli.ConfigError('--config.* overrides need --config FILE')
    else:
      config = base_config()
    r = tokenizers.train_tokenizer(config.data, output=args.output, vocab_size=args.vocab_size,
                                   max_bytes=int(args.max_mb * 2**20), seed=args.seed)
  except Exception as e:  # pylint: disable=broad-except
    return cli.report_expected(e)
  print(f"wrote {r['output']}: vocab {r['vocab_size']}, {r['model_bytes'] / 1024:.0f} KiB")
  print(f"trained on {r['train_docs']} {config.data.train_split} documents "
        f"({r['train_bytes'] / 2**20:.1f} MB) in {r['train_seconds']:.1f} s "
        f"(+{r['sample_seconds']:.1f} s reading)")
  print(f"{config.data.eval_split}: {r['eval_docs']} documents, {r['eval_bytes_per_token']:.2f} "
        f"bytes/token, round-trip failures: {r['roundtrip_failures']}")
  return 1 if r['roundtrip_failures'] else 0


if __name__ == '__main__':
  sys.exit(main())
