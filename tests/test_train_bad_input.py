"""Training's bad input (train_and_evaluate and scripts/train.py): every case fails before
anything compiles, with one line, exit 2.

In-process cases call train_and_evaluate with steps.setup (the first compile)
replaced by a tripwire; the CLI cases run scripts/train.py and check the exit code and
the single `error: ...` line. Inputs that are not errors (undecodable bytes, binary
files, one enormous line) are handled, and tested as such at the end.
"""
import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from helpers import REPO, load_config
from mtp_jax import cli
from mtp_jax.data import checks as data_checks
from mtp_jax.data import corpus, pipeline, stdlib_dataset
from mtp_jax.train import steps as steps_lib
from mtp_jax.train import train_and_evaluate


def tiny(data_dir):
  c = load_config('tiny')
  c.data.data_dir = data_dir
  c.train.progress = False
  return c


@pytest.fixture
def no_compile(monkeypatch):
  def tripwire(*a, **k):
    raise AssertionError('reached compilation: the input error was not caught before it')
  monkeypatch.setattr(steps_lib, 'setup', tripwire)


def expect_error(config, workdir, devices, *words, **kw):
  """The run fails with an exit-2 error whose single line contains `words`."""
  with pytest.raises(Exception) as e:
    train_and_evaluate(config, str(workdir), devices=devices[:1], **kw)
  assert cli.exit_code_of(e.value) == 2, repr(e.value)
  line = cli.one_line(e.value)
  assert '\n' not in line and len(line) < 800
  for w in words:
    assert w in line, (w, line)
  return line


def _with_depth_as_string(c):
  fields = c.model.mtp.to_dict()
  fields['depth'] = '2'
  c.model.mtp = ml_collections.ConfigDict(fields)


# (name, mutate(config), words in the message)
CONFIG_CASES = [
    ('unknown key in a config file', lambda c: setattr(c.train, 'checkpoint_evry', 3),
     ['unknown config field train.checkpoint_evry', 'did you mean train.checkpoint_every']),
    ('wrong type', _with_depth_as_string, ['model.mtp.depth must be an integer', "'2'"]),
    ('impossible mesh', lambda c: setattr(c.mesh, 'shape', (2, 1, 1)),
     ['mesh data 2 has 2 devices but 1 are available']),
    ('depth >= sequence length', lambda c: setattr(c.model.mtp, 'depth', 63),
     ['model.mtp.depth (63) must be smaller than data.seq_len - 1']),
    ('batch not divisible', lambda c: setattr(c.train, 'grad_accum', 3),
     ['data.batch_size (8) must be divisible', 'train.grad_accum (3)']),
    ('lambda < 0', lambda c: setattr(c.model.mtp, 'lambda_values', (-0.3,)),
     ['model.mtp.lambda_values must be >= 0']),
    ('negative lr', lambda c: setattr(c.train, 'lr', -1e-3), ['train.lr must be > 0']),
    ('heads not a multiple of kv heads', lambda c: setattr(c.model, 'n_kv_heads', 3),
     ['model.n_heads (4) must be a multiple of model.n_kv_heads (3)']),
    ('unknown non-finite policy', lambda c: setattr(c.train, 'nonfinite', 'ignore'),
     ["train.nonfinite must be 'halt' or 'skip'"]),
    ('unknown dataset', lambda c: setattr(c.data, 'dataset', 'no_such_dataset_xyz'),
     ["data.dataset 'no_such_dataset_xyz'", 'no such TFDS dataset']),
]


