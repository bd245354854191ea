"""The head-kind ablation: equal-FLOP variants, the tabulating script, trained parallel heads."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, byte_config, byte_ids
from mtp_jax import config_lib, decode
from mtp_jax import steps as steps_lib
from flax import nnx

_spec = importlib.util.spec_from_file_location('configs_ablation',
                                               os.path.join(REPO, 'configs', 'ablation.py'))
ABLATION = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ABLATION)  # its VARIANTS, budgets and step_flops, not only get_config
SCRIPT = os.path.join(REPO, 'scripts', 'ablation.py')
# Fields that are allowed to differ between variants; everything else must be identical.
VARYING = {('model', 'mtp', 'depth'), ('model', 'mtp', 'kind'), ('train', 'steps'),
           ('train', 'warmup_steps')}


def _flat(d, prefix=()):
  out = {}
  for k, v in d.items():
    out.update(_flat(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
  return out


@pytest.mark.parametrize('smoke', [False, True])
def test_variants_are_equal_flop_and_otherwise_identical(smoke):
  budget = ABLATION.SMOKE_BUDGET_FLOPS if smoke else ABLATION.BUDGET_FLOPS
  configs = {v: ABLATION.get_config(v + (',smoke' if smoke else '')) for v in ABLATION.VARIANTS}
  flops = {}
  for v, c in configs.items():
    config_lib.validate(c)
    per_step = ABLATION.step_flops(c)
    flops[v] = per_step * c.train.steps
    assert budget - per_step < flops[v] <= budget, (v, c.train.steps, per_step)  # within a step
    assert (c.model.mtp.depth, c.model.mtp.kind) == ABLATION.VARIANTS[v]
  steps = {v: c.train.steps for v, c in configs.items()}
  # D = 0 trains longest; sequential's eh_proj makes it the most expensive per step.
  assert steps['none'] > steps['parallel'] >= steps['sequential'], steps
  flat = {v: _flat(json.loads(c.to_json_best_effort())) for v, c in configs.items()}
  for v in ('sequential', 'parallel'):
    differ = {k for k in flat[v].keys() | flat['none'].keys()
              if flat[v].get(k) != flat['none'].get(k)}
    assert differ <= VARYING, differ - VARYING


def test_bad_variant_is_a_clear_error(tmp_path):
  for arg in ('seq', 'parallel,big'):
    with pytest.raises(ValueError, match='none, sequential, parallel'):
      ABLATION.get_config(arg)
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'train.py'), '--config',
       os.path.join(REPO, 'configs', 'ablation.py:paralel'), f'--workdir={tmp_path}'],
      capture_output=True, text=True, timeout=120, cwd=REPO, env=dict(os.environ, XLA_FLAGS=''))
  assert proc.returncode == 2 and "unknown argument 'paralel'" in proc.stderr, proc.stderr
  proc = subprocess.run([sys.executable, SCRIPT, '--workdir', str(tmp_path), '--variants', 'x'],
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2 and 'unknown variant' in proc.stderr


def _script(*args):
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                        env=env, timeout=900, cwd=REPO)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


@pytest.mark.slow  # three training subprocesses and six decode compilations: ~2 min
def test_ablation_script_end_to_end(stdlib_data_dir, tmp_path):
  """--run --smoke trains the three tiny variants, then tabulates them; a rerun trains nothing."""
  root = str(tmp_path / 'ablation')
  common = ['--workdir', root, '--smoke', '--num_prompts', '2', '--json',
            f'--train_flag=--config.data.data_dir={stdlib_data_dir}']
  rows = json.loads(_script(*common, '--run').stdout)['variants']
  by = {r['variant']: r for r in rows}
  assert set(by) == set(ABLATION.VARIANTS) and all(r['finished'] for r in rows)
  for r in rows:
    assert ABLATION.SMOKE_BUDGET_FLOPS - r['flops_per_step'] < r['train_flops'] <= \
        ABLATION.SMOKE_BUDGET_FLOPS
    assert 0 < r['val_loss_main'] < math.log(320) and r['val_bpb_main'] > 0  # it learned
    assert len(r['val_loss_per_depth']) == r['depth'] == len(r['acceptance_per_depth'])
  assert by['none']['steps'] > by['parallel']['steps'] >= by['sequential']['steps']
  assert by['none']['tau'] == 1.0 and by['none']['identical_to_ar'] is None
  for v in ('sequential', 'parallel'):
    assert by[v]['kind'] == v and by[v]['identical_to_ar'] is True
    assert 1.0 <= by[v]['tau'] <= 3.0
    assert all(np.isfinite(by[v]['val_loss_per_depth']))
  proc = _script(*common, '--run', '--variants', 'none')
  assert 'none: finished, not retrained' in proc.stderr
  untimed = lambda r: {k: v for k, v in r.items() if 'per_sec' not in k}  # noqa: E731
  assert [untimed(r) for r in json.loads(proc.stdout)['variants']] == [untimed(by['none'])]
  table = _load_script().markdown(rows + [{'variant': 'other', 'finished': False}]).splitlines()
  assert table[0].startswith('| variant |') and len(table) == 6
  assert '| none | 0 |' in table[2] and '1 (n.a.)' in table[2]
  assert table[4].startswith('| parallel | 2 |') and '| yes |' in table[4]
  assert 'not finished' in table[5]


def _load_script():
  spec = importlib.util.spec_from_file_location('ablation_script', SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


ALPHABET = 'abcdefghijklmnopqrstuvwxyz'


def alphabet_ids(start: int, n: int) -> list[int]:
  """The alphabet, cyclically, from letter `start`: t_(i+k) is a function of t_i alone."""
  return byte_ids(''.join(ALPHABET[(start + i) % 26] for i in range(n)))


def test_parallel_heads_train_and_decode_losslessly_after_training(devices):
  """Parallel heads learn (every depth's loss falls) and stay lossless once drafts are accepted.

  test_decode checks parallel heads with random weights only, where almost no draft is
  accepted; here the accept and bonus paths run with a trained parallel-head model.
  """
  config = byte_config(2, 'parallel')
  config.data.seq_len, config.data.batch_size = 64, 16
  config.train.steps, config.train.warmup_steps, config.train.lr = 80, 4, 1e-2
  config.model.mtp.weights = (1.0, 1.0)
  config.mesh.shape = (1, 1, 1)
  ts, state = steps_lib.setup(config, devices[:1])
  rng = np.random.default_rng(0)
  pos = np.broadcast_to(np.arange(64, dtype=np.int32), (16, 64))
  losses = []
  for _ in range(config.train.steps):
    tokens = np.array([alphabet_ids(int(rng.integers(26)), 64) for _ in range(16)], np.int32)
    batch = {'tokens': tokens, 'segment_ids': np.ones_like(tokens), 'positions': pos}
    state, m = steps_lib.run_step(ts, state, batch)
    losses.append(np.asarray(m['loss_sum']) / np.asarray(m['count']))  # [D + 1] per depth
  first, last = losses[0], np.mean(losses[-5:], axis=0)
  assert np.all(last < 0.3 * first), (first, last)  # every depth, the heads included
  model, _ = nnx.merge(ts.graphdef, state)
  dec = decode.Decoder(model)
  prompts = [alphabet_ids(i * 3, 1 + i) for i in range(8)]
  ar = dec.generate(prompts, 24, num_drafts=0, eos_id=None)
  sp = dec.generate(prompts, 24, num_drafts=2, eos_id=None)
  for a, s in zip(ar.tokens, sp.tokens):
    np.testing.assert_array_equal(s, a)
  st = sp.stats()
  assert st['mean_accepted_length'] > 1.5 and st['acceptance_per_depth'][1] > 0, st
