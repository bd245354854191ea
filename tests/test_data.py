"""Data layer: corpus split, TFDS dataset, packed grain batches, resume, config errors."""
import os
import subprocess
import sys
import textwrap

import grain
import numpy as np
import pytest

from mtp_jax import config_lib
from mtp_jax.config_lib import ConfigError
from mtp_jax.data import corpus, pipeline, stdlib_dataset, tokenizers

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


def _first_epoch(config, process_index, process_count, num_batches):
  """Documents (as text) of one process's stream, up to the first repeat."""
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
      docs.append(tokenizers.ByteTokenizer().decode(cur))
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
  assert len(stdlib_dataset.data_source(other.data, 'validation')) == len(stdlib_texts['validation'])


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


def test_iterator_state_resumes_exactly(cfg, tmp_path):
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