@pytest.mark.parametrize('name, mutate, words', CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_config_errors(name, mutate, words, devices, stdlib_data_dir, tmp_path, no_compile):
  del name
  c = tiny(stdlib_data_dir)
  mutate(c)
  expect_error(c, tmp_path / 'run', devices, *words)


def _corpus(root, files: dict):
  for rel, content in files.items():
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
  return str(root)


DATA_CASES = [
    ('missing corpus dir', None, ['data.corpus_dir', 'is not a readable directory']),
    ('empty corpus', {'README': 'no python here'}, ['data.corpus_dir', 'contains no .py files']),
    ('only binary and empty files',
     {f'm{i}.py': (b'\x00\x01\x02' if i % 2 else b'') for i in range(12)},
     ['data.corpus_dir', 'no readable document', 'binary']),
    ('documents shorter than D + 2 tokens', {f'm{i}.py': 'x' for i in range(12)},
     ['shorter than model.mtp.depth + 2 = 4 tokens', 'longest 2']),
]


@pytest.mark.parametrize('name, files, words', DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_data_errors(name, files, words, devices, tmp_path, no_compile):
  del name
  c = tiny(str(tmp_path / 'tfds'))
  c.data.validation_percent = 50  # both splits get files from a dozen
  c.data.corpus_dir = (str(tmp_path / 'missing') if files is None
                       else _corpus(tmp_path / 'corpus', files))
  expect_error(c, tmp_path / 'run', devices, *words)


def test_workdir_errors(devices, stdlib_data_dir, tmp_path, no_compile):
  c = tiny(stdlib_data_dir)
  (tmp_path / 'a_file').write_text('x')
  expect_error(c, tmp_path / 'a_file', devices, 'exists and is not a directory')
  expect_error(c, tmp_path / 'a_file' / 'run', devices, 'is not a usable directory')
  (tmp_path / 'run').mkdir()
  os.symlink(tmp_path / 'nowhere', tmp_path / 'run' / 'checkpoints')
  expect_error(c, tmp_path / 'run', devices, 'checkpoints', 'is not a directory (a broken link')
  expect_error(c, tmp_path / 'fresh', devices, 'is not a directory', 'init_from',
               init_from=str(tmp_path / 'a_file'))
  (tmp_path / 'empty').mkdir()
  expect_error(c, tmp_path / 'fresh', devices, 'holds no checkpoint',
               init_from=str(tmp_path / 'empty'))


def _mount_tmpfs(path, options):
  path.mkdir()
  proc = subprocess.run(['mount', '-t', 'tmpfs', '-o', options, 'tmpfs', str(path)],
                        capture_output=True, text=True)
  return proc.returncode == 0


def test_unwritable_workdir(devices, stdlib_data_dir, tmp_path, no_compile):
  """Read-only filesystem (root: a read-only tmpfs; others: chmod 500, which root ignores)."""
  mnt = tmp_path / 'ro'
  if os.geteuid() == 0:
    if not _mount_tmpfs(mnt, 'ro,size=1m'):
      pytest.skip('root without permission to mount a tmpfs')
  else:
    mnt.mkdir()
    mnt.chmod(0o500)
  try:
    expect_error(tiny(stdlib_data_dir), mnt, devices, 'is not a usable directory',
                 'Read-only file system' if os.geteuid() == 0 else 'Permission denied')
  finally:
    if os.geteuid() == 0:
      subprocess.run(['umount', '-l', str(mnt)], check=False)
    else:
      mnt.chmod(0o700)


def test_disk_too_small_for_a_checkpoint(devices, stdlib_data_dir, tmp_path, no_compile):
  mnt = tmp_path / 'small'
  if not _mount_tmpfs(mnt, 'size=2m'):
    pytest.skip('cannot mount a tmpfs here (needs root)')
  try:
    expect_error(tiny(stdlib_data_dir), mnt / 'run', devices, 'disk full:', 'MiB free',
                 'one checkpoint needs about')
  finally:
    subprocess.run(['umount', '-l', str(mnt)], check=False)


# ----------------------------------------------------------------------------- the CLI

def _cli(*args, cwd=REPO):
  return subprocess.run([sys.executable, os.path.join(REPO, 'scripts', 'train.py'), *args],
                        capture_output=True, text=True, env=dict(os.environ, XLA_FLAGS=''),
                        timeout=300, cwd=cwd)


CLI_CASES = [
    ('missing --config', [], ['the following arguments are required: --config']),
    ('config file not found', ['--config=configs/no_such.py'],
     ['cannot load --config', 'No such file or directory']),
    ('unknown config argument', ['--config=configs/ablation.py:d9'],
     ['configs/ablation.py', "unknown argument 'd9'"]),
    ('unknown override key', ['--config=configs/tiny.py', '--config.model.mtp.dept=2'],
     ['unknown config field', 'model.mtp.dept', 'did you mean "depth"']),
    ('wrong override type', ['--config=configs/tiny.py', '--config.model.mtp.depth=two'],
     ['--config.model.mtp.depth=two', "model.mtp.depth takes an integer"]),
    ('unknown flag', ['--config=configs/tiny.py', '--chekpoint=3'],
     ['unrecognized arguments: --chekpoint=3']),
    ('stray argument', ['--config=configs/tiny.py', 'extra'], ['unrecognized arguments: extra']),
]


@pytest.mark.parametrize('name, args, words', CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_errors(name, args, words, tmp_path):
  del name
  proc = _cli(*args, f'--workdir={tmp_path / "run"}')
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), proc.stderr[-2000:]
  for w in words:
    assert w in lines[0], (w, lines[0])
  assert not (tmp_path / 'run').exists()


def test_cli_config_file_errors(tmp_path):
  bad = tmp_path / 'bad.py'
  bad.write_text('def get_config(:\n')
  proc = _cli(f'--config={bad}')
  assert proc.returncode == 2 and proc.stderr.startswith('error: bad --config file')
  assert 'SyntaxError' in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_cli_library_errors_exit_2(stdlib_data_dir, tmp_path):
  """Errors found by the library (here: workdir, data) reach the shell the same way."""
  (tmp_path / 'a_file').write_text('x')
  proc = _cli('--config=configs/tiny.py', f'--workdir={tmp_path / "a_file"}',
              f'--config.data.data_dir={stdlib_data_dir}')
  assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
      f"error: --workdir '{tmp_path / 'a_file'}' exists and is not a directory"]
  proc = _cli('--config=configs/tiny.py', f'--workdir={tmp_path / "run"}',
              f'--config.data.data_dir={tmp_path / "tfds"}',
              f'--config.data.corpus_dir={tmp_path / "missing"}')
  assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
      'error: data.corpus_dir')


