"""A user's mistake is answered before JAX starts: mistyped paths and files, bad config values
(all but the device count) and bad flag values (each command's one `error:` line, exit 2,
without importing jax), and misspelled flags (with the closest one)."""
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

TINY = os.path.join(REPO, 'configs', 'tiny.py')
# (command module, argv, words of the one error line); run in an empty folder holding a file
# `a_file`, a folder `empty/` and a folder `ckpt/checkpoints/`.
CASES = [
    ('train', ['--config', TINY, '--workdir', 'a_file'], 'exists and is not a directory'),
    ('train', ['--config', TINY, '--workdir', 'a_file/run'], "'a_file/run' is not a usable"),
    ('train', ['--config', TINY, '--workdir', 'w', '--config.data.source=jsonl',
               '--config.data.path=missing.jsonl'], 'is neither a .jsonl file nor a directory'),
    ('train', ['--config', TINY, '--workdir', 'w', '--config.data.source=parquet',
               '--config.data.path=a_file'], 'is not a .parquet file'),
    ('train', ['--config', TINY, '--workdir', 'w', '--config.data.source=files',
               '--config.data.path=missing'], 'corpus root'),
    ('train', ['--config', TINY, '--workdir', 'w', '--config.data.source=hf_disk',
               '--config.data.path=missing'], 'save_to_disk'),
    ('train', ['--config', TINY, '--workdir', 'w', '--config.data.tokenizer=sentencepiece',
               '--config.data.spm_model=missing.model'], 'data.spm_model'),
    ('train', ['--config', TINY, '--workdir', 'w', '--config.data.tokenizer=hf',
               '--config.data.hf_tokenizer=empty'], 'has no tokenizer.json'),
    ('train', ['--config', TINY, '--workdir', 'w', '--init_from', 'hf:empty'],
     'no config.json in the directory'),
    ('train', ['--config', TINY, '--workdir', 'w', '--init_from', 'hf:missing'], 'does not exist'),
    ('train', ['--config', TINY, '--workdir', 'w', '--init_from', 'missing'], 'is not a directory'),
    ('decode', ['--workdir', 'a_file', '--prompt', 'x'], 'is not a directory'),
    ('decode', ['--workdir', 'empty', '--prompt', 'x'], 'has no checkpoints/'),
    ('decode', ['--workdir', 'ckpt', '--prompts_file', 'missing.txt'], '--prompts_file'),
    ('evaluate', ['--workdir', 'missing'], 'does not exist'),
    ('export', ['--workdir', 'empty', '--out', 'o', '--layout', 'llama'], 'has no checkpoints/'),
    ('self_distill', ['--workdir', 'missing', '--out', 'o'], 'does not exist'),
    # values: every config check but the device count, and the flags' value types
    ('train', ['--config', TINY, '--workdir', 'w', '--config.train.steps=-5'],
     'train.steps must be a positive integer, got -5'),
    ('train', ['--config', TINY, '--workdir', 'w', '--config.model.mtp.kind=sequental'],
     'model.mtp.kind must be'),
    ('train', ['--config', TINY, '--workdir', 'w', '--config.data.source=nope'],
     'data.source must be one of'),
    ('train', ['--config', TINY, '--workdir', 'w', '--config.mesh.shape=(2,1)'],
     'mesh.shape must be 3 integers'),
    ('train', ['--config', TINY, '--workdir', 'w', '--config.train.steps=abc'],
     "--config.train.steps=abc: train.steps takes an integer (60 in the config), got 'abc'"),
    ('train', ['--config', os.path.join(os.path.dirname(TINY), 'tinny.py')],
     'No such file or directory (did you mean '),
    ('train', ['--config', TINY, '--cpu_devices=0'],
     "--cpu_devices must be auto or a positive integer, got '0'"),
    ('decode', ['--workdir', 'ckpt', '--prompt', 'x', '--max_new_tokens', '-5'],
     '--max_new_tokens must be > 0, got -5'),
    ('decode', ['--workdir', 'ckpt', '--prompt', 'x', '--num_drafts', '-1'],
     '--num_drafts must be >= 0'),
    ('decode', ['--workdir', 'ckpt', '--prompt', 'x', '--top_p', '1.5'], '--top_p must be in'),
    ('decode', ['--workdir', 'ckpt', '--prompt', 'x', '--batch_size', 'two'],
     "--batch_size must be an integer, got 'two'"),
    ('evaluate', ['--workdir', 'ckpt', '--eval_batches', '0'], '--eval_batches must be > 0'),
    ('self_distill', ['--workdir', 'ckpt', '--out', 'o', '--temperature', '-1'],
     '--temperature must be >= 0'),
    ('export', ['--workdir', 'ckpt', '--out', 'o', '--layout', 'llama', '--step', '-1'],
     '--step must be >= 0'),
]

_SCRIPT = """
import contextlib, io, json, sys
import importlib
out = []
for name, argv in json.loads(sys.argv[1]):
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    try:
      rc = importlib.import_module('mtp_jax.commands.' + name).main(argv)
    except SystemExit as e:  # argparse's value checks
      rc = e.code
  out.append([rc, err.getvalue()])
print(json.dumps({'results': out, 'jax': 'jax' in sys.modules,
                  'libs': sorted(m for m in ('flax', 'orbax', 'grain', 'tensorflow_datasets',
                                             'numpy') if m in sys.modules)}))
"""


def test_path_errors_come_before_jax_starts(tmp_path):
  (tmp_path / 'a_file').write_text('x')
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'ckpt' / 'checkpoints').mkdir(parents=True)
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  proc = subprocess.run(
      [sys.executable, '-c', _SCRIPT, json.dumps([[c, a] for c, a, _ in CASES])],
      capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  for (command, argv, words), (rc, err) in zip(CASES, report['results']):
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith('error: '), (command, argv, err)
    assert words in lines[0], (words, lines[0])
  assert not report['jax'] and report['libs'] == [], report
  assert sorted(os.listdir(tmp_path)) == ['a_file', 'ckpt', 'empty']  # nothing written


@pytest.mark.parametrize('command,argv,hint', [
    ('decode', ['--workdir', 'w', '--max-new-tokens', '3'], '(did you mean --max_new_tokens?)'),
    ('decode', ['--workdir', 'w', '--max-new-tokens=3'], '(did you mean --max_new_tokens?)'),
    ('train', ['--config', TINY, '--worckdir', 'w'], '(did you mean --workdir?)'),
    ('evaluate', ['--workdir', 'w', '--eval-batches', '2'], '(did you mean --eval_batches?)'),
    ('export', ['--workdir', 'w', '--zzz'], 'unrecognized arguments: --zzz (--help lists'),
])
def test_a_misspelled_flag_names_the_closest_one(command, argv, hint, capsys):
  import importlib
  main = importlib.import_module(f'mtp_jax.commands.{command}').main
  with pytest.raises(SystemExit) as e:
    main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith('error: unrecognized arguments: --') and hint in err[0]


def test_abbreviations_and_values_are_not_flag_mistakes(capsys):
  from mtp_jax.commands import decode
  args = decode.parse(['--workdir', 'w', '--max_new', '5', '--prompt', '--json-like text'])
  assert args.max_new_tokens == 5 and args.prompt == '--json-like text'

