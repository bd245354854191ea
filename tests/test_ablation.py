"""The research sweep: configs, the induction task, the held-out corpus, the sweep machinery
(resumable runs, mean/std tables against the runs' results), the sweep figures, and
trained parallel heads decoding losslessly."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from helpers import REPO, byte_config, byte_ids
from mtp_jax import config_lib
from mtp_jax.data import corpus, induction, tokenizers
from mtp_jax.decode import Decoder
from mtp_jax.research import heldout, stats
from mtp_jax.research import sweep as research
from mtp_jax.train import steps as steps_lib

SCRIPT = os.path.join(REPO, 'scripts', 'ablation.py')
from mtp_jax.commands import ablation as A  # noqa: E402
from mtp_jax.research import ablation as ablation_lib  # noqa: E402
from mtp_jax.research import markdown as markdown_lib  # noqa: E402
from mtp_jax.research import studies, tables  # noqa: E402

# Fields that may differ between variants; everything else must be identical.
VARYING = {('model', 'mtp', 'depth'), ('model', 'mtp', 'kind')}


def _flat(d, prefix=()):
  out = {}
  for k, v in d.items():
    out.update(_flat(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
  return out


@pytest.mark.parametrize('group', ['lm', 'induction', 'names'])
@pytest.mark.parametrize('smoke', [False, True])
def test_variants_differ_only_in_heads_and_equal_flop_steps_fit_the_budget(group, smoke):
  mod = studies.CONFIGS[group]
  opt = ',smoke' if smoke else ''
  base = mod.get_config(mod.BASELINE + opt)
  budget = studies.ABLATION.step_flops(base) * base.train.steps
  flat_base = _flat(json.loads(base.to_json_best_effort()))
  steps = {}
  for v, (depth, kind) in mod.VARIANTS.items():
    c = mod.get_config(v + opt)
    config_lib.validate(c)
    assert (c.model.mtp.depth, c.model.mtp.kind) == (depth, kind)
    assert c.train.min_lr_ratio == 1.0  # constant after warmup: budgets are prefixes of runs
    flat = _flat(json.loads(c.to_json_best_effort()))
    differ = {k for k in flat.keys() | flat_base.keys() if flat.get(k) != flat_base.get(k)}
    assert differ <= VARYING, differ - VARYING
    n = studies.ABLATION.equal_flop_steps(c, base)
    per_step = studies.ABLATION.step_flops(c)
    assert budget - per_step < n * per_step <= budget, (v, n)  # within one step
    steps[v] = n
  assert steps['d0'] == base.train.steps and steps['d0'] > steps['d1']
  if 'd3' in steps:
    assert steps['d1'] > steps['d3']
  if 'p2' in steps:  # a parallel head has no eh_proj: cheaper than a sequential module
    assert steps['d1'] <= steps['p2'] < steps['d0']
  if 'd3p' in steps:  # a parallel head has no eh_proj: cheaper than a sequential module
    assert steps['d3'] <= steps['d3p'] < steps['d1']


def test_bad_input_is_one_clear_error():
  cases = ((studies.ABLATION, 'd2'), (studies.ABLATION, 'd1,big'), (studies.INDUCTION, 'd3p'))
  for mod, arg in cases:
    with pytest.raises(ValueError, match='unknown argument'):
      mod.get_config(arg)
  for flags, msg in ((['--seeds', '0,x'], 'comma-separated integers'),
                     (['--seeds', '1,1'], 'distinct'), (['--groups', 'lm,x'], 'unknown group'),
                     (['--variants', 'd9'], 'unknown variant'),
                     (['--temperatures', '-1'], '>= 0')):
    proc = subprocess.run([sys.executable, SCRIPT, '--no_run', *flags], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and msg in proc.stderr, (flags, proc.stderr[-500:])


def test_induction_rows_are_deterministic_and_scored_on_the_second_occurrence():
  task = induction.InductionTask(seq_len=64, alphabet=16, span_min=6, span_max=12, repeats=3)
  a, b = task.batch(3, 7, 32), task.batch(3, 7, 32)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a['tokens'], task.batch(3, 8, 32)['tokens'])
  assert not np.array_equal(a['tokens'], task.batch(4, 7, 32)['tokens'])
  tok, mask = a['tokens'], a['copy_mask']
  assert tok.min() >= task.first_id and tok.max() < task.first_id + task.alphabet
  for r in range(len(tok)):
    idx = np.flatnonzero(mask[r])
    length = len(idx) + 1  # the span's first copied token is not scored
    assert task.span_min <= length <= task.span_max and np.all(np.diff(idx) == 1)
    b0 = idx[0] - 1  # start of the second occurrence; the first is just before it
    np.testing.assert_array_equal(tok[r, b0:b0 + length], tok[r, b0 - length:b0])
    np.testing.assert_array_equal(tok[r, b0 + length:b0 + 2 * length], tok[r, b0:b0 + length])
  # A perfect copier scores 1; a predictor of the previous token scores about chance.
  copier = np.zeros_like(tok)
  for r in range(len(tok)):
    idx = np.flatnonzero(mask[r])
    length = len(idx) + 1
    copier[r, idx - 1] = tok[r, idx - length]  # pred at i-1 of token i: the first occurrence
  assert induction.copy_accuracy(copier, a) == 1.0
  assert induction.copy_accuracy(tok, a) < 0.3
  with pytest.raises(ValueError, match='do not fit'):
    induction.InductionTask(seq_len=32, span_min=8, span_max=12, repeats=3)


def test_heldout_corpus_is_deterministic_and_excludes_stdlib_copies(tmp_path):
  root = tmp_path / 'site'
  (root / 'pkg').mkdir(parents=True)
  stdlib_file = os.path.join(corpus.stdlib_root(), 'textwrap.py')
  with open(stdlib_file, 'rb') as f:
    (root / 'pkg' / 'vendored_textwrap.py').write_bytes(f.read())  # a stdlib copy: excluded
  for i in range(6):
    (root / 'pkg' / f'm{i}.py').write_text(f'def f{i}(x):\n  return x + {i}\n' * 80)
  (root / 'pkg' / 'dup.py').write_text('def f0(x):\n  return x + 0\n' * 80)  # = m0.py
  (root / 'pkg' / 'tiny.py').write_text('x = 1\n')  # under min_bytes
  rule = heldout.HeldoutRule(root=str(root), min_bytes=100, cap_bytes=10**6)
  docs, desc = heldout.heldout_documents(rule)
  names = [d[0] for d in docs]
  assert sorted(names) == [f'pkg/m{i}.py' for i in range(6)] or \
      sorted(names) == sorted([f'pkg/m{i}.py' for i in range(1, 6)] + ['pkg/dup.py'])
  assert desc['scanned']['duplicate'] == 2 and desc['documents'] == 6
  assert heldout.heldout_documents(rule) == (docs, desc)
  tok = tokenizers.ByteTokenizer()
  rows = heldout.pack_rows([t for _, t in docs], tok, 64, 8)
  assert rows['tokens'].shape == (8, 64) and rows['segment_ids'].min() >= 1
  first = tok.encode_array(docs[0][1])
  np.testing.assert_array_equal(rows['tokens'][0], first[:64])
  np.testing.assert_array_equal(rows['positions'][1], np.arange(64))  # a new piece per row
  with pytest.raises(ValueError, match='fills'):
    heldout.pack_rows([t for _, t in docs], tok, 64, 10**4)


def test_statistics():
  m, s = stats.mean_std([1.0, 2.0, 4.0])
  assert m == pytest.approx(7 / 3) and s == pytest.approx(np.std([1, 2, 4], ddof=1))
  w = stats.welch([1.0, 1.1, 0.9], [2.0, 2.2, 1.8])
  assert w['diff'] == pytest.approx(-1.0) and w['t'] < -5 and w['p'] < 0.01
  assert stats.welch([1.0, 2.0, 3.0], [1.5, 2.5, 2.0])['p'] > 0.5
  p = stats.paired([1.0, 2.0, 3.0], [1.1, 2.1, 3.2])
  assert p['diff'] == pytest.approx(-4 / 30) and p['t'] < 0
  from scipy import stats as sps  # the interval scipy's own paired test gives
  ci = sps.ttest_rel([1.0, 2.0, 3.0], [1.1, 2.1, 3.2]).confidence_interval(0.95)
  assert p['ci95'] == pytest.approx([ci.low, ci.high])
  assert p['ci95'][0] < p['diff'] < p['ci95'][1]
  # Equal batches: the ratio estimator's standard error is 0; noisy ones: about std / sqrt(n).
  assert stats.batch_bpb_se([2.0] * 8, [1.0] * 8) == 0.0
  rng = np.random.default_rng(0)
  se = stats.batch_bpb_se(rng.normal(2.0, 0.1, 400), np.ones(400))
  assert se == pytest.approx(0.1 / 20 / np.log(2), rel=0.15)


def test_holm_adjusts_a_hand_computed_family():
  """Holm (1979) on p = (0.01, 0.04, 0.03, 0.005), by hand: sorted 0.005, 0.01, 0.03, 0.04
  times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04; running maximum 0.02, 0.03, 0.06, 0.06; back in
  the input order 0.03, 0.06, 0.06, 0.02."""
  assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
  assert stats.holm([0.5, 0.9]) == [1.0, 1.0]  # capped at 1
  assert stats.holm([0.2]) == [0.2] and stats.holm([]) == []
  # never below the raw p, and monotone in it
  ps = [0.001, 0.3, 0.02, 0.02, 0.7]
  adj = stats.holm(ps)
  assert all(a >= p for a, p in zip(adj, ps))
  assert [a for _, a in sorted(zip(ps, adj))] == sorted(adj)


def _per_run_metric(r, budget, metric):
  """The figure straight from a run's JSON, not through the script's lm_metrics."""
  ev = r['evals'][budget]
  return {'stdlib_bpb': ev['stdlib_val']['bpb'][0], 'heldout_bpb': ev['heldout']['bpb'][0],
          'steps': ev['step'], 'heldout_agree_1': (ev['heldout']['agree'] or [None])[0],
          'tau_T1': ev['decode'].get('T1', {}).get('tau')}[metric]


@pytest.mark.slow  # 21 s at load 1, 37 s at load 8-10 (2 cores): 4 tiny runs, 2 steps, 1 decoder
def test_sweep_tiny_tables_match_the_run_json_and_runs_resume(stdlib_data_dir, tmp_path):
  """2 seeds x 2 variants, a few steps: tables = mean/std of the saved runs; a rerun
  skips finished runs; a run stopped after a checkpoint resumes to the same result."""
  out, work = str(tmp_path / 'out'), str(tmp_path / 'work')
  args = A.parse(['--smoke', '--seeds', '0,1', '--groups', 'lm', '--variants', 'd0,d1',
                  '--temperatures', '1', '--out', out, '--workdir', work,
                  '--data_dir', stdlib_data_dir])
  runs = ablation_lib.make_runs(args)
  assert [(r.variant, r.seed) for r in runs] == [('d0', 0), ('d1', 0), ('d0', 1), ('d1', 1)]
  sweep = ablation_lib.make_sweep(args, runs)
  # Stop d1 seed 1 after its first checkpoint, as a killed sweep would; then resume it.
  last = runs[-1]
  for r in runs[:-1]:
    sweep.run(r)
  sweep.stop_at = last.save_every
  with pytest.raises(research.Interrupted):
    sweep.run(last)
  assert not sweep.finished(last)
  sweep.stop_at = None
  logs = []
  sweep.log = logs.append
  sweep.run(last)
  assert any(f'resumed at step {last.save_every}' in s for s in logs), logs
  resumed = sweep.saved(last)
  # The same run uninterrupted (a fresh output folder, the same compiled steps).
  fresh = research.Sweep(work + '2', out + '2')
  fresh._setups, fresh.lm_eval = sweep._setups, sweep.lm_eval  # pylint: disable=protected-access
  uninterrupted = fresh.run(last)
  for a, b in zip(resumed['curve'], uninterrupted['curve']):
    assert a['step'] == b['step']
    np.testing.assert_allclose(a['train_loss'], b['train_loss'], rtol=1e-5)
  for budget in tables.BUDGETS:
    np.testing.assert_allclose(resumed['evals'][budget]['heldout']['bpb'],
                               uninterrupted['evals'][budget]['heldout']['bpb'], rtol=1e-5)
  logs.clear()
  sweep.run(runs[0])
  assert any('finished, not rerun' in s for s in logs), logs

  summary = tables.tabulate(out, {0, 1})
  assert [n for n in os.listdir(out) if n.startswith('lm')] == ['lm.json']  # no .tmp left
  written = json.loads(pathlib.Path(out, 'lm.json').read_text())
  assert [(r['variant'], r['seed']) for r in written] == [
      ('d0', 0), ('d0', 1), ('d1', 0), ('d1', 1)]
  results = {(r['variant'], r['seed']): r for r in research.load_results(out, 'lm')}
  for budget in tables.BUDGETS:
    for v in ('d0', 'd1'):
      row = summary['lm'][budget][v]
      assert row['seeds'] == [0, 1]
      for metric in ('stdlib_bpb', 'heldout_bpb', 'steps', 'heldout_agree_1', 'tau_T1'):
        vals = [_per_run_metric(results[(v, s)], budget, metric) for s in (0, 1)]
        if v == 'd0' and metric in ('heldout_agree_1', 'tau_T1'):
          assert metric not in row['metrics']  # no MTP depth, no drafts
          continue
        m = row['metrics'][metric]
        assert m['per_seed'] == {0: vals[0], 1: vals[1]}
        assert m['mean'] == pytest.approx(np.mean(vals))
        assert m['std'] == pytest.approx(np.std(vals, ddof=1))
    assert summary['lm'][budget]['d1']['metrics']['steps']['mean'] == (
        runs[1].eval_at[budget])
    t = summary['tests'][budget]['d1 - d0 heldout_bpb']
    diff = [_per_run_metric(results[('d1', s)], budget, 'heldout_bpb')
            - _per_run_metric(results[('d0', s)], budget, 'heldout_bpb') for s in (0, 1)]
    assert t['paired']['diff'] == pytest.approx(np.mean(diff))
  eq = summary['lm']['equal_flops']
  assert eq['d1']['metrics']['steps']['mean'] < eq['d0']['metrics']['steps']['mean']
  assert eq['d1']['metrics']['train_tflop']['mean'] <= eq['d0']['metrics']['train_tflop']['mean']
  r = results[('d1', 0)]
  assert 0 < r['evals']['equal_tokens']['heldout']['tokens'] <= 2 * 4 * 64  # 2 batches of 4 x 64
  assert r['evaluation']['heldout']['documents'] > 0
  # every run of the sweep scored the same stdlib tokens, and says which
  assert {results[k]['evaluation']['stdlib_val']['fingerprint'] for k in results} == {
      research.batches_fingerprint(sweep.lm_eval.sets['stdlib_val'])}
  assert 0 <= r['evals']['equal_tokens']['decode']['T1']['acceptance_per_depth'][0] <= 1
  text = markdown_lib.markdown(summary)
  assert text.count('| d1 (M = 1 sequential) |') == 4 and 'Welch t' in text

  proc = subprocess.run([sys.executable, os.path.join(REPO, 'scripts', 'plot.py'),
                         f'--sweep={out}', f'--out={tmp_path / "figs"}'],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  figs = proc.stdout.split()
  assert [os.path.basename(p) for p in figs] == ['loss_vs_flops.png', 'acceptance_per_depth.png']
  for p in figs:
    data = pathlib.Path(p).read_bytes()
    assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 10_000


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
    losses.append(np.asarray(m['loss_sum']) / np.asarray(m['count']))  # [M + 1] per depth
  first, last = losses[0], np.mean(losses[-5:], axis=0)
  assert np.all(last < 0.3 * first), (first, last)  # every depth, the heads included
  model, _ = nnx.merge(ts.graphdef, state)
  dec = Decoder(model)
  prompts = [alphabet_ids(i * 3, 1 + i) for i in range(8)]
  ar = dec.generate(prompts, 24, num_drafts=0, eos_id=None)
  sp = dec.generate(prompts, 24, num_drafts=2, eos_id=None)
  for a, s in zip(ar.tokens, sp.tokens):
    np.testing.assert_array_equal(s, a)
  st = sp.stats()
  assert st['mean_accepted_length'] > 1.5 and st['acceptance_per_depth'][1] > 0, st


def test_the_committed_summary_is_the_tabulation_of_the_committed_runs(tmp_path):
  """benchmarks/research/summary.json and summary.md are, byte for byte, what `mtp-ablation
  --no_run` writes from the run and design files beside them, every time: the figures
  docs/research.md quotes come from those runs."""
  committed = os.path.join(REPO, 'benchmarks', 'research')
  for name in os.listdir(committed):
    if name.endswith('.json') and name != 'summary.json':
      shutil.copy(os.path.join(committed, name), tmp_path / name)
  for _ in range(2):
    ablation_lib.write_summary(str(tmp_path))
    for name in ('summary.json', 'summary.md'):
      with open(os.path.join(committed, name), 'rb') as f:
        assert (tmp_path / name).read_bytes() == f.read(), name


def test_the_tables_keep_every_finished_run_unless_no_run_names_seeds():
  """A run of a few seeds (or of one group) tabulates every finished run in --out, so the
  other groups' committed tables stay whole; only `--no_run --seeds` restricts the tables."""
  assert A.parse([]).seeds == [0, 1, 2] and A.parse([]).table_seeds is None
  ran = A.parse(['--groups', 'bpe_names', '--seeds', '3,4'])
  assert ran.seeds == [3, 4] and ran.table_seeds is None
  assert A.parse(['--no_run']).table_seeds is None
  assert A.parse(['--no_run', '--seeds', '0,2']).table_seeds == {0, 2}


def test_the_tables_read_no_file_of_the_checkout_on_import():
  """Importing the tables, their statistics and their markdown loads no config file and no
  benchmark result: the config modules come in as arguments or load on first use."""
  code = ('import builtins\n'
          'from mtp_jax import config_files\n'
          'loaded, opened = [], []\n'
          'load, real_open = config_files.load_module, builtins.open\n'
          'config_files.load_module = lambda p: (loaded.append(p), load(p))[1]\n'
          'builtins.open = lambda f, *a, **k: (opened.append(str(f)), real_open(f, *a, **k))[1]\n'
          'from mtp_jax.research import families, markdown, studies, tables\n'
          'builtins.open = real_open\n'
          'assert not loaded and not [f for f in opened if "benchmarks" in f], (loaded, opened)\n'
          'assert studies.ABLATION.BASELINE == "d0" and len(loaded) == 1, loaded\n')
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                        env={**os.environ, 'PYTHONPATH': REPO}, cwd=REPO)
  assert proc.returncode == 0, proc.stderr
