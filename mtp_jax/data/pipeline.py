"""grain input pipeline: documents -> tokens + eos -> packed rows -> per-process batches.

Every element is a dict of int32 numpy arrays of shape [b, T] (b = the per-process
batch, data.batch_size // process_count; T = data.seq_len):
  tokens       token ids, 0 (pad) where nothing was packed
  segment_ids  1, 2, ... per document inside the row; 0 = padding
  positions    position inside the document piece, 0 at each segment start
Documents are concatenated and split (grain ConcatThenSplit): a long document
continues in the next row as a new segment whose positions restart at 0, and no
token is dropped. Each document ends with eos; empty documents are skipped,
short ones kept (loss masks handle targets past a segment's end).
"""
from __future__ import annotations

from typing import Any

from absl import flags
import grain
import numpy as np

from mtp_jax import config_lib
from mtp_jax.config_lib import ConfigError
from mtp_jax.data import stdlib_dataset, tokenizers

_KEY = 'tokens'
_RENAME = {'tokens': _KEY, 'segment_ids': f'{_KEY}_segment_ids',
           'positions': f'{_KEY}_positions'}
# Documents are read and tokenized in background threads. Two beat grain's 16 on a
# 2-core host (SentencePiece encode holds the GIL; more threads only contend), and
# 64 prefetched documents (≈ 1 MB of text) bound the memory.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=64)


class _Tokenize:
  """record -> {'tokens': int32 ids + eos}; a class so grain workers can pickle it."""

  def __init__(self, tokenizer: tokenizers.Tokenizer, text_key: str):
    self.tokenizer = tokenizer
    self.text_key = text_key

  def __call__(self, record: dict[str, Any]) -> dict[str, np.ndarray]:
    ids = self.tokenizer.encode_array(record[self.text_key])
    return {_KEY: np.append(ids, np.int32(self.tokenizer.eos_id)).astype(np.int32)}


class _NonEmpty:
  """Keeps records whose text is non-empty."""

  def __init__(self, text_key: str):
    self.text_key = text_key

  def __call__(self, record: dict[str, Any]) -> bool:
    return len(record[self.text_key]) > 0


def _rename(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {name: np.asarray(batch[src], np.int32) for name, src in _RENAME.items()}


def pack_and_batch(docs: grain.IterDataset, *, seq_len: int, batch_size: int) -> grain.IterDataset:
  """{'tokens': [n]} documents -> batches of {tokens, segment_ids, positions} [b, T].

  A finite input ends with one padded row; the last incomplete batch is dropped.
  """
  packed = grain.experimental.ConcatThenSplitIterDataset(docs, length_struct={_KEY: seq_len})
  return packed.batch(batch_size, drop_remainder=True).map(_rename)


def per_process_batch_size(config, process_count: int = 1) -> int:
  """data.batch_size // process_count; ConfigError unless it divides evenly."""
  b = config.data.batch_size
  if process_count < 1 or b % process_count:
    raise ConfigError(f'data.batch_size ({b}) must be divisible by the number of '
                      f'processes ({process_count})')
  return b // process_count


def _check_shard(process_index: int, process_count: int):
  if not 0 <= process_index < process_count:
    raise ValueError(f'process_index {process_index} not in [0, {process_count})')


def _documents(config, split: str, process_index: int, process_count: int) -> grain.MapDataset:
  """This process's disjoint shard (every process_count-th record) of a split."""
  _check_shard(process_index, process_count)
  source = stdlib_dataset.data_source(config.data, split)
  if len(source) < process_count:
    raise ConfigError(f'data.dataset {config.data.dataset!r} split {split!r} has {len(source)} '
                      f'documents, fewer than the {process_count} processes reading it')
  return grain.MapDataset.source(source)[process_index::process_count]


def make_train_iter(config, *, process_index: int = 0,
                    process_count: int = 1) -> grain.DatasetIterator:
  """An endless, checkpointable iterator of training batches for this process.

  Each epoch reshuffles this process's shard (seeded by data.shuffle_seed).
  The iterator supports get_state()/set_state() and
  grain.checkpoint.CheckpointSave/CheckpointRestore.
  """
  d = config.data
  batch = per_process_batch_size(config, process_count)
  tokenizer = tokenizers.get_tokenizer(d)
  docs = (_documents(config, d.train_split, process_index, process_count)
          .seed(d.shuffle_seed).shuffle().repeat()
          .filter(_NonEmpty(d.text_key)).map(_Tokenize(tokenizer, d.text_key))
          .to_iter_dataset(_READ_OPTIONS))
  ds = pack_and_batch(docs, seq_len=d.seq_len, batch_size=batch)
  if d.worker_count > 0:
    # grain's workers read absl flags; outside absl.app.run nobody parsed them.
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=d.worker_count))
  return iter(ds)


def make_eval_batches(config, *, num_batches: int, process_index: int = 0,
                      process_count: int = 1) -> list[dict[str, np.ndarray]]:
  """The first num_batches batches of the eval split, in file order: the same every call.

  The split is cycled if it holds fewer tokens than num_batches need, so every
  process gets exactly num_batches batches.
  """
  d = config.data
  batch = per_process_batch_size(config, process_count)
  tokenizer = tokenizers.get_tokenizer(d)
  docs = (_documents(config, d.eval_split, process_index, process_count).repeat()
          .filter(_NonEmpty(d.text_key)).map(_Tokenize(tokenizer, d.text_key))
          .to_iter_dataset(_READ_OPTIONS))
  it = iter(pack_and_batch(docs, seq_len=d.seq_len, batch_size=batch))
  return [next(it) for _ in range(num_batches)]


def validate_data_config(config, process_count: int = 1) -> None:
  """Fails early, with a ConfigError naming the field, on any data setting that cannot work.

  Prepares python_stdlib if needed (≈ 1-2 s once), so nothing later waits on it.
  """
  d = config.data
  for name in ('seq_len', 'batch_size'):
    config_lib.require_positive_int(f'data.{name}', d[name])
  per_process_batch_size(config, process_count)
  tokenizers.get_tokenizer(d)  # unknown tokenizer, missing / invalid spm model
  for split_field in ('train_split', 'eval_split'):
    source = stdlib_dataset.data_source(d, d[split_field])  # unknown / unprepared dataset
    stdlib_dataset.check_text_key(d, source[0])
