"""A workdir's record stays true: resuming on another data stream, tokenizer, sequence length
or model is refused with one line naming the fields (config.json and the checkpoints left
as they were); what may change on resume does; `--new_data` continues on other data."""
import json
import os
import shlex
import subprocess
import sys

import pytest

from helpers import REPO, load_config
from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import cli
from mtp_jax.errors import ConfigError
from mtp_jax.train import train_and_evaluate


def files_config(path, steps=2):
  c = load_config('tiny')
  c.data.source, c.data.path, c.data.extensions = 'files', str(path), ('.txt',)
  c.data.validation_percent = 30
  c.train.steps, c.train.progress = steps, False
  c.train.log_every, c.train.eval_every, c.train.checkpoint_every = 1, 0, 0
  c.train.eval_batches = 1
  return c


def _write_corpus(path, seed):
  path.mkdir()
  for i in range(12):
    path.joinpath(f'doc{i}.txt').write_text(f'corpus {seed} document {i}: ' + 'words ' * 60)
  return path


@pytest.fixture(scope='module')
def trained(devices, tmp_path_factory):
  """A 2-step configs/tiny.py run on a folder of text files: (workdir, corpus a, corpus b)."""
  root = tmp_path_factory.mktemp('record')
  a, b = _write_corpus(root / 'a', 0), _write_corpus(root / 'b', 1)
  workdir = root / 'run'
  train_and_evaluate(files_config(a), str(workdir), devices=devices[:1])
  return workdir, a, b


def _record(workdir):
  return ((workdir / 'config.json').read_text(), sorted(os.listdir(workdir / 'checkpoints')))


# One per refused field: (field, value). Each names the field in one line.
REFUSED = [
    ('data.source', 'jsonl'), ('data.path', 'other/'), ('data.extensions', ('.md',)),
    ('data.text_key', 'content'), ('data.tokens_key', 'ids'), ('data.dataset', 'other'),
    ('data.corpus_dir', '/src'), ('data.train_split', 'other'), ('data.eval_split', 'test'),
    ('data.validation_percent', 10), ('data.shuffle_seed', 1), ('data.tokenizer', 'hf'),
    ('data.spm_model', 'spm.model'), ('data.hf_tokenizer', 'tok/'), ('data.seq_len', 128),
    ('model.d_model', 128), ('model.n_layers', 3), ('model.mtp.depth', 1),
    ('train.grad_clip', 0.0),  # clipping switched off: another optimizer state
]
DATA = set(ckpt_lib.DATA_FIELDS)  # the data stream: --new_data accepts a change


def _set(d, dotted, value):
  *parents, last = dotted.split('.')
  for p in parents:
    d = d[p]
  d[last] = value


@pytest.mark.parametrize('field,value', REFUSED, ids=[f for f, _ in REFUSED])
def test_each_refused_field(field, value):
  saved = json.loads(load_config('tiny').to_json_best_effort())
  changed = json.loads(json.dumps(saved))
  _set(changed, field, value)
  with pytest.raises(ConfigError) as e:
    ckpt_lib.check_compatible(saved, changed, '/runs/x/checkpoints')
  line = cli.one_line(e.value)
  assert field in line and '--workdir' in line and '--init_from=/runs/x' in line, line
  if field in DATA:  # the deliberate override is named, and accepted
    assert '--new_data' in line, line
    assert ckpt_lib.check_compatible(saved, changed, '/runs/x/checkpoints', new_data=True) == [
        f'{field}: checkpoint {_get(saved, field)!r} vs config {_get(changed, field)!r}']
  else:
    assert '--new_data' not in line
    with pytest.raises(ConfigError):
      ckpt_lib.check_compatible(saved, changed, '/runs/x/checkpoints', new_data=True)


def _get(d, dotted):
  for p in dotted.split('.'):
    d = d[p]
  return d


@pytest.mark.parametrize('field,value', [
    ('train.steps', 5000), ('train.log_every', 3), ('train.eval_every', 7),
    ('train.checkpoint_every', 9), ('train.lr', 1e-4), ('train.progress', True),
    ('train.warmup_steps', 3), ('data.data_dir', '/elsewhere'), ('data.worker_count', 2),
    ('model.remat', True), ('model.mtp.weights', (0.5, 0.25)), ('train.grad_clip', 0.25),
    ('train.b1', 0.8), ('train.b2', 0.99), ('train.weight_decay', 0.0)])
def test_what_may_change_on_resume(field, value):
  saved = json.loads(load_config('tiny').to_json_best_effort())
  changed = json.loads(json.dumps(saved))
  _set(changed, field, value)
  assert ckpt_lib.check_compatible(saved, changed, '/runs/x/checkpoints') == []


def test_another_data_path_is_refused_and_the_record_kept(trained, devices):
  workdir, a, b = trained
  before = _record(workdir)
  for field, value in [('path', str(b)), ('seq_len', 32)]:
    c = files_config(a)
    c.data[field] = value
    with pytest.raises(ConfigError, match=f'data.{field}: checkpoint'):
      train_and_evaluate(c, str(workdir), devices=devices[:1])
    assert _record(workdir) == before


def test_cli_rerun_on_other_data_exits_2_with_one_line(trained):
  workdir, a, b = trained
  before = _record(workdir)
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'train.py'), '--config',
       os.path.join(REPO, 'configs', 'tiny.py'), '--workdir', str(workdir),
       '--config.data.source=files', f'--config.data.path={b}',
       "--config.data.extensions=('.txt',)", '--config.data.validation_percent=30',
       '--config.train.steps=2'],
      capture_output=True, text=True, env=dict(os.environ, XLA_FLAGS=''), cwd=REPO,
      timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: ') and 'data.path' in lines[0]
  assert '--new_data' in lines[0]
  assert _record(workdir) == before


def test_allowed_change_at_the_final_step_keeps_the_record(trained, devices, capfd):
  workdir, a, _ = trained
  before = _record(workdir)
  c = files_config(a)
  c.train.log_every, c.train.eval_every = 5, 5
  train_and_evaluate(c, str(workdir), devices=devices[:1])
  err = capfd.readouterr().err
  assert 'Nothing to do' in err
  # train.progress=False (this config's) turns off the live line only: the start lines show
  assert 'devices: 1 cpu' in err and 'data: files ' in err and 'tok/s' not in err
  assert _record(workdir) == before  # nothing trained, nothing rewritten
  # The final block's decode prompt is the start of one of this run's own documents.
  decode_line = next(line for line in err.splitlines() if 'mtp-decode' in line)
  prompt = shlex.split(decode_line)[shlex.split(decode_line).index('--prompt') + 1]
  assert prompt.startswith('corpus 0 document ') and len(prompt) <= 24, decode_line


def test_new_data_continues_the_model_on_other_data(trained, devices, tmp_path):
  workdir, a, b = trained
  copy = tmp_path / 'run'
  subprocess.run(['cp', '-a', str(workdir), str(copy)], check=True)
  c = files_config(b, steps=3)
  train_and_evaluate(c, str(copy), devices=devices[:1], new_data=True)
  saved = json.loads((copy / 'config.json').read_text())
  assert saved['data']['path'] == str(b) and saved['train']['steps'] == 3
  reader = ckpt_lib.CheckpointReader(str(copy / 'checkpoints'))
  assert reader.steps()[-1] == 3
  assert reader.read_meta(3)['config']['data']['path'] == str(b)
  rows = [json.loads(line) for line in (copy / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in rows if 'train/loss' in r] == [1, 2, 3]
