"""scripts/self_distill.py (FastMTP's self-distilled data): the trunk's own sampled
continuations, written as token ids, equal the decoder's output for the seed, and train.

Uses the test run's trained tiny workdir (conftest.tiny_run, configs/tiny.py, M = 2).
"""
import json
import pathlib

import numpy as np
import pytest

from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import train_state
from mtp_jax.commands import self_distill as self_distill_command
from mtp_jax.data import pipeline, stdlib_dataset, tokenizers
from mtp_jax.decode import Decoder
from mtp_jax.train import train_and_evaluate

ARGS = ['--num_prompts', '7', '--prompt_len', '8', '--max_new_tokens', '12', '--batch_size', '4',
        '--temperature', '1.0', '--seed', '3']


def _main(argv, capsys):
  try:
    code = self_distill_command.main(argv)
  except SystemExit as e:
    code = e.code
  out = capsys.readouterr()
  return code, out.out, out.err.strip().splitlines()


@pytest.fixture(scope='module')
def distilled(tiny_run, tmp_path_factory):
  workdir, _ = tiny_run
  return workdir, tmp_path_factory.mktemp('distilled') / 'sd'  # written by the first test


def test_self_distill_writes_the_decoders_own_samples(distilled, capsys):
  workdir, out = distilled
  code, stdout, err = _main(['--workdir', str(workdir), '--out', str(out)] + ARGS, capsys)
  assert code == 0, err
  meta = json.loads(stdout.strip().splitlines()[-1])
  assert meta == json.loads(pathlib.Path(out / 'meta.json').read_text())
  records = [json.loads(line) for line in pathlib.Path(out / 'data.jsonl').read_text().splitlines()]
  assert len(records) == 7 == meta['records']

  config, step = ckpt_lib.load_workdir(str(workdir))
  tok = tokenizers.get_tokenizer(config.data)
  source = stdlib_dataset.data_source(config.data, 'train')
  for r in records:  # each prompt is a window of the train document it names
    doc = tok.encode_array(source[r['doc']]['text'])
    assert r['prompt_len'] == 8
    np.testing.assert_array_equal(r['tokens'][:8], doc[r['start']:r['start'] + 8])
    assert 0 < len(r['tokens']) - 8 <= 12 and tokenizers.EOS_ID not in r['tokens'][8:]

  # The same prompts through Decoder (autoregressive: --num_drafts 0): batch j of 4
  # sampled with seed 3 + j, the last one filled up with its first prompt; a row that
  # stopped at eos is stored without it.
  model, _ = train_state.restore_model_at(config, str(workdir), step)
  decoder = Decoder(model)
  prompts = [r['tokens'][:8] for r in records]
  for j, batch in enumerate([prompts[:4], prompts[4:] + prompts[4:5]]):
    got = decoder.generate(batch, 12, num_drafts=0, temperature=1.0, seed=3 + j,
                           eos_id=tok.eos_id, pad_to=(8, 12))
    for r, t in zip(records[4 * j:4 * j + 4], got.tokens):
      t = t.tolist()
      assert r['tokens'][8:] == (t[:-1] if t and t[-1] == tok.eos_id else t)
  other = decoder.generate(prompts[:4], 12, num_drafts=0, temperature=1.0, seed=99,
                           eos_id=tok.eos_id, pad_to=(8, 12))
  assert any(r['tokens'][8:] != t.tolist()[:len(r['tokens']) - 8]
             for r, t in zip(records, other.tokens)), 'the seed decides the samples'

  # The trainer's data layer reads exactly the stored ids back.
  cfg = config.copy_and_resolve_references()
  for k, v in meta['train_overrides'].items():
    cfg.data[k.split('.')[1]] = v
  cfg.data.validation_percent = 30
  pipeline.validate_data_config(cfg)
  stored = {tuple(r['tokens']) for r in records}
  read = [tuple(pipeline.document_ids(tok, cfg.data, src[i]).tolist())
          for split in ('train', 'validation')
          for src in [stdlib_dataset.data_source(cfg.data, split)] for i in range(len(src))]
  assert sorted(read) == sorted(stored)
  batch = next(pipeline.make_train_iter(cfg))  # row 0 starts with a whole document (+ eos)
  piece = tuple(batch['tokens'][0][:int((batch['segment_ids'][0] == 1).sum())].tolist())
  assert any((s + (tok.eos_id,))[:len(piece)] == piece for s in stored)


@pytest.mark.slow
def test_frozen_mtp_trains_on_self_distilled_data(distilled, devices, tmp_path, capsys):
  """The trainer itself: 2 steps of frozen-trunk MTP on the written data.jsonl."""
  workdir, out = distilled
  if not (out / 'data.jsonl').exists():
    assert _main(['--workdir', str(workdir), '--out', str(out)] + ARGS, capsys)[0] == 0
  meta = json.loads(pathlib.Path(out / 'meta.json').read_text())
  config, _ = ckpt_lib.load_workdir(str(workdir))
  for k, v in meta['train_overrides'].items():
    config.data[k.split('.')[1]] = v
  config.data.validation_percent = 30
  config.model.mtp.freeze_trunk = True
  config.train.steps = 2
  config.train.eval_every = 0
  config.train.eval_batches = 1
  config.train.eval_decode_prompts = 0
  config.train.progress = False
  metrics = train_and_evaluate(config, str(tmp_path / 'run'), devices=devices[:1],
                                     init_from=str(workdir))
  assert np.isfinite(metrics['train/loss']) and metrics['train/loss_mtp_1'] > 0


def test_self_distill_bad_input_is_one_line(distilled, tmp_path, capsys):
  workdir, _ = distilled
  base = ['--workdir', str(workdir), '--out', str(tmp_path / 'o'), '--prompt_len', '8',
          '--max_new_tokens', '12']
  for extra, words in [(['--prompt_len', '60', '--max_new_tokens', '10'], ['--prompt_len (60)',
                                                                           'data.seq_len (64)']),
                       (['--num_prompts', '0'], ['--num_prompts must be > 0']),
                       (['--num_drafts', '5'], ['--num_drafts 5', 'model.mtp.depth (2)']),
                       (['--data', 'nofield=1'], ['--data', 'nofield=1']),
                       (['--data', 'source=jsonl', '--data', f'path={tmp_path}/none.jsonl'],
                        ['data.path', 'none.jsonl'])]:
    code, _, err = _main(base + extra, capsys)
    assert code == 2 and len(err) == 1 and all(w in err[0] for w in words), (extra, err)
  assert not (tmp_path / 'o').exists()
