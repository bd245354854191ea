"""Tokenizers: exact round trips on code, id layout, byte counts, config errors."""
import io
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm

from mtp_jax import config_lib
from mtp_jax.config_lib import ConfigError
from mtp_jax.data import corpus, tokenizers

# Whitespace and characters that code tokenizers tend to lose.
_TRICKY = [
    '', 'x', ' ', '\n', '\t', '  leading spaces', '\tleading tab', '\n\nleading newlines',
    'trailing spaces   ', 'a  b   c    d', 'if x:\n\tpass\n        return  1\n\n\n',
    'tabs\t\tand\t spaces \t', 'crlf\r\nline\r\n', 'unicode: é → 日本語 🐍 \u00a0nbsp',
    'U+FFFD \ufffd from replaced bytes', '\x0b\x0c form feeds \x1b[0m',
]


@pytest.fixture(scope='module')
def texts():
  """{split: [text]} of the stdlib corpus, read from disk."""
  return {s: [t for _, t in corpus.split_documents(s)] for s in corpus.SPLITS}


@pytest.fixture(scope='module')
def spm_path(texts, tmp_path_factory):
  """A 512-piece BPE trained on a ~2 MB seeded sample of the train split."""
  order = np.random.default_rng(0).permutation(len(texts['train']))
  sample, size = [], 0
  for i in order:
    sample.append(texts['train'][i])
    size += len(sample[-1])
    if size > 2 << 20:
      break
  path = tmp_path_factory.mktemp('spm') / 'bpe512.model'
  path.write_bytes(tokenizers.train_sentencepiece(sample, vocab_size=512))
  return str(path)


def _data_config(**kw):
  c = config_lib.base_config().data
  for k, v in kw.items():
    c[k] = v
  return c


def _check_token_bytes(tok, text):
  """token_bytes counts each token's UTF-8 bytes: they sum to the text's size (+1 for eos)."""
  ids = tok.encode(text) + [tok.eos_id]
  assert int(tok.token_bytes()[ids].sum()) == len(text.encode('utf-8')) + 1


def test_byte_tokenizer_layout_and_round_trip_on_every_stdlib_file(texts):
  tok = tokenizers.get_tokenizer(_data_config(tokenizer='byte'))
  assert (tok.vocab_size, tok.pad_id, tok.eos_id) == (258, 0, 1)
  assert tok.encode('A\n') == [ord('A') + 2, ord('\n') + 2]
  assert tok.decode([0, 67, 1, 0, 300, 68]) == 'AB'  # pad, eos, out-of-vocab skipped
  tb = tok.token_bytes()
  assert tb.dtype == np.int32 and tb.shape == (258,) and tb[0] == 0 and (tb[1:] == 1).all()
  all_texts = texts['train'] + texts['validation']
  assert len(all_texts) > 500
  assert tokenizers.roundtrip_failures(tok, all_texts + _TRICKY) == []
  assert any(not t.isascii() for t in all_texts)
  for t in _TRICKY:
    _check_token_bytes(tok, t)
  np.testing.assert_array_equal(tok.encode_array('é'.encode()), tok.encode('é'))


def test_sentencepiece_round_trips_validation_files(spm_path, texts):
  tok = tokenizers.get_tokenizer(_data_config(tokenizer='sentencepiece', spm_model=spm_path))
  assert (tok.vocab_size, tok.pad_id, tok.eos_id) == (512, 0, 1)
  assert tokenizers.vocab_size_for(_data_config(tokenizer='sentencepiece',
                                                spm_model=spm_path)) == 512
  assert tokenizers.roundtrip_failures(tok, texts['validation']) == []
  assert tokenizers.roundtrip_failures(tok, _TRICKY) == []
  ids = np.concatenate([tok.encode_array(t) for t in texts['validation']])
  assert ids.min() > 2, 'byte fallback: nothing is pad, eos or unknown'
  n_bytes = sum(len(t.encode()) for t in texts['validation'])
  assert n_bytes / len(ids) > 1.5, 'a trained BPE compresses code'
  assert tok.decode(tok.encode('a = 1\n') + [tok.eos_id, tok.pad_id, 10_000]) == 'a = 1\n'