# ----------------------------------------------------------------------------- handled, not errors

def test_undecodable_binary_and_enormous_inputs_are_handled(tmp_path):
  """Non-UTF-8 bytes are replaced, binary files skipped, and a 2 MB single-line file is
  packed across rows whole: none of them is an error."""
  big = 'x = [' + ', '.join(str(i % 1000) for i in range(400_000)) + ']'  # ~2 MB, one line
  name = next(f'big{i}.py' for i in range(100) if corpus.split_of(f'big{i}.py', 50) == 'train')
  files = {name: big, 'latin1.py': b'# caf\xe9\nx = 1\n', 'blob.py': b'\x00\xff' * 50,
           **{f'ok{i}.py': f'def f{i}():\n    return {i}\n' for i in range(8)}}
  c = tiny(str(tmp_path / 'tfds'))
  c.data.validation_percent = 50
  c.data.corpus_dir = _corpus(tmp_path / 'corpus', files)
  pipeline.validate_data_config(c)
  data_checks.check_document_lengths(c)
  docs = {}
  for split in ('train', 'validation'):
    src = stdlib_dataset.data_source(c.data, split)
    docs.update({src[i]['path'].decode(): src[i]['text'].decode() for i in range(len(src))})
  assert docs[name] == big
  assert docs['latin1.py'] == '# caf\ufffd\nx = 1\n' and 'blob.py' not in docs
  it = pipeline.make_train_iter(c)
  stream = np.concatenate([next(it)['tokens'].ravel() for _ in range(600)])
  assert np.frombuffer(big.encode(), np.uint8)[:30000].astype(np.int32).tobytes() in (
      (stream - 2).astype(np.int32).tobytes())  # a 30 kB run of the line, unbroken


def _train_cli(*args, cwd=REPO):
  return subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'train.py'), '--config',
       os.path.join(REPO, 'configs', 'tiny.py'), *args],
      capture_output=True, text=True, timeout=600, cwd=cwd,
      env=dict(os.environ, XLA_FLAGS='', JAX_LOG_COMPILES='1'))


def test_print_config_shows_the_plan_and_a_cpu_mesh_error_names_cpu_devices(tmp_path):
  """--print_config: the resolved config (JSON) and the device / mesh plan, exit 0, nothing
  compiled or written. A mesh this CPU process cannot hold names --cpu_devices, and
  that flag makes it fit."""
  workdir = tmp_path / 'run'
  proc = _train_cli('--workdir', str(workdir), '--print_config', '--config.train.steps=7')
  assert proc.returncode == 0, proc.stderr[-2000:]
  text, plan = proc.stdout.split('\nworkdir: ')
  config = json.loads(text)
  assert config['train']['steps'] == 7 and config['model']['vocab_size'] > 0  # resolved
  assert 'mesh: data 2 x stage 1 x fsdp 1 x context 1 x tensor 1' in plan, plan
  assert 'devices: 2 cpu' in plan, plan
  assert 'batch: 8 sequences of 64 tokens a step, 4 per data x fsdp shard' in plan
  assert 'Compiling' not in proc.stderr and not workdir.exists()  # JAX_LOG_COMPILES names each
  proc = _train_cli('--workdir', str(workdir), '--config.mesh.shape=(3,1,1)')
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
  assert lines[0].startswith('error: mesh data 3 has 3 devices') and '--cpu_devices=3' in lines[0]
  assert not workdir.exists()
  proc = _train_cli('--workdir', str(workdir), '--config.mesh.axes.data=3', '--cpu_devices=3',
                    '--config.data.batch_size=6', '--print_config')
  assert proc.returncode == 0 and 'mesh: data 3 x stage 1 x fsdp 1 x context 1' in proc.stdout, (
      proc.stderr)
