"""scripts/eval.py and the trainer's decode evaluation: one set of eval/... figures.

Runs in-process on the test run's trained tiny workdir (conftest.tiny_run, whose evals
decode TINY_DECODE prompts), so compiled programs are shared between the tests.
"""
import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import REPO, TINY_DECODE, tiny_model_config
from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import config_lib, train_state
from mtp_jax.commands import evaluate as evaluate_command
from mtp_jax.data import tokenizers
from mtp_jax.decode import decoder as decode
from mtp_jax.train import evaluation
from mtp_jax.train import steps as steps_lib

SCRIPT = os.path.join(REPO, 'scripts', 'eval.py')
DEPTH = 2  # configs/tiny.py


def _script():
  return evaluate_command


def _main(argv):
  try:
    return _script().main(argv)
  except SystemExit as e:  # argparse's own errors
    return e.code


def _eval_rows(workdir):
  text = pathlib.Path(workdir, 'metrics.jsonl').read_text()
  rows = [json.loads(line) for line in text.splitlines()]
  return {r['step']: r for r in rows if 'eval/loss_main' in r}


@pytest.fixture(scope='module')
def report(tiny_run):
  """scripts/eval.py --json with the trainer's own settings, on the latest checkpoint."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    assert _main(['--workdir', str(tiny_run[0]), '--json']) == 0
  return json.loads(buf.getvalue())


def test_json_keys_and_ranges(report):
  r = report
  assert r['step'] == 40 and r['split'] == 'validation' and r['mtp_depth'] == DEPTH
  names = ['main'] + [f'mtp_{k}' for k in range(1, DEPTH + 1)]
  for name in names:
    assert np.isfinite(r[f'eval/loss_{name}']) and r[f'eval/loss_{name}'] > 0, name
    assert 0 < r[f'eval/bpb_{name}'] < 10, name
    assert 0 <= r[f'eval/acc_{name}'] <= 1, name
  for k in range(1, DEPTH + 1):
    assert 0 <= r[f'eval/agree_mtp_{k}'] <= 1
  assert (r['decode_prompts'], r['decode_max_new_tokens']) == TINY_DECODE
  assert r['decode_prompt_len'] == 32  # data.seq_len // 2
  assert 1 <= r['eval/decode_tau'] <= DEPTH + 1
  accept = [r[f'eval/decode_accept_mtp_{k}'] for k in range(1, DEPTH + 1)]
  assert all(0 <= a <= 1 for a in accept)
  assert all(a >= b for a, b in zip(accept, accept[1:])), accept  # P(first k accepted)
  assert r['eval/decode_tau'] <= 1 + sum(accept) + 1e-9  # less only where max_new cut a block
  assert r['eval/decode_speedup'] > 0 and r['eval/decode_ar_tokens_per_sec'] > 0
  assert r['eval/decode_identical'] is True
  # tree drafting beside the chain (the default tree for M = 2: 3,2)
  assert r['eval/decode_tree'] == '3,2' and r['eval/decode_tree_identical'] is True
  tree_accept = [r[f'eval/decode_tree_accept_mtp_{k}'] for k in range(1, DEPTH + 1)]
  assert all(0 <= b <= a <= 1 for a, b in zip(tree_accept, tree_accept[1:])), tree_accept
  assert r['eval/decode_tree_tau'] <= 1 + sum(tree_accept) + 1e-9


def test_matches_the_trainers_eval_line(report, tiny_run):
  """Same checkpoint, same prompts: the same tau and acceptance bit for bit, and the same
  teacher-forced figures up to float reassociation (8 devices here; in training
  --cpu_devices auto: 2 on a 2+ core host, which the trainer says on its console)."""
  rows = _eval_rows(tiny_run[0])
  assert sorted(rows) == [20, 40]
  line = rows[40]
  decode_keys = [k for k in line if k.startswith('eval/decode_')]
  assert sorted(decode_keys) == sorted(['eval/decode_tau'] + [
      f'eval/decode_accept_mtp_{k}' for k in range(1, DEPTH + 1)])
  for key in decode_keys:
    assert report[key] == line[key], key
  for key, value in line.items():
    if key.startswith('eval/') and not key.startswith('eval/decode_'):
      assert report[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
  assert 'tokens per verify step' in tiny_run[1].stderr  # the trainer's eval line shows tau
  if len(os.sched_getaffinity(0)) >= 2:
    assert 'devices: 2 cpu in 1 process, mesh data 2' in tiny_run[1].stderr


def test_table_of_an_earlier_step(tiny_run, capsys):
  """Table mode, --step: the step-20 checkpoint reproduces the step-20 eval line's tau."""
  assert _main(['--workdir', str(tiny_run[0]), '--step', '20']) == 0
  text = capsys.readouterr().out
  assert 'step 20' in text and 'loss' in text and 'bpb' in text
  for row in ('main', 'mtp 1', 'mtp 2'):
    assert f'\n{row} ' in text, row
  tau = _eval_rows(tiny_run[0])[20]['eval/decode_tau']
  assert f'tau (mean accepted length) {tau:.3f}' in text
  assert 'speedup' in text and 'identical True' in text
  assert 'tree 3,2: tau ' in text and 'acceptance per tree depth' in text