def test_sentencepiece_learns_code_whitespace(spm_path):
  tok = tokenizers.SentencePieceTokenizer.from_file(spm_path)
  pieces = {tok._sp.id_to_piece(i) for i in range(tok.vocab_size)}  # pylint: disable=protected-access
  assert '\u2581' * 4 in pieces, 'indentation as whitespace-only pieces'
  assert any('\n' in p for p in pieces), 'newlines are learned, not lost'


def test_sentencepiece_token_bytes_count_utf8(spm_path, texts):
  tok = tokenizers.SentencePieceTokenizer.from_file(spm_path)
  tb = tok.token_bytes()
  assert tb.dtype == np.int32 and tb.shape == (512,) and tb[0] == 0 and tb[1] == 1
  for t in _TRICKY + texts['validation'][:5]:
    _check_token_bytes(tok, t)


def test_sentencepiece_tokenizer_pickles(spm_path, texts):
  tok = tokenizers.SentencePieceTokenizer.from_file(spm_path)
  copy = pickle.loads(pickle.dumps(tok))
  text = texts['validation'][0]
  assert copy.encode(text) == tok.encode(text) and copy.vocab_size == tok.vocab_size


def test_vocab_size_for_needs_no_corpus(spm_path, tmp_path):
  nowhere = dict(corpus_dir=str(tmp_path / 'no_corpus'), data_dir=str(tmp_path / 'no_data'))
  assert tokenizers.vocab_size_for(_data_config(tokenizer='byte', **nowhere)) == 258
  assert tokenizers.vocab_size_for(
      _data_config(tokenizer='sentencepiece', spm_model=spm_path, **nowhere)) == 512
  assert not os.path.exists(tmp_path / 'no_data')


@pytest.mark.parametrize('kw, field', [
    (dict(tokenizer='wordpiece'), 'data.tokenizer'),
    (dict(tokenizer='sentencepiece', spm_model=''), 'data.spm_model'),
    (dict(tokenizer='sentencepiece', spm_model='/nonexistent/x.model'), 'data.spm_model'),
])
def test_tokenizer_config_errors(kw, field):
  with pytest.raises(ConfigError, match=field):
    tokenizers.get_tokenizer(_data_config(**kw))
  with pytest.raises(ConfigError, match=field):
    tokenizers.vocab_size_for(_data_config(**kw))


def test_train_tokenizer_script(tmp_path):
  """The script trains on the train split only and reports the round trip on validation."""
  out = tmp_path / 'cli.model'
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, MTP_JAX_DATA_DIR=str(tmp_path / 'tfds'))
  r = subprocess.run([sys.executable, os.path.join(repo, 'scripts', 'train_tokenizer.py'),
                      f'--output={out}', '--vocab_size=400', '--max_mb=1'],
                     capture_output=True, text=True, env=env, timeout=300, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'round-trip failures: 0' in r.stdout and 'vocab 400' in r.stdout
  assert tokenizers.SentencePieceTokenizer.from_file(str(out)).vocab_size == 400
  assert os.path.isdir(tmp_path / 'tfds' / 'python_stdlib'), 'MTP_JAX_DATA_DIR is honoured'


def test_sentencepiece_without_a_pad_piece_pads_with_eos(texts, tmp_path):
  """A Llama 2-style model (unk 0, bos 1, eos 2, no pad): loads, pad = eos, bos counts no bytes."""
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts['validation'][:30]), model_writer=model, model_type='bpe',
      vocab_size=600, hard_vocab_limit=False, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2,
      pad_id=-1, minloglevel=2, num_threads=1)
  path = tmp_path / 'llama2_style.model'
  path.write_bytes(model.getvalue())
  tok = tokenizers.get_tokenizer(_data_config(tokenizer='sentencepiece', spm_model=str(path)))
  assert (tok.pad_id, tok.eos_id) == (2, 2)
  tb = tok.token_bytes()
  assert (tb[0], tb[1], tb[2]) == (1, 0, 1)  # unk, bos, eos
  assert tok.decode(tok.encode('x = 1') + [tok.eos_id]) == 'x = 1'
