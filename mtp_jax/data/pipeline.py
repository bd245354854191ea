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

import os
from typing import Any

import grain
import numpy as np
from absl import flags

import mtp_jax.data.stdlib_dataset as stdlib_dataset
import mtp_jax.data.tokenizers as tokenizers
import mtp_jax.data.user_data as user_data
from mtp_jax.config.schema import require_positive_int
from mtp_jax.errors import ConfigError

_KEY = 'tokens'
_RENAME = {'tokens': _KEY, 'segment_ids': f'{_KEY}_segment_ids',
           'positions': f'{_KEY}_positions'}


def read_options(data_config) -> grain.ReadOptions:
  """grain's read threads and prefetch buffer: data.read_threads / data.prefetch_buffer, or
  (0) from this host's CPU count.

  Tokenizing holds the GIL (SentencePiece, the byte tokenizer's numpy work in part), so
  threads beyond a few only contend: one per 8 CPUs, at least 2 (a laptop) and at most 16
  (a TPU VM's 100+ vCPUs); worker processes (data.worker_count) scale past that. The
  buffer holds 32 documents per thread (64 on 2 threads, about 1 MB of text).
  """
  threads = data_config.get('read_threads', 0) or default_read_threads(os.cpu_count() or 2)
  return grain.ReadOptions(num_threads=threads,
                           prefetch_buffer_size=(data_config.get('prefetch_buffer', 0)
                                                 or 32 * threads))


def default_read_threads(cpu_count: int) -> int:
  return max(2, min(16, cpu_count // 8))


def document_ids(tokenizer: tokenizers.Tokenizer, data_config,
                 record: dict[str, Any]) -> np.ndarray:
  """A record's token ids without eos: data.tokens_key's ids as stored, else its encoded text."""
  tokens_key = data_config.tokens_key
  if tokens_key:
    return np.asarray(record[tokens_key], np.int32)
  return tokenizer.encode_array(record[data_config.text_key])


class _Tokenize:
  """record -> {'tokens': int32 ids + eos}; a class so grain workers can pickle it.

  tokens_key: the record already holds the ids (data.tokens_key), taken as they are.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, text_key: str, tokens_key: str = ''):
    self.tokenizer = tokenizer
    self.text_key = text_key
    self.tokens_key = tokens_key

  def __call__(self, record: dict[str, Any]) -> dict[str, np.ndarray]:
    if self.tokens_key:
      ids = np.asarray(record[self.tokens_key], np.int32)
    else:
      ids = self.tokenizer.encode_array(record[self.text_key])
    return {_KEY: np.append(ids, np.int32(self.tokenizer.eos_id)).astype(np.int32)}


class _NonEmpty:
  """Keeps records whose text (or token ids) are non-empty."""

  def __init__(self, key: str):
    self.key = key

  def __call__(self, record: dict[str, Any]) -> bool:
    return len(record[self.key]) > 0


def _tokenize_steps(config, tokenizer):
  """(filter, map) of a split's records: skip empty documents, then tokens + eos."""
  d = config.data
  tokens_key = d.tokens_key
  return _NonEmpty(tokens_key or d.text_key), _Tokenize(tokenizer, d.text_key, tokens_key)


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
    raise ConfigError(f'{user_data.describe(config.data)} split {split!r} has {len(source)} '
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
  non_empty, tokenize = _tokenize_steps(config, tokenizers.get_tokenizer(d))
  docs = (_documents(config, d.train_split, process_index, process_count)
          .seed(d.shuffle_seed).shuffle().repeat()
          .filter(non_empty).map(tokenize)
          .to_iter_dataset(read_options(d)))
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
  non_empty, tokenize = _tokenize_steps(config, tokenizers.get_tokenizer(d))
  docs = (_documents(config, d.eval_split, process_index, process_count).repeat()
          .filter(non_empty).map(tokenize)
          .to_iter_dataset(read_options(d)))
  it = iter(pack_and_batch(docs, seq_len=d.seq_len, batch_size=batch))
  try:
    return [next(it) for _ in range(num_batches)]
  finally:
    it.close()  # its reader threads stop now, not whenever the iterator is collected


def validate_data_config(config, process_count: int = 1) -> None:
  """Fails early, with a ConfigError naming the field, on any data setting that cannot work.

  Prepares python_stdlib if needed (≈ 1-2 s once), so nothing later waits on it. User
  data (data.source): the path, files and the first record's field are checked here.
  """
  d = config.data
  for name in ('seq_len', 'batch_size'):
    require_positive_int(f'data.{name}', d[name])
  per_process_batch_size(config, process_count)
  user_data.check_fields(d)
  tokenizer = tokenizers.get_tokenizer(d)  # unknown tokenizer, missing / invalid spm model
  for split_field in ('train_split', 'eval_split'):
    source = stdlib_dataset.data_source(d, d[split_field])  # unknown / unprepared dataset
    first = source[0]  # user sources check their field while reading
    if not user_data.is_user_source(d):
      stdlib_dataset.check_text_key(d, first)
    elif d.tokens_key:
      _check_token_ids(config, tokenizer, first[d.tokens_key])


def _check_token_ids(config, tokenizer, ids) -> None:
  """Stored ids must index the model's vocabulary (they were made with another one if not).

  The model's, not the tokenizer's: a model samples (self_distill) from all its rows.
  """
  d, m = config.data, config.model
  # As model.resolve_vocab_size (not imported: the data layer starts no JAX).
  size = m.vocab_size or -(-tokenizer.vocab_size // m.vocab_multiple) * m.vocab_multiple
  ids = np.asarray(ids)
  if ids.size and (ids.min() < 0 or ids.max() >= size):
    raise ConfigError(f'data.tokens_key {d.tokens_key!r} of {user_data.describe(d)} holds ids '
                      f'in [{ids.min()}, {ids.max()}], outside the model\'s {size}-token '
                      f'vocabulary (data.tokenizer {d.tokenizer!r}): made with another tokenizer?')
