"""Tokenizers that round-trip source code exactly: raw bytes, a SentencePiece BPE, or a
pretrained model's own Hugging Face tokenizer (tokenizer.json).

The byte and SentencePiece tokenizers this project trains share one id layout at the
bottom: 0 = pad, 1 = eos (appended to every document). A Hugging Face tokenizer keeps
its checkpoint's ids (Llama 3: no pad, eos 128001; Qwen2: pad = eos = 151643): nothing
downstream reads the pad id's value, since padding is marked by segment_ids = 0 and
masked out of every loss, so `pad_id` is only the filler the tokenizer names.
`token_bytes()` gives the UTF-8 bytes each id stands for, the denominator of
bits-per-byte:
  * pad -> 0 (padding is masked out of every loss anyway), unless it is also eos;
  * eos -> 1: the document boundary is charged as one separator byte, so its
    loss counts and bits-per-byte stays comparable between tokenizers
    (each emits exactly one eos per document);
  * other special tokens (a Llama bos) -> 0: they stand for no text;
  * a byte / byte-fallback token -> 1; a piece -> len(utf-8 text it decodes to).
`decode` skips pad, eos (special tokens) and ids outside the vocabulary (a model's
vocab may be padded past the tokenizer's, so a sampler can emit such ids).
"""
from __future__ import annotations

import io
import json
import os
import re
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from mtp_jax.errors import ConfigError

PAD_ID = 0
EOS_ID = 1
BYTE_VOCAB_SIZE = 258  # pad, eos, 256 bytes
_SPM_WS = '\u2581'  # SentencePiece's escaped space '▁'
# SentencePiece skips longer "sentences"; documents are cut at line ends to fit.
_SPM_MAX_SENTENCE_BYTES = 1 << 14


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  eos_id: int

  def encode(self, text: str) -> list[int]: ...
  def encode_array(self, text: str | bytes) -> np.ndarray: ...
  def decode(self, ids: Iterable[int]) -> str: ...
  def token_bytes(self) -> np.ndarray: ...


class ByteTokenizer:
  """UTF-8 bytes: byte b -> b + 2. No training, vocab 258."""

  vocab_size = BYTE_VOCAB_SIZE
  pad_id = PAD_ID
  eos_id = EOS_ID
  _OFFSET = 2

  def encode_array(self, text: str | bytes) -> np.ndarray:
    """int32 ids of text, without eos (bytes are taken as already UTF-8)."""
    raw = text.encode('utf-8') if isinstance(text, str) else bytes(text)
    return np.frombuffer(raw, np.uint8).astype(np.int32) + self._OFFSET

  def encode(self, text: str) -> list[int]:
    return self.encode_array(text).tolist()

  def decode(self, ids: Iterable[int]) -> str:
    a = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, np.int64).ravel()
    a = a[(a >= self._OFFSET) & (a < self.vocab_size)] - self._OFFSET
    return a.astype(np.uint8).tobytes().decode('utf-8', errors='replace')

  def token_bytes(self) -> np.ndarray:
    out = np.ones([self.vocab_size], np.int32)
    out[PAD_ID] = 0
    return out


