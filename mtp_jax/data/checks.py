"""Checks of a run's data made before anything compiles: the splits read, documents are long
enough for the deepest MTP depth."""
from __future__ import annotations

import mtp_jax.data.tokenizers as tokenizers
import mtp_jax.data.user_data as user_data
from mtp_jax.errors import ConfigError, one_line


def validate_data(config, process_count: int = 1) -> None:
  """pipeline.validate_data_config, with TFDS's failure on a split left without any readable
  document (every file binary or empty) turned into a ConfigError naming the corpus."""
  # Deferred: the data pipeline imports tensorflow_datasets (seconds), needed only to train.
  import mtp_jax.data.pipeline as pipeline  # pylint: disable=g-import-not-at-top
  try:
    pipeline.validate_data_config(config, process_count)
  except AssertionError as e:
    if 'No examples were yielded' not in str(e):
      raise
    raise ConfigError(
        f'data.corpus_dir {config.data.corpus_dir or "(this interpreter stdlib)"!r}: a split has '
        f'no readable document ({one_line(e)}); files holding NUL bytes (binary) and empty '
        'files are skipped') from e


_DOC_SAMPLE = 512


def check_document_lengths(config) -> None:
  """ConfigError when no sampled training document is long enough for the deepest MTP depth.

  Depth k at position i predicts t_{i+k+1} of the same document, so a document (with its
  eos) needs M + 2 tokens to give depth M one target; a corpus of shorter ones would
  train depth M on a loss that is always empty (0), silently.
  """
  # Deferred: stdlib_dataset imports tensorflow_datasets (seconds), needed only to train,
  # and pipeline imports stdlib_dataset; its document_ids reads data.tokens_key.
  import mtp_jax.data.pipeline as pipeline
  import mtp_jax.data.stdlib_dataset as stdlib_dataset
  mtp_depth = config.model.mtp.depth
  need = mtp_depth + 2
  d = config.data
  source = stdlib_dataset.data_source(d, d.train_split)
  tokenizer = tokenizers.get_tokenizer(d)
  n = min(len(source), _DOC_SAMPLE)
  longest = 0
  for i in range(n):
    length = len(pipeline.document_ids(tokenizer, d, source[i]))
    if not length:
      continue
    longest = max(longest, length + 1)  # + eos
    if longest >= need:
      return
  raise ConfigError(
      f'data: the {n} documents checked in split {d.train_split!r} of {user_data.describe(d)} '
      f'are all shorter than model.mtp.depth + 2 = {need} tokens (longest '
      f'{longest} with eos), so MTP depth {mtp_depth} would never have a target; lower '
      'model.mtp.depth or use longer documents')
