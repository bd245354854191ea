"""Checkpoints wherever train.checkpoint_dir put them: the readers (mtp-eval, mtp-decode,
mtp-export, mtp-self-distill) find them through the workdir's config.json, at a non-default
local path and at a URL (a scheme that etils.epath resolves to a local directory, as it
resolves gs:// through gcsfs); a gs:// location without gcsfs is one line naming the extra,
for the trainer's flags, the readers and the compilation cache alike.

The workdirs are copies of the test run's trained tiny workdir (conftest.tiny_run), with
their checkpoints moved out and config.json pointing at the new place.
"""
import importlib.util
import json
import os
import shutil

import jax
import pytest

from helpers import REPO, local_url_scheme
from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import storage
from mtp_jax.commands import decode, evaluate, export, preflight, self_distill
from mtp_jax.commands import train as train_cmd
from mtp_jax.errors import RequestError
from mtp_jax.runtime import compile_cache

_ReaderSchemePath = local_url_scheme('mtpreader')  # 'mtpreader://bucket/run': root/bucket/run


def _moved(tiny_run, tmp_path, where: str, directory) -> str:
  """A copy of the tiny workdir whose checkpoints live at `directory`, named `where` in its
  config.json."""
  workdir = tmp_path / 'work'
  shutil.copytree(tiny_run[0], workdir)
  directory.parent.mkdir(parents=True, exist_ok=True)
  shutil.move(workdir / 'checkpoints', directory)
  config = json.loads((workdir / 'config.json').read_text())
  config['train']['checkpoint_dir'] = where
  (workdir / 'config.json').write_text(json.dumps(config))
  return str(workdir)


def _no_gcs(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, 'find_spec',
                      lambda name, *a: None if name in ('gcsfs', 'tensorflow') else real(name, *a))


def test_eval_reads_a_non_default_local_checkpoint_dir(tiny_run, tmp_path, capsys):
  elsewhere = tmp_path / 'disk2' / 'ckpts'
  workdir = _moved(tiny_run, tmp_path, str(elsewhere), elsewhere)
  assert not os.path.exists(os.path.join(workdir, 'checkpoints'))
  assert evaluate.main(['--workdir', workdir, '--eval_batches', '1', '--num_prompts', '0']) == 0
  out = capsys.readouterr().out
  assert f'{workdir}  step 40' in out and 'depth' in out and 'main' in out
  shutil.rmtree(elsewhere)
  assert evaluate.main(['--workdir', workdir]) == 2
  assert capsys.readouterr().err.strip() == (
      f"error: --workdir {workdir!r} has no checkpoints in {elsewhere} (its "
      'train.checkpoint_dir; train it first)')


def _at_url(tiny_run, tmp_path, monkeypatch):
  monkeypatch.setattr(_ReaderSchemePath, 'root', str(tmp_path / 'store'))
  return _moved(tiny_run, tmp_path, 'mtpreader://bucket/run',
                tmp_path / 'store' / 'bucket' / 'run')


def test_eval_reads_checkpoints_at_a_url(tiny_run, tmp_path, monkeypatch, capsys):
  workdir = _at_url(tiny_run, tmp_path, monkeypatch)
  assert evaluate.main(['--workdir', workdir, '--eval_batches', '1', '--num_prompts', '0']) == 0
  assert f'{workdir}  step 40' in capsys.readouterr().out


@pytest.mark.slow  # three in-process compiles of the tiny model
def test_decode_export_and_self_distill_read_checkpoints_at_a_url(tiny_run, tmp_path,
                                                                  monkeypatch, capsys):
  workdir = _at_url(tiny_run, tmp_path, monkeypatch)
  assert decode.main(['--workdir', workdir, '--prompt', 'def f(', '--max_new_tokens', '4',
                      '--mode', 'ar']) == 0
  assert '[continuation]' in capsys.readouterr().out
  out_dir = tmp_path / 'export'
  assert export.main(['--workdir', workdir, '--out', str(out_dir), '--layout', 'llama']) == 0
  assert (out_dir / 'config.json').exists() and list(out_dir.glob('*.safetensors'))
  distilled = tmp_path / 'distilled'
  assert self_distill.main(['--workdir', workdir, '--out', str(distilled), '--num_prompts', '2',
                            '--prompt_len', '8', '--max_new_tokens', '4',
                            '--batch_size', '2']) == 0
  assert len((distilled / 'data.jsonl').read_text().splitlines()) == 2