class SentencePieceTokenizer:
  """A SentencePiece model trained by `train_sentencepiece` (pad 0, eos 1, byte fallback).

  Picklable (grain worker processes get a copy): it keeps the serialized model.
  Known limit: SentencePiece escapes spaces as U+2581 '▁', so a literal '▁' in
  the text decodes as a space (the standard library has none).
  """

  def __init__(self, model_proto: bytes, path: str = ''):
    # Deferred: sentencepiece is needed only by data.tokenizer='spm' runs.
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    self.path = path
    self._proto = model_proto
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    self.vocab_size = self._sp.get_piece_size()
    self.eos_id = self._sp.eos_id()
    if self.eos_id < 0:
      raise ConfigError(f'data.spm_model {path!r} has no eos piece (eos_id=-1); documents '
                        'end with one (train a model with scripts/train_tokenizer.py)')
    # A model without a pad piece (Llama 2's: pad_id=-1) pads with eos: padding is
    # marked by segment_ids, never by the id.
    self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id

  @classmethod
  def from_file(cls, path: str) -> SentencePieceTokenizer:
    try:
      with open(path, 'rb') as f:
        proto = f.read()
    except OSError as e:
      raise ConfigError(f'data.spm_model {path!r} cannot be read: {e}') from e
    try:
      return cls(proto, path)
    except (RuntimeError, OSError) as e:
      raise ConfigError(f'data.spm_model {path!r} is not a SentencePiece model: {e}') from e

  def __getstate__(self):
    return {'model_proto': self._proto, 'path': self.path}

  def __setstate__(self, state):
    self.__init__(state['model_proto'], state['path'])

  def encode_array(self, text: str | bytes) -> np.ndarray:
    if not isinstance(text, str):
      text = bytes(text).decode('utf-8', errors='replace')
    return np.asarray(self._sp.encode(text), np.int32)

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    ids = [int(i) for i in (ids.ravel() if isinstance(ids, np.ndarray) else ids)]
    return self._sp.decode([i for i in ids if 0 <= i < self.vocab_size and i != self.pad_id])

  def token_bytes(self) -> np.ndarray:
    out = np.zeros([self.vocab_size], np.int32)
    for i in range(self.vocab_size):
      if i == self.eos_id:
        out[i] = 1
      elif i == self.pad_id or self._sp.is_control(i):  # pad, bos: no text
        out[i] = 0
      elif self._sp.is_unknown(i) or self._sp.is_byte(i):
        out[i] = 1
      else:
        out[i] = len(self._sp.id_to_piece(i).replace(_SPM_WS, ' ').encode('utf-8'))
    return out


def byte_level_chars() -> dict[str, int]:
  """GPT-2's byte-level alphabet: the printable character standing for each byte."""
  keep = [*range(ord('!'), ord('~') + 1), *range(ord('\xa1'), ord('\xac') + 1),
          *range(ord('\xae'), ord('\xff') + 1)]
  out, extra = {}, 0
  for b in range(256):
    if b in keep:
      out[chr(b)] = b
    else:
      out[chr(256 + extra)] = b
      extra += 1
  return out


_BYTE_PIECE = re.compile(r'<0x[0-9A-Fa-f]{2}>')  # SentencePiece byte fallback


def _special_id(tok, value) -> int | None:
  """A tokenizer_config.json token entry ('</s>' or {'content': '</s>', ...}) as an id."""
  if isinstance(value, dict):
    value = value.get('content')
  return tok.token_to_id(value) if isinstance(value, str) else None


def _first_id(value) -> int | None:
  """config.json's eos_token_id / pad_token_id: an int, a list (first) or null."""
  if isinstance(value, list):
    value = value[0] if value else None
  return value if isinstance(value, int) and not isinstance(value, bool) else None


def _hf_tokenizer(tokenizer_json: str):
  # Deferred: the `tokenizers` library is needed only by data.tokenizer='hf' runs.
  import tokenizers as hf_tokenizers  # pylint: disable=g-import-not-at-top
  return hf_tokenizers.Tokenizer.from_str(tokenizer_json)


