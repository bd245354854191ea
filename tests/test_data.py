"""Data layer: corpus split, TFDS dataset, user data sources, packed grain batches, resume,
config errors."""
import json
import os
import pickle
import subprocess
import sys
import textwrap

import grain
import numpy as np
import pytest

import helpers
from mtp_jax import config_lib
from mtp_jax.config_lib import ConfigError
from mtp_jax.data import corpus, pipeline, stdlib_dataset, tokenizers, user_data

EOS = tokenizers.EOS_ID


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope='session')
def stdlib_texts():
  """{split: {relpath: text}} read straight from disk."""
  return {s: dict(corpus.split_documents(s)) for s in corpus.SPLITS}


def _config(data_dir, **data):
  c = config_lib.base_config()
  c.data.data_dir = data_dir
  c.data.seq_len = 64
  c.data.batch_size = 4
  for k, v in data.items():
    c.data[k] = v
  return c


@pytest.fixture
def cfg(stdlib_data_dir):
  return _config(stdlib_data_dir)


# Unique documents of many lengths around seq_len = 16: short ones, exact fits,
# long ones that must be split across rows, tabs and non-ASCII.
_TINY_DOCS = {f'pkg/m{i:02d}.py': f'# {i}\n' + 'x = 1\t# ü\n' * (i % 9) + 'y' * (3 * i)
              for i in range(24)}
_TINY_DOCS.update({'a.py': 'a', 'b.py': 'bb\n', 'long.py': 'def f():\n    return "→"\n' * 20})


@pytest.fixture(scope='session')
def tiny(tmp_path_factory):
  """A small corpus dir (plus files the reader must skip) and its prepared data_dir."""
  root = tmp_path_factory.mktemp('tiny_corpus')
  for rel, text in _TINY_DOCS.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text, encoding='utf-8')
  (root / 'empty.py').write_bytes(b'')
  (root / 'nul.py').write_bytes(b'x = 1\x00\x01\n')
  (root / 'notes.txt').write_text('not python')
  (root / 'site-packages').mkdir()
  (root / 'site-packages' / 'third_party.py').write_text('import this\n')
  data_dir = str(tmp_path_factory.mktemp('tiny_tfds'))
  c = _config(data_dir, corpus_dir=str(root), validation_percent=25, seq_len=16, batch_size=2)
  pipeline.validate_data_config(c)  # prepares the dataset
  split = corpus.split_files(sorted(_TINY_DOCS), 25)
  assert split['train'] and split['validation'], 'tiny corpus needs both splits'
  return c, {s: {p: _TINY_DOCS[p] for p in ps} for s, ps in split.items()}


# ----------------------------------------------------------------------------- helpers

def _check_rows(batch, seq_len, rows):
  """Structure every packed row must have; returns the rows' segments as token lists."""
  assert set(batch) == {'tokens', 'segment_ids', 'positions'}
  for v in batch.values():
    assert v.dtype == np.int32 and v.shape == (rows, seq_len)
  segments = []
  for tok, seg, pos in zip(batch['tokens'], batch['segment_ids'], batch['positions']):
    real = seg > 0
    n = int(real.sum())
    assert real[:n].all() and not real[n:].any(), 'padding only at the end of a row'
    assert (tok[n:] == tokenizers.PAD_ID).all() and (pos[n:] == 0).all()
    assert seg[0] == 1 and pos[0] == 0
    step = np.diff(seg[:n])
    assert set(step.tolist()) <= {0, 1}, 'segment ids count up 1, 2, ...'
    starts = np.concatenate([[True], step == 1])
    expected_pos = np.zeros(n, np.int64)
    for i in range(1, n):
      expected_pos[i] = 0 if starts[i] else expected_pos[i - 1] + 1
    np.testing.assert_array_equal(pos[:n], expected_pos)
    bounds = np.flatnonzero(starts).tolist() + [n]
    for s, e in zip(bounds, bounds[1:]):
      piece = tok[s:e]
      if e < n:  # a segment followed by another one in the row ended its document
        assert piece[-1] == EOS
      assert (piece[:-1] != EOS).all(), 'eos only at a document end'
      segments.append(piece)
  return segments