def test_gs_without_gcsfs_is_one_line_naming_the_extra(tiny_run, tmp_path, monkeypatch, capsys):
  _no_gcs(monkeypatch)
  extra = "needs the gcs extra: pip install 'mtp_jax[gcs]' (gcsfs)"
  assert storage.missing_backend('gs://b/run') == extra[len('needs '):]
  assert storage.missing_backend('/local/run') is None
  # A reader of a workdir whose checkpoints are in a bucket.
  workdir = _moved(tiny_run, tmp_path, 'gs://bucket/run', tmp_path / 'unused' / 'run')
  with pytest.raises(RequestError, match=r'its checkpoints at .gs://bucket/run. ' + 'needs'):
    preflight.read_workdir(workdir)
  assert decode.main(['--workdir', workdir, '--prompt', 'x']) == 2
  assert capsys.readouterr().err.strip() == (
      f"error: --workdir {workdir!r}: its checkpoints at 'gs://bucket/run' {extra}")
  # The library's own readers and writer, for callers that skip the command lines.
  for make in (ckpt_lib.CheckpointReader, ckpt_lib.Checkpointer):
    with pytest.raises(ckpt_lib.CheckpointError) as e:
      make('gs://bucket/run')
    assert str(e.value) == f"checkpoints at 'gs://bucket/run' {extra.replace('needs', 'need')}"
  with pytest.raises(ckpt_lib.CheckpointError, match='need the gcs extra'):
    ckpt_lib.load_workdir(workdir)
  # The trainer's flags, before JAX starts; nothing is created.
  config = os.path.join(REPO, 'configs', 'tiny.py')
  for field in ('checkpoint_dir', 'compilation_cache_dir'):
    code = train_cmd.main(['--config', config, '--workdir', str(tmp_path / 'new'),
                           f'--config.train.{field}=gs://bucket/x'])
    assert code == 2
    assert capsys.readouterr().err.strip() == f"error: train.{field} 'gs://bucket/x' {extra}"
  assert not (tmp_path / 'new').exists()
  # The compilation cache (e.g. $JAX_COMPILATION_CACHE_DIR=gs://...): one line, then no cache.
  before = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
  lines = []
  try:
    assert compile_cache.enable('gs://bucket/cache', lines.append) is None
    assert not jax.config.jax_enable_compilation_cache
  finally:
    jax.config.update('jax_enable_compilation_cache', before[0])
    jax.config.update('jax_compilation_cache_dir', before[1])
  assert lines == [f"WARNING: train.compilation_cache_dir 'gs://bucket/cache' {extra}; "
                   'compiling without a persistent cache']


def test_check_storage_round_trips_a_file_and_names_what_fails(tmp_path, monkeypatch, capsys):
  """mtp-train --check_storage: a probe written, read back and deleted (nothing left); a
  location that cannot be written is one line, exit 2."""
  monkeypatch.setattr(_ReaderSchemePath, 'root', str(tmp_path / 'store'))
  (tmp_path / 'store' / 'bucket').mkdir(parents=True)
  config = os.path.join(REPO, 'configs', 'tiny.py')
  args = ['--config', config, '--workdir', str(tmp_path / 'w'), '--check_storage']
  assert train_cmd.main([*args, '--config.train.checkpoint_dir=mtpreader://bucket/run']) == 0
  assert 'storage ok on ' in capsys.readouterr().out
  probe = tmp_path / 'store' / 'bucket' / 'run' / '.mtp_jax_probe'
  assert probe.is_dir() and not list(probe.iterdir())  # the probe file is gone
  assert train_cmd.main(args) == 0  # the default: WORKDIR/checkpoints, nothing created
  assert not (tmp_path / 'w').exists()
  (tmp_path / 'store' / 'file').write_text('not a directory')  # a bucket that refuses
  assert train_cmd.main([*args, '--config.train.checkpoint_dir=mtpreader://file/run']) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
      "error: train.checkpoint_dir 'mtpreader://file/run' cannot be written and read back on ")