class HFTokenizer:
  """A pretrained model's tokenizer.json (the `tokenizers` library), ids as released.

  encode adds the special tokens its post-processor adds (Llama's bos, as the model
  saw in training); decode drops special tokens. eos: tokenizer_config.json's
  eos_token, else config.json / generation_config.json's eos_token_id; pad: its
  pad_token / pad_token_id, else eos. Picklable (grain workers): it keeps the JSON.
  """

  def __init__(self, tokenizer_json: str, eos_id: int, pad_id: int, path: str = ''):
    self.path = path
    self._json = tokenizer_json
    self._tok = _hf_tokenizer(tokenizer_json)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.eos_id, self.pad_id = int(eos_id), int(pad_id)
    for name, i in (('eos', self.eos_id), ('pad', self.pad_id)):
      if not 0 <= i < self.vocab_size:
        raise ConfigError(f'data.hf_tokenizer {path!r}: {name} id {i} is outside the '
                          f'tokenizer vocabulary [0, {self.vocab_size})')

  @classmethod
  def from_dir(cls, directory: str) -> HFTokenizer:
    """The tokenizer of a Hugging Face model directory; ConfigError naming what is missing."""
    directory = os.path.abspath(os.path.expanduser(directory))
    field = 'data.hf_tokenizer'
    if not os.path.isdir(directory):
      raise ConfigError(f'{field} {directory!r} is not a directory (a local Hugging Face '
                        'model directory holding tokenizer.json)')
    path = os.path.join(directory, 'tokenizer.json')
    if not os.path.isfile(path):
      raise ConfigError(f'{field} {directory!r} has no tokenizer.json (nor a SentencePiece '
                        'tokenizer.model, which --init_from hf:DIR would take instead)')
    configs = {}
    for name in ('tokenizer_config.json', 'config.json', 'generation_config.json'):
      p = os.path.join(directory, name)
      configs[name] = {}
      if not os.path.isfile(p):
        continue
      try:
        with open(p, encoding='utf-8') as f:
          configs[name] = json.load(f)
      except (OSError, ValueError) as e:
        raise ConfigError(f'{field}: {p} cannot be read as JSON ({e})') from e
      if not isinstance(configs[name], dict):
        raise ConfigError(f'{field}: {p} is not a JSON object')
    try:
      with open(path, encoding='utf-8') as f:
        text = f.read()
      tok = _hf_tokenizer(text)
    except Exception as e:  # pylint: disable=broad-except  (the library raises plain Exception)
      raise ConfigError(f'{field}: {path} is not a tokenizer.json the tokenizers library '
                        f'reads ({" ".join(str(e).split())[:200]})') from e
    tc, mc, gc = (configs[n] for n in ('tokenizer_config.json', 'config.json',
                                       'generation_config.json'))
    eos = _special_id(tok, tc.get('eos_token'))
    for source in (mc, gc):
      eos = _first_id(source.get('eos_token_id')) if eos is None else eos
    if eos is None:
      raise ConfigError(f'{field} {directory!r}: no eos token (tokenizer_config.json '
                        'eos_token or config.json eos_token_id)')
    pad = _special_id(tok, tc.get('pad_token'))
    pad = _first_id(mc.get('pad_token_id')) if pad is None else pad
    return cls(text, eos, eos if pad is None else pad, directory)

  def __getstate__(self):
    return {'json': self._json, 'eos_id': self.eos_id, 'pad_id': self.pad_id, 'path': self.path}

  def __setstate__(self, state):
    self.__init__(state['json'], state['eos_id'], state['pad_id'], state['path'])

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text).ids

  def encode_array(self, text: str | bytes) -> np.ndarray:
    if not isinstance(text, str):
      text = bytes(text).decode('utf-8', errors='replace')
    return np.asarray(self.encode(text), np.int32)

  def decode(self, ids: Iterable[int]) -> str:
    ids = [int(i) for i in (ids.ravel() if isinstance(ids, np.ndarray) else ids)]
    return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size],
                            skip_special_tokens=True)

  def token_bytes(self) -> np.ndarray:
    spec = json.loads(self._json)
    byte_level = 'ByteLevel' in json.dumps(spec.get('decoder'))  # GPT-2 style byte BPE
    chars = byte_level_chars()
    added = {i: t for i, t in self._tok.get_added_tokens_decoder().items()}
    out = np.zeros([self.vocab_size], np.int32)
    for i in range(self.vocab_size):
      piece = self._tok.id_to_token(i)
      if i in added:  # added tokens are stored as their text, special ones stand for none
        out[i] = 0 if added[i].special else len(added[i].content.encode('utf-8'))
      elif piece is None:
        out[i] = 0
      elif byte_level:
        out[i] = sum(1 if c in chars else len(c.encode('utf-8')) for c in piece)
      elif _BYTE_PIECE.fullmatch(piece):
        out[i] = 1
      else:
        out[i] = len(piece.replace(_SPM_WS, ' ').encode('utf-8'))
    out[self.pad_id] = 0
    out[self.eos_id] = 1
    return out