@pytest.fixture(scope='module')
def depth0_run(stdlib_data_dir, tmp_path_factory):
  """A workdir holding a checkpoint of a M = 0 model over the byte vocabulary, saved
  before the train.eval_decode_* fields existed."""
  config = tiny_model_config(0, vocab=0)
  config.data.data_dir = stdlib_data_dir
  model, optimizer = train_state.create_model_and_optimizer(tokenizers.resolve_vocab_size(config))
  workdir = str(tmp_path_factory.mktemp('eval_depth0'))
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, 'checkpoints'), async_save=False)
  state = nnx.state((model, optimizer))
  saved = json.loads(config.to_json_best_effort())
  del saved['train']['eval_decode_prompts'], saved['train']['eval_decode_tokens']
  ckpt.save(1, state, meta={'step': 1, 'config': saved, **ckpt_lib.integrity_meta(state)},
            force=True)
  ckpt.close()
  return workdir


def test_depth_zero_decodes_autoregressively_only(depth0_run, capsys):
  argv = ['--workdir', depth0_run, '--json', '--num_prompts', '2', '--eval_batches', '1']
  assert _main(argv) == 0
  r = json.loads(capsys.readouterr().out)
  assert r['mtp_depth'] == 0 and 'depth = 0' in r['decode_note']
  assert np.isfinite(r['eval/loss_main']) and 'eval/loss_mtp_1' not in r
  assert r['eval/decode_ar_tokens_per_sec'] > 0
  assert not any(k in r for k in ('eval/decode_tau', 'eval/decode_speedup',
                                  'eval/decode_identical'))


def test_bad_input_exits_2_before_compiling(tiny_run, tmp_path, capsys):
  workdir = str(tiny_run[0])
  empty = tmp_path / 'empty_run'
  (empty / 'checkpoints').mkdir(parents=True)
  cases = [
      (['--workdir', str(tmp_path / 'nope')], 'does not exist'),
      (['--workdir', str(empty)], 'no checkpoint'),
      (['--workdir', workdir, '--step', '7'], 'checkpoints of steps [20, 40] only'),
      (['--workdir', workdir, '--split', 'nope'], "no split 'nope'"),
      (['--workdir', workdir, '--split', ' '], '--split is empty'),
      (['--workdir', workdir, '--eval_batches', '0'], '--eval_batches must be'),
      (['--workdir', workdir, '--num_prompts', '-1'], '--num_prompts must be'),
      (['--workdir', workdir, '--max_new_tokens', '0'], '--max_new_tokens must be'),
      (['--workdir', workdir, '--prompt_len', '60', '--max_new_tokens', '16'], 'exceeds'),
      (['--workdir', workdir, '--num_prompts', '100000'], 'too few'),
      (['--workdir', workdir, '--eval_batches', 'x'], '--eval_batches must be an integer'),
      (['--workdir', workdir, '--tree', '3,0'], 'candidates per depth must be'),
      (['--workdir', workdir, '--tree', '1,1,1,1,1,1,1,1,1'], 'exceeds the 8 drafts'),
      (['--json'], '--workdir'),
  ]
  compiled = len(decode._COMPILED)  # pylint: disable=protected-access
  for argv, message in cases:
    code = _main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (argv, err)
    assert len(err) == 1 and err[0].startswith('error: ') and message in err[0], (argv, err)
  assert len(decode._COMPILED) == compiled  # pylint: disable=protected-access


def test_exit_code_in_a_fresh_process(tmp_path):
  proc = subprocess.run([sys.executable, SCRIPT, '--workdir', str(tmp_path / 'nope')],
                        capture_output=True, text=True, timeout=300, cwd=REPO,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 2 and proc.stdout == ''
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and 'does not exist' in lines[0], lines


def test_local_decoder_gathers_sharded_parameters(devices):
  """The trainer's state is sharded over the mesh; the decoder gets whole copies."""
  config = tiny_model_config(2, vocab=0)
  config.mesh.shape = (2, 2, 2)
  ts, state = steps_lib.setup(config, devices)
  decoder = evaluation.local_decoder(ts.graphdef, state, ts.mesh)
  model, _ = nnx.merge(ts.graphdef, state)
  assert any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(nnx.state(model)))
  # The reference: the Decoder's own decode layout (MTPModel.for_decoding) of a whole copy.
  whole, _ = nnx.merge(ts.graphdef, jax.tree.map(lambda x: jax.numpy.asarray(np.asarray(x)), state))
  want = jax.tree.leaves(decode.Decoder(whole).params)
  assert len(want) == len(jax.tree.leaves(decoder.params))
  for got, ref in zip(jax.tree.leaves(decoder.params), want):
    assert got.sharding.device_set == {jax.local_devices()[0]}
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.parametrize('fields, words', [
    (dict(eval_decode_prompts=-1), 'train.eval_decode_prompts must be a non-negative'),
    (dict(eval_decode_prompts=2, eval_decode_tokens=40), 'train.eval_decode_tokens must be in'),
    (dict(eval_decode_prompts=2, eval_decode_tokens=0), 'train.eval_decode_tokens must be in'),
])
def test_config_fields_are_validated(fields, words):
  c = config_lib.base_config()
  c.data.seq_len = 64
  for k, v in fields.items():
    c.train[k] = v
  with pytest.raises(config_lib.ConfigError, match=words):
    config_lib.validate(c)