def _byte_piece(ids):
  """Byte-tokenizer ids -> raw bytes, eos as b'\\0' (no document holds NUL)."""
  ids = np.asarray(ids)
  return bytes(np.where(ids == EOS, 0, ids - 2).astype(np.uint8))


def _first_epoch(config, process_index, process_count, num_batches, as_ids=False):
  """Documents (as text, or tuples of ids) of one process's stream, up to the first repeat."""
  it = pipeline.make_train_iter(config, process_index=process_index,
                                process_count=process_count)
  stream = []
  for _ in range(num_batches):
    batch = next(it)
    _check_rows(batch, config.data.seq_len, config.data.batch_size // process_count)
    stream.extend(batch['tokens'].ravel().tolist())
  docs, cur = [], []
  for t in stream:
    if t == EOS:
      docs.append(tuple(cur) if as_ids else tokenizers.ByteTokenizer().decode(cur))
      cur = []
    else:
      cur.append(t)
  epoch = []
  for d in docs:
    if d in epoch:
      return epoch
    epoch.append(d)
  raise AssertionError('stream shorter than one epoch; take more batches')


# ----------------------------------------------------------------------------- corpus

def test_split_is_stable_disjoint_and_about_validation_percent():
  paths = corpus.list_files(corpus.stdlib_root())
  assert paths == sorted(paths) and len(paths) > 500 and 'os.py' in paths
  assert not any('site-packages' in p for p in paths)
  split = corpus.split_files(paths, 5)
  assert split == corpus.split_files(corpus.list_files(corpus.stdlib_root()), 5)
  assert not set(split['train']) & set(split['validation'])
  assert len(split['train']) + len(split['validation']) == len(paths)
  assert 0.03 < len(split['validation']) / len(paths) < 0.07
  # sha1 of the path decides: these never move, on any machine or Python.
  for path, expected in [('os.py', 'train'), ('json/decoder.py', 'train'),
                         ('typing.py', 'train'), ('base64.py', 'validation'),
                         ('decimal.py', 'validation')]:
    assert corpus.split_of(path, 5) == expected
  assert corpus.split_of('os.py', 50) == 'validation'


def test_reader_skips_and_counts_bad_files(tiny):
  config, _ = tiny
  root = config.data.corpus_dir
  paths = corpus.list_files(root)
  assert 'site-packages/third_party.py' not in paths and 'notes.txt' not in paths
  assert {'empty.py', 'nul.py', 'a.py'} <= set(paths)
  with open(os.path.join(root, 'bad_utf8.py'), 'wb') as f:
    f.write(b'x = "\xff\xfe"\n')
  try:
    stats = corpus.ReadStats()
    docs = dict(corpus.iter_documents(root, corpus.list_files(root), stats))
  finally:
    os.remove(os.path.join(root, 'bad_utf8.py'))
  assert stats.empty == 1 and stats.binary == 1 and stats.replaced == 1
  assert docs['bad_utf8.py'] == 'x = "\ufffd\ufffd"\n'
  assert 'empty.py' not in docs and 'nul.py' not in docs
  assert stats.documents == len(_TINY_DOCS) + 1


def test_tfds_dataset_holds_the_corpus_split(cfg, stdlib_texts):
  for split in corpus.SPLITS:
    source = stdlib_dataset.data_source(cfg.data, split)
    got = {source[i]['path'].decode(): source[i]['text'] for i in range(len(source))}
    assert set(got) == set(stdlib_texts[split])
    for path in list(got)[:50]:
      assert got[path].decode('utf-8') == stdlib_texts[split][path]
  # A second call finds it prepared; the name encodes interpreter and split rule.
  name, seconds = stdlib_dataset.prepare_stdlib(data_dir=cfg.data.data_dir)
  assert seconds == 0.0 and corpus.interpreter_tag() in name and '-val5-' in name
  # Any prepared array_record dataset plugs in by its TFDS name.
  other = _config(cfg.data.data_dir, dataset=name)
  validation = stdlib_dataset.data_source(other.data, 'validation')
  assert len(validation) == len(stdlib_texts['validation'])


def test_concurrent_builds_build_once(tiny, tmp_path):
  """Two processes preparing the same dataset at the same moment: one builds, one waits."""
  config, _ = tiny
  ready = tmp_path / 'ready'
  ready.mkdir()
  script = textwrap.dedent(f"""
      import os, sys, time
      from mtp_jax.data import stdlib_dataset
      open(os.path.join({str(ready)!r}, sys.argv[1]), 'w').close()
      deadline = time.time() + 60
      while len(os.listdir({str(ready)!r})) < 2 and time.time() < deadline:
        time.sleep(0.001)  # both imports done: start the builds together
      _, seconds = stdlib_dataset.prepare_stdlib(
          data_dir={str(tmp_path / 'tfds')!r}, corpus_dir={config.data.corpus_dir!r},
          validation_percent=25)
      print('BUILT' if seconds > 0 else 'REUSED')
  """)
  env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  procs = [subprocess.Popen([sys.executable, '-c', script, str(i)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
  results = sorted(o[0].strip().splitlines()[-1] for o in outs)
  assert results == ['BUILT', 'REUSED'], outs
  other = _config(str(tmp_path / 'tfds'), corpus_dir=config.data.corpus_dir, validation_percent=25)
  assert len(stdlib_dataset.data_source(other.data, 'train')) > 0


# ----------------------------------------------------------------------------- batches

def test_packing_reconstructs_every_document_once_per_process(tiny):
  """Long documents are split across rows (not truncated), short ones kept, and the
  two process shards are disjoint and together cover the whole train split."""
  config, docs = tiny
  train = set(docs['train'].values())
  total = sum(len(t.encode()) + 1 for t in train)
  rows = config.data.batch_size // 2
  num_batches = total // (rows * config.data.seq_len) + 4
  epochs = [_first_epoch(config, i, 2, num_batches) for i in range(2)]
  assert not set(epochs[0]) & set(epochs[1])
  assert set(epochs[0]) | set(epochs[1]) == train
  assert sorted(len(e) for e in epochs) == sorted([len(train) // 2, len(train) - len(train) // 2])
  # A different shuffle seed gives a different document order.
  config = config.copy_and_resolve_references()
  config.data.shuffle_seed = 1
  assert _first_epoch(config, 0, 2, num_batches) != epochs[0]


def test_finite_stream_ends_with_padding():
  docs = [np.arange(2, 2 + n, dtype=np.int32) for n in (3, 11, 2)]
  ds = grain.MapDataset.source(docs).map(lambda x: {'tokens': np.append(x, EOS)})
  batches = list(pipeline.pack_and_batch(ds.to_iter_dataset(), seq_len=8, batch_size=1))
  flat = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
  assert len(batches) == 3  # 4 + 12 + 3 tokens -> rows of 8 + 8 + 3 (+5 padding)
  _check_rows(flat, 8, 3)
  np.testing.assert_array_equal(flat['segment_ids'], [[1, 1, 1, 1, 2, 2, 2, 2],
                                                      [1, 1, 1, 1, 1, 1, 1, 1],
                                                      [1, 1, 1, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(flat['positions'], [[0, 1, 2, 3, 0, 1, 2, 3],
                                                    [0, 1, 2, 3, 4, 5, 6, 7],
                                                    [0, 1, 2, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(flat['tokens'][2], [2, 3, EOS, 0, 0, 0, 0, 0])


def test_train_batches_are_pieces_of_train_documents(cfg, stdlib_texts):
  train = b'\0' + b'\0'.join(t.encode() for t in stdlib_texts['train'].values()) + b'\0'
  it = pipeline.make_train_iter(cfg)
  for _ in range(3):
    for piece in _check_rows(next(it), cfg.data.seq_len, cfg.data.batch_size):
      assert _byte_piece(piece) in train


def test_eval_batches_are_deterministic_validation_pieces(cfg, stdlib_texts):
  a = pipeline.make_eval_batches(cfg, num_batches=3)
  b = pipeline.make_eval_batches(cfg, num_batches=3)
  assert len(a) == 3
  for x, y in zip(a, b):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  val = b'\0' + b'\0'.join(t.encode() for t in stdlib_texts['validation'].values()) + b'\0'
  for batch in a:
    for piece in _check_rows(batch, cfg.data.seq_len, cfg.data.batch_size):
      assert _byte_piece(piece) in val
  halves = [pipeline.make_eval_batches(cfg, num_batches=1, process_index=i, process_count=2)[0]
            for i in range(2)]
  assert halves[0]['tokens'].shape == (2, cfg.data.seq_len)
  assert not np.array_equal(halves[0]['tokens'], halves[1]['tokens'])


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(xs, ys):
  assert len(xs) == len(ys)
  for x, y in zip(xs, ys):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


@pytest.fixture(params=['python_stdlib', 'files', 'jsonl', 'parquet', 'hf_disk', 'hf_dict',
                        'tokens'])
def any_source(request, stdlib_data_dir, user_sources):
  """A config of each data source: the stdlib corpus (seq_len 64) or a user source (16)."""
  if request.param == 'python_stdlib':
    return _config(stdlib_data_dir)
  return user_sources[request.param][0]


def test_iterator_state_resumes_exactly(any_source, tmp_path):
  cfg = any_source
  it = pipeline.make_train_iter(cfg)
  _take(it, 7)
  state = it.get_state()
  want = _take(it, 5)
  fresh = pipeline.make_train_iter(cfg)
  fresh.set_state(state)
  _assert_same(_take(fresh, 5), want)
  assert not np.array_equal(want[0]['tokens'], next(pipeline.make_train_iter(cfg))['tokens'])

  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  mgr = ocp.CheckpointManager(str(tmp_path / 'ckpt'))
  mgr.save(12, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
  mgr.wait_until_finished()
  want = _take(it, 3)
  restored = pipeline.make_train_iter(cfg)
  mgr.restore(12, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
  _assert_same(_take(restored, 3), want)
  mgr.close()


@pytest.mark.slow
def test_multiprocess_workers_resume_exactly(cfg):
  cfg.data.worker_count = 2
  it = pipeline.make_train_iter(cfg)
  _take(it, 3)
  state = it.get_state()
  want = _take(it, 3)
  it.close()
  fresh = pipeline.make_train_iter(cfg)
  fresh.set_state(state)
  _assert_same(_take(fresh, 3), want)
  fresh.close()


# ----------------------------------------------------------------------------- user data

def _ids(text):
  return tuple(tokenizers.ByteTokenizer().encode(text))


# Token-id documents as self_distill writes them: sampled bytes need not be valid UTF-8
# (0xff -> id 257), so no text could carry them exactly.
_TOKEN_DOCS = [tuple(int(t) for t in np.random.default_rng(i).integers(2, 258, 5 + 3 * i))
               for i in range(20)]


@pytest.fixture(scope='session')
def user_sources(tmp_path_factory):
  """{kind: (config, {'all' or split: [documents as id tuples]})} of each user data source.

  The same unique documents (_TINY_DOCS) as a folder of .md / .txt files, two .jsonl files,
  two parquet files, a saved datasets Dataset and a DatasetDict with named splits; plus
  a .jsonl of token ids. Each holds things the reader must skip or tell apart.
  """
  import datasets  # pylint: disable=g-import-not-at-top  (optional: the test extra)
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp('user_data')
  texts = list(_TINY_DOCS.values())
  out = {}

  def config(kind, source, path, **data):
    c = _config('', source=source, path=str(path), validation_percent=25, seq_len=16,
                batch_size=2, **data)
    config_lib.validate(c)
    pipeline.validate_data_config(c)
    return c

  files = root / 'folder'
  for i, text in enumerate(texts):  # nested, two extensions
    (files / f'd{i % 3}').mkdir(parents=True, exist_ok=True)
    (files / f'd{i % 3}' / f'n{i:02d}{".md" if i % 2 else ".txt"}').write_text(text)
  (files / 'code.py').write_text('not read: .py is not among the extensions\n')
  (files / '.git').mkdir()
  (files / '.git' / 'HEAD.md').write_text('hidden directory, skipped\n')
  (files / 'empty.md').write_bytes(b'')
  (files / 'blob.txt').write_bytes(b'\x00\x01binary')
  out['files'] = (config('files', 'files', files, extensions=('.md', '.txt')),
                  {'all': [_ids(t) for t in texts]})

  jsonl = root / 'jsonl'
  (jsonl / 'part').mkdir(parents=True)
  with open(jsonl / 'a.jsonl', 'w') as f:
    for t in texts[:10]:
      f.write(json.dumps({'text': t, 'meta': {'n': len(t)}}) + '\n')
    f.write('\n   \n')  # blank lines are not records
  with open(jsonl / 'part' / 'b.jsonl', 'w') as f:
    f.write('\r\n'.join(json.dumps({'text': t}) for t in texts[10:]))  # no final newline
  (jsonl / 'notes.txt').write_text('not a .jsonl file')
  out['jsonl'] = (config('jsonl', 'jsonl', jsonl), {'all': [_ids(t) for t in texts]})

  pq_dir = root / 'parquet'
  pq_dir.mkdir()
  pq.write_table(pa.table({'content': texts[:15], 'n': list(range(15))}), pq_dir / 'a.parquet',
                 row_group_size=4)
  pq.write_table(pa.table({'content': texts[15:]}), pq_dir / 'b.parquet')
  out['parquet'] = (config('parquet', 'parquet', pq_dir, text_key='content'),
                    {'all': [_ids(t) for t in texts]})

  datasets.disable_progress_bars()
  ds = datasets.Dataset.from_dict({'text': texts, 'id': list(range(len(texts)))})
  ds.save_to_disk(str(root / 'hf'))
  out['hf_disk'] = (config('hf_disk', 'hf_disk', root / 'hf'), {'all': [_ids(t) for t in texts]})
  dd = datasets.DatasetDict({'train': datasets.Dataset.from_dict({'body': texts[:20]}),
                             'test': datasets.Dataset.from_dict({'body': texts[20:]})})
  dd.save_to_disk(str(root / 'hf_dict'))
  out['hf_dict'] = (config('hf_dict', 'hf_disk', root / 'hf_dict', text_key='body',
                           eval_split='test'),
                    {'train': [_ids(t) for t in texts[:20]],
                     'test': [_ids(t) for t in texts[20:]]})

  with open(root / 'tokens.jsonl', 'w') as f:
    for ids in _TOKEN_DOCS:
      f.write(json.dumps({'tokens': list(ids), 'prompt_len': 2}) + '\n')
  out['tokens'] = (config('tokens', 'jsonl', root / 'tokens.jsonl', tokens_key='tokens'),
                   {'all': list(_TOKEN_DOCS)})
  return out


USER_KINDS = ['files', 'jsonl', 'parquet', 'hf_disk', 'hf_dict', 'tokens']


def _split_ids(config, split):
  """Every non-empty document of a split, read straight from the source, as id tuples
  (empty and binary files read as empty documents, which the pipeline skips)."""
  d = config.data
  source = stdlib_dataset.data_source(d, split)
  tok = tokenizers.get_tokenizer(d)
  docs = [tuple(pipeline.document_ids(tok, d, source[i]).tolist()) for i in range(len(source))]
  return [doc for doc in docs if doc]


@pytest.mark.parametrize('kind', USER_KINDS)
def test_user_source_splits_every_document_once(user_sources, kind):
  config, docs = user_sources[kind]
  d = config.data
  train, val = _split_ids(config, d.train_split), _split_ids(config, d.eval_split)
  assert train and val, 'the tiny sets must give both splits documents'
  if 'all' in docs:  # split by hash: disjoint, complete, the same on a second read
    assert sorted(train + val) == sorted(docs['all']) and not set(train) & set(val)
    assert _split_ids(config, d.train_split) == train
  else:  # a DatasetDict's own splits, in its order
    assert train == docs['train'] and val == docs['test']
  if kind == 'files':  # the path hash of python_stdlib decides, read only .md / .txt
    rels = corpus.list_files(d.path, ('.md', '.txt'), skip_hidden=True, field='data.path')
    assert '.git/HEAD.md' not in rels and 'code.py' not in rels and 'blob.txt' in rels
    want = corpus.split_files(rels, d.validation_percent)['validation']
    source = stdlib_dataset.data_source(d, 'validation')
    assert [source[i]['path'] for i in range(len(source))] == want
  if kind == 'tokens':  # invalid UTF-8 and all: the ids as stored
    assert any(257 in ids for ids in train + val)


@pytest.mark.parametrize('kind', USER_KINDS)
def test_user_source_packs_each_document_once_per_process(user_sources, kind):
  """The stdlib corpus's packing check: two process shards, disjoint, covering the split."""
  config, _ = user_sources[kind]
  train = set(_split_ids(config, config.data.train_split))
  total = sum(len(t) + 1 for t in train)
  num_batches = total // (config.data.batch_size // 2 * config.data.seq_len) + 4
  epochs = [_first_epoch(config, i, 2, num_batches, as_ids=True) for i in range(2)]
  assert not set(epochs[0]) & set(epochs[1])
  assert set(epochs[0]) | set(epochs[1]) == train
  eval_batch = pipeline.make_eval_batches(config, num_batches=1)[0]
  _check_rows(eval_batch, config.data.seq_len, config.data.batch_size)


@pytest.mark.parametrize('kind', USER_KINDS)
def test_user_sources_pickle_for_grain_workers(user_sources, kind):
  """data.worker_count > 0 sends the source to worker processes: it must pickle, open
  files afresh there (no descriptor or loaded column travels) and read the same records."""
  config, _ = user_sources[kind]
  source = stdlib_dataset.data_source(config.data, config.data.train_split)
  source[len(source) - 1]  # pylint: disable=pointless-statement  (opens a file / a column)
  copy = pickle.loads(pickle.dumps(source))
  assert len(copy) == len(source)
  for i in (0, len(source) - 1):
    a, b = source[i], copy[i]
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_a_bad_record_later_in_a_file_is_found_before_the_run_starts(user_sources, tmp_path):
  """Every line is checked up front (not only the first), naming the file and the line as
  an editor counts it (blank lines included), and a chunk boundary inside a line is fine."""
  config, _ = user_sources['jsonl']
  config = config.copy_and_resolve_references()
  lines = [json.dumps({'text': f'document number {i}'}) for i in range(40)]
  lines[5] = ''  # blank lines are skipped but still counted
  lines[31] = json.dumps({'body': 'wrong field'})
  path = tmp_path / 'x.jsonl'
  path.write_text('\n'.join(lines))
  config.data.path = str(path)
  config.data.validation_percent = 1
  with pytest.raises(ConfigError) as e:
    pipeline.validate_data_config(config)
  assert str(e.value) == (f"data.text_key 'text' is not a field of data.path: {path} line 32 "
                          "(fields: ['body'])")
  lines[31] = '{"text": "unterminated'
  path.write_text('\n'.join(lines) + '\n')
  with pytest.raises(ConfigError, match=f'{path} line 32 is not valid JSON'):
    pipeline.validate_data_config(config)
  lines[31] = json.dumps({'text': 'fixed'})
  path.write_text('\n'.join(lines))  # no final newline
  user_data._SPANS_CACHE.clear()  # pylint: disable=protected-access
  chunk = user_data._INDEX_CHUNK  # pylint: disable=protected-access
  try:
    user_data._INDEX_CHUNK = 7  # pylint: disable=protected-access  (lines span chunks)
    source = stdlib_dataset.data_source(config.data, 'train')
  finally:
    user_data._INDEX_CHUNK = chunk  # pylint: disable=protected-access
  got = sorted(source[i]['text'] for i in range(len(source)))
  want = sorted(json.loads(t)['text'] for t in lines if t)
  assert set(got) <= set(want) and len(got) >= len(want) - 2  # 1 % held out


def _user_error_cases(root):
  """(name, data fields, words in the one-line error) of user-data mistakes."""
  import datasets  # pylint: disable=g-import-not-at-top  (optional: the test extra)
  (root / 'notes').mkdir()
  (root / 'notes' / 'a.txt').write_text('text')
  (root / 'bad.jsonl').write_text('{"text": "ok"\n')
  (root / 'int.jsonl').write_text('{"text": 3}\n')
  (root / 'good.jsonl').write_text('{"text": "fine"}\n')
  (root / 'ids.jsonl').write_text('{"tokens": [5, 300000]}\n')
  (root / 'fake.parquet').write_text('not parquet')
  (root / 'empty').mkdir()
  (root / 'empty' / 'a.txt').write_text('')
  (root / 'binary').mkdir()
  (root / 'binary' / 'b.txt').write_bytes(b'\x00\x01text')
  datasets.Dataset.from_dict({'content': ['a b c d e f']}).save_to_disk(str(root / 'hf'))
  datasets.DatasetDict({'train': datasets.Dataset.from_dict({'text': ['x' * 20]})}).save_to_disk(
      str(root / 'hfd'))
  r = str(root)
  return [
      ('unknown source', dict(source='csv', path=r), ['data.source', "'csv'"]),
      ('source without path', dict(source='jsonl'), ['data.source', 'data.path', 'empty']),
      ('path with tfds', dict(path=r), ['data.path', 'data.source']),
      ('extension without dot', dict(source='files', path=r, extensions=('md',)),
       ['data.extensions', "('md',)"]),
      ('no extensions', dict(source='files', path=r, extensions=()), ['data.extensions']),
      ('missing folder', dict(source='files', path=f'{r}/nope'),
       ['data.path', f'{r}/nope', 'not a readable directory']),
      ('no matching files', dict(source='files', path=f'{r}/notes', extensions=('.md', '.rst')),
       ['data.path', 'contains no .md or .rst files']),
      ('only an empty file', dict(source='files', path=f'{r}/empty', extensions=('.txt',)),
       ['data.path', 'no readable document', '1 empty']),
      ('only a binary file', dict(source='files', path=f'{r}/binary', extensions=('.txt',)),
       ['data.path', 'no readable document', '1 binary']),
      ('tokens_key with files', dict(source='files', path=r, tokens_key='ids'),
       ['data.tokens_key', 'plain text files']),
      ('missing jsonl', dict(source='jsonl', path=f'{r}/none.jsonl'),
       ['data.path', 'neither a .jsonl file nor a directory']),
      ('no jsonl in folder', dict(source='jsonl', path=f'{r}/notes'),
       ['data.path', 'contains no .jsonl files']),
      ('invalid json', dict(source='jsonl', path=f'{r}/bad.jsonl'),
       ['data.path', 'bad.jsonl line 1', 'not valid JSON']),
      ('text not a string', dict(source='jsonl', path=f'{r}/int.jsonl'),
       ["data.text_key 'text'", 'int.jsonl line 1', 'must hold text']),
      ('missing jsonl field', dict(source='jsonl', path=f'{r}/int.jsonl', text_key='body'),
       ["data.text_key 'body' is not a field", 'int.jsonl line 1', "['text']"]),
      ('ids outside the vocabulary', dict(source='jsonl', path=f'{r}/ids.jsonl',
                                          tokens_key='tokens'),
       ["data.tokens_key 'tokens'", '300000', "model's 320-token vocabulary"]),
      ('hash split name', dict(source='jsonl', path=f'{r}/good.jsonl', eval_split='test'),
       ["data.eval_split 'test'", 'split by hash', "('train', 'validation')"]),
      ('not parquet', dict(source='parquet', path=f'{r}/fake.parquet'),
       ['data.path', 'fake.parquet is not a readable parquet file']),
      ('not a saved dataset', dict(source='hf_disk', path=f'{r}/notes'),
       ['data.path', 'is not a saved datasets dataset']),
      ('hf column', dict(source='hf_disk', path=f'{r}/hf'),
       ["data.text_key 'text' is not a column", "['content']"]),
      ('hf split', dict(source='hf_disk', path=f'{r}/hfd'),
       ["has no split 'validation' (data.eval_split)", "['train']"]),
  ]


def test_user_data_errors_name_the_field(tmp_path):
  for name, fields, words in _user_error_cases(tmp_path):
    c = _config('', **fields)
    with pytest.raises(ConfigError) as e:
      config_lib.validate(c)
      pipeline.validate_data_config(c)
    line = str(e.value)
    assert '\n' not in line, name
    for w in words:
      assert w in line, (name, w, line)


# ----------------------------------------------------------------------------- config errors

@pytest.mark.parametrize('field, value, words', [
    ('tokenizer', 'wordpiece', ['data.tokenizer', 'wordpiece']),
    ('dataset', 'no_such_dataset_xyz', ['data.dataset', 'no_such_dataset_xyz', 'data.data_dir']),
    ('dataset', 'mnist', ['data.dataset', 'not prepared', 'array_record']),
    ('train_split', 'test', ['data.train_split', "'test'"]),
    ('text_key', 'content', ['data.text_key', "'content'"]),
    ('batch_size', 0, ['data.batch_size']),
])
def test_config_errors_name_the_field(cfg, field, value, words):
  cfg.data[field] = value
  with pytest.raises(ConfigError) as e:
    pipeline.validate_data_config(cfg)
  for w in words:
    assert w in str(e.value)
  if field == 'dataset':
    assert cfg.data.data_dir in str(e.value)


def test_missing_spm_model_is_a_config_error(cfg, tmp_path):
  cfg.data.tokenizer = 'sentencepiece'
  for path in ('', str(tmp_path / 'missing.model')):
    cfg.data.spm_model = path
    with pytest.raises(ConfigError, match='data.spm_model'):
      pipeline.validate_data_config(cfg)
  (tmp_path / 'junk.model').write_bytes(b'not a model')
  cfg.data.spm_model = str(tmp_path / 'junk.model')
  with pytest.raises(ConfigError, match='data.spm_model'):
    pipeline.validate_data_config(cfg)


def test_empty_or_missing_corpus_dir_is_a_config_error(cfg, tmp_path):
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'empty' / 'README').write_text('no python here')
  for d in (tmp_path / 'empty', tmp_path / 'missing'):
    cfg.data.corpus_dir = str(d)
    with pytest.raises(ConfigError, match='data.corpus_dir') as e:
      pipeline.validate_data_config(cfg)
    assert str(d) in str(e.value)


def test_batch_must_split_over_processes(cfg):
  with pytest.raises(ConfigError, match='data.batch_size'):
    pipeline.validate_data_config(cfg, process_count=3)
  assert pipeline.per_process_batch_size(cfg, 2) == 2


def test_user_data_errors_stop_a_run_before_compiling(devices, tmp_path, monkeypatch):
  """As in test_train_bad_input.py: exit code 2, one line, steps.setup never reached."""
  from mtp_jax import cli  # pylint: disable=g-import-not-at-top  (JAX-heavy)
  from mtp_jax.train import steps as steps_lib  # pylint: disable=g-import-not-at-top
  from mtp_jax.train import train_and_evaluate

  def tripwire(*a, **k):
    raise AssertionError('reached compilation: the input error was not caught before it')
  monkeypatch.setattr(steps_lib, 'setup', tripwire)
  (tmp_path / 'd.jsonl').write_text('{"body": "x"}\n' * 8)
  c = helpers.load_config('tiny')
  c.train.progress = False
  cases = [(dict(source='jsonl', path=str(tmp_path / 'd.jsonl')),
            ["data.text_key 'text' is not a field", 'd.jsonl line 1']),
           (dict(source='files', path=str(tmp_path), extensions=('txt',)), ['data.extensions'])]
  for fields, words in cases:
    cfg = c.copy_and_resolve_references()
    for k, v in fields.items():
      cfg.data[k] = v
    with pytest.raises(Exception) as e:
      train_and_evaluate(cfg, str(tmp_path / 'run'), devices=devices[:1])
    assert cli.exit_code_of(e.value) == 2, repr(e.value)
    line = cli.one_line(e.value)
    assert '\n' not in line and all(w in line for w in words), line
    assert not os.path.exists(tmp_path / 'run'), 'a failed start leaves no workdir'