def get_tokenizer(data_config) -> Tokenizer:
  """The tokenizer named by data.tokenizer; ConfigError naming the field otherwise."""
  kind = data_config.tokenizer
  if kind == 'byte':
    return ByteTokenizer()
  if kind == 'sentencepiece':
    path = data_config.spm_model
    if not path:
      raise ConfigError('data.spm_model must name a .model file when data.tokenizer is '
                        "'sentencepiece' (train one with scripts/train_tokenizer.py)")
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
      raise ConfigError(f'data.spm_model {path!r} does not exist '
                        '(train one with scripts/train_tokenizer.py)')
    return SentencePieceTokenizer.from_file(path)
  if kind == 'hf':
    if not data_config.hf_tokenizer:
      raise ConfigError("data.hf_tokenizer must name a directory holding tokenizer.json when "
                        "data.tokenizer is 'hf' (--init_from hf:DIR sets it)")
    return HFTokenizer.from_dir(data_config.hf_tokenizer)
  raise ConfigError(f"data.tokenizer must be 'byte', 'sentencepiece' or 'hf', got {kind!r}")


def model_vocab_size(config) -> int:
  """config.model.vocab_size, or the tokenizer's size rounded up to model.vocab_multiple."""
  if config.model.vocab_size:
    return int(config.model.vocab_size)
  n = vocab_size_for(config.data)
  mult = config.model.vocab_multiple
  return int(-(-n // mult) * mult)


def resolve_vocab_size(config):
  """Sets config.model.vocab_size to model_vocab_size(config) when it is 0; returns config.

  The commands call this once on the config they were given, so the model layer never
  opens a tokenizer and the saved config names the vocabulary the weights have.
  """
  if not config.model.vocab_size:
    config.model.vocab_size = model_vocab_size(config)
  return config


def vocab_size_for(data_config) -> int:
  """The tokenizer's vocab size, without touching the corpus (reads the spm model file)."""
  if data_config.tokenizer == 'byte':
    return BYTE_VOCAB_SIZE
  return get_tokenizer(data_config).vocab_size


def _sentences(texts: Iterable[str], max_bytes: int) -> Iterable[str]:
  """Cuts documents at line ends into pieces below max_bytes (UTF-8); newlines kept."""
  for text in texts:
    if len(text.encode('utf-8')) < max_bytes:
      yield text
      continue
    chunk, size = [], 0
    for line in text.splitlines(keepends=True):
      n = len(line.encode('utf-8'))
      if chunk and size + n >= max_bytes:
        yield ''.join(chunk)
        chunk, size = [], 0
      if n >= max_bytes:  # a single huge line: cut by characters (still exact text)
        step = max_bytes // 4
        for i in range(0, len(line), step):
          yield line[i:i + step]
        continue
      chunk.append(line)
      size += n
    if chunk:
      yield ''.join(chunk)


def train_sentencepiece(texts: Iterable[str], *, vocab_size: int = 8192,
                        num_threads: int | None = None) -> bytes:
  """Trains a code-safe BPE on texts; returns the serialized model.

  Identity normalization, no whitespace removal, no dummy prefix and
  whitespace-only pieces ('▁▁▁▁' for indentation) keep the text exact; newlines
  stay inside the sentences, so pieces such as ':\\n' are learned; byte_fallback
  means nothing is ever unknown.
  """
  # Deferred: sentencepiece is needed only to train an 'spm' tokenizer.
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(_sentences(texts, _SPM_MAX_SENTENCE_BYTES)),
      model_writer=model,
      model_type='bpe',
      vocab_size=vocab_size,
      hard_vocab_limit=False,  # a small sample may not support the full vocab
      normalization_rule_name='identity',
      remove_extra_whitespaces=False,
      add_dummy_prefix=False,
      allow_whitespace_only_pieces=True,
      split_by_whitespace=True,
      byte_fallback=True,
      character_coverage=0.9995,  # rare characters go to byte fallback
      max_sentence_length=_SPM_MAX_SENTENCE_BYTES,
      pad_id=PAD_ID, eos_id=EOS_ID, unk_id=2, bos_id=-1,
      num_threads=num_threads or os.cpu_count() or 1,
      minloglevel=2,
  )
  return model.getvalue()


def sample_texts(data_config, split: str, max_bytes: int, seed: int = 0) -> list[str]:
  """Documents of a split in a seeded random order, until max_bytes of UTF-8 text."""
  # Deferred: stdlib_dataset imports tensorflow_datasets (seconds); the byte and spm
  # tokenizers themselves need no data set.
  import mtp_jax.data.stdlib_dataset as stdlib_dataset  # pylint: disable=g-import-not-at-top
  source = stdlib_dataset.data_source(data_config, split)
  texts, total = [], 0
  for i in np.random.default_rng(seed).permutation(len(source)):
    text = as_text(source[int(i)][data_config.text_key])
    if not text:
      continue
    texts.append(text)
    total += len(text.encode('utf-8'))
    if total >= max_bytes:
      break
  return texts


def as_text(value) -> str:
  """A TFDS Text feature (bytes) as str."""
  return value.decode('utf-8', errors='replace') if isinstance(value, bytes) else str(value)


def roundtrip_failures(tokenizer: Tokenizer, texts: Sequence[str]) -> list[int]:
  """Indices of texts for which decode(encode(text)) != text."""
  return [i for i, t in enumerate(texts) if tokenizer.decode(tokenizer.encode(t)) != t]


def train_tokenizer(data_config, *, output: str, vocab_size: int = 8192,
                    max_bytes: int = 20 << 20, seed: int = 0) -> dict:
  """Trains a BPE on data.train_split only, writes it to output, checks the eval split.

  Returns a report: sizes, timings, bytes per token and round-trip failures on
  (up to max_bytes of) data.eval_split.
  """
  start = time.perf_counter()
  texts = sample_texts(data_config, data_config.train_split, max_bytes, seed)
  sampled = time.perf_counter()
  proto = train_sentencepiece(texts, vocab_size=vocab_size)
  trained = time.perf_counter()
  output = os.path.abspath(os.path.expanduser(output))
  os.makedirs(os.path.dirname(output), exist_ok=True)
  tmp = f'{output}.tmp{os.getpid()}'
  with open(tmp, 'wb') as f:
    f.write(proto)
  os.replace(tmp, output)  # readers never see a half-written model
  tok = SentencePieceTokenizer(proto, output)
  held_out = sample_texts(data_config, data_config.eval_split, max_bytes, seed)
  n_tokens = sum(len(tok.encode(t)) for t in held_out)
  n_bytes = sum(len(t.encode('utf-8')) for t in held_out)
  failures = roundtrip_failures(tok, held_out)
  return {
      'output': output, 'vocab_size': tok.vocab_size, 'model_bytes': len(proto),
      'train_docs': len(texts), 'train_bytes': sum(len(t.encode('utf-8')) for t in texts),
      'sample_seconds': sampled - start, 'train_seconds': trained - sampled,
      'eval_docs': len(held_out), 'eval_bytes': n_bytes,
      'eval_bytes_per_token': n_bytes / max(n_tokens, 1),
      'roundtrip_failures': len(failures),
  }
