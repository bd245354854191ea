"""Trains the SentencePiece BPE: `python scripts/train_tokenizer.py --output /tmp/spm.model`.

Trains on the train split only (python_stdlib by default, or --config's data
settings), then checks decode(encode(text)) == text on the eval split. Use the
model with --config.data.tokenizer=sentencepiece --config.data.spm_model=PATH.
The logic lives in mtp_jax/data/tokenizers.py.
"""
import os
import sys

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp_jax import config_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Optional config file; only its data.* fields are used.', lock_config=True)
_OUTPUT = flags.DEFINE_string('output', None, 'Where to write the .model file.')
_VOCAB = flags.DEFINE_integer('vocab_size', 8192, 'Vocabulary size (incl. pad, eos, unk, 256 bytes).')
_MAX_MB = flags.DEFINE_float('max_mb', 20.0, 'MB of train-split text to sample for training.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the document sample.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  from mtp_jax.data import tokenizers  # pylint: disable=g-import-not-at-top
  config = _CONFIG.value if _CONFIG.value is not None else config_lib.base_config()
  try:
    r = tokenizers.train_tokenizer(config.data, output=_OUTPUT.value, vocab_size=_VOCAB.value,
                                   max_bytes=int(_MAX_MB.value * 2**20), seed=_SEED.value)
  except config_lib.ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  print(f"wrote {r['output']}: vocab {r['vocab_size']}, {r['model_bytes'] / 1024:.0f} KiB")
  print(f"trained on {r['train_docs']} {config.data.train_split} documents "
        f"({r['train_bytes'] / 2**20:.1f} MB) in {r['train_seconds']:.1f} s "
        f"(+{r['sample_seconds']:.1f} s reading)")
  print(f"{config.data.eval_split}: {r['eval_docs']} documents, {r['eval_bytes_per_token']:.2f} "
        f"bytes/token, round-trip failures: {r['roundtrip_failures']}")
  if r['roundtrip_failures']:
    sys.exit(1)


if __name__ == '__main__':
  flags.mark_flags_as_required(['output'])
  app.run(main)
