"""scripts/plot.py writes non-empty PNGs from a run's metrics."""
import json
import os
import subprocess
import sys

import numpy as np

from helpers import REPO


def test_plot_script_writes_pngs(tiny_run, tmp_path):
  workdir, _ = tiny_run
  out = tmp_path / 'plots'
  proc = subprocess.run([sys.executable, os.path.join(REPO, 'scripts', 'plot.py'),
                         f'--workdir={workdir}', f'--out={out}'],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  files = sorted(os.listdir(out))
  # acceptance.png: plotting reads the eval/decode_* keys tiny_run's evals write
  assert {'loss_per_depth.png', 'accuracy_agreement.png', 'acceptance.png'} <= set(files)
  for f in files:
    data = (out / f).read_bytes()
    assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 10_000


def test_plot_script_missing_metrics_is_an_error(tmp_path):
  proc = subprocess.run([sys.executable, os.path.join(REPO, 'scripts', 'plot.py'),
                         f'--workdir={tmp_path}'], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and 'no metrics.jsonl' in proc.stderr


def _sized_run(variant: str, seed: int, depth: int, curriculum: str = 'none') -> dict:
  """A sized-sweep result with the fields the figures read, its numbers made up."""
  budget = 'equal_tokens' if variant.endswith('@tokens') else 'equal_flops'
  steps = 40 if budget == 'equal_tokens' else 20
  curve = [{'step': s, 'flops': s * 1e9 * (1 + depth), 'train_loss': [3.0 - s / 100] * (depth + 1)}
           for s in range(2, steps + 1, 2)]
  decode = {t: {'acceptance_per_depth': [0.6 / k for k in range(1, depth + 1)]}
            for t in ('T0', 'T1')}
  return {'variant': variant, 'seed': seed, 'depth': depth, 'mtp_kind': 'sequential',
          'steps': steps, 'flops_per_step': 1e9 * (1 + depth), 'curve': curve,
          'config': {'model': {'mtp': {'curriculum': curriculum}}},
          'evals': {budget: {'decode': decode, 'heldout': {'agree': [0.5] * depth}}}}


def test_sweep_figures_of_the_sized_sweep_plot_its_equal_token_runs(tmp_path, monkeypatch):
  """Each sized variant is two runs (equal tokens, equal FLOPs); the figures show the first
  under the variant's own name."""
  from mtp_jax.research import plotting

  runs = [_sized_run(f'{v}@{b}', s, d, c) for v, d, c in
          (('d0', 0, 'none'), ('d3', 3, 'none'), ('d3f', 3, 'forward'))
          for b in ('tokens', 'flops') for s in (0, 1) if not (v == 'd0' and b == 'flops')]
  (tmp_path / 'sized.json').write_text(json.dumps(runs))
  drawn = []
  monkeypatch.setattr(plotting, 'plot_sweep_loss', lambda rs, path: drawn.append(rs) or path)
  monkeypatch.setattr(plotting, 'plot_sweep_acceptance',
                      lambda rs, path: drawn.append(rs) or path)
  paths = plotting.plot_sweep(str(tmp_path))
  assert [os.path.basename(p) for p in paths] == ['sized_loss_vs_flops.png',
                                                  'sized_acceptance_per_depth.png']
  for rs in drawn:
    assert sorted({r['variant'] for r in rs}) == ['d0', 'd3', 'd3f']
    assert all(r['steps'] == 40 for r in rs)  # the equal-token runs only


def test_the_acceptance_figure_leaves_out_an_arm_that_cannot_draft(tmp_path):
  """TOP (`t1`) has an MTP depth but no decode evaluation: the sized figures are drawn
  without it instead of failing on its missing acceptance."""
  from mtp_jax.research import plotting

  runs = [_sized_run(f'{v}@tokens', s, d) for v, d in (('d0', 0), ('d3', 3), ('t1', 1))
          for s in (0, 1)]
  for r in runs:
    if r['variant'].startswith('t1'):
      r['mtp_kind'], r['evals']['equal_tokens']['decode'] = 'top', {}
  (tmp_path / 'sized.json').write_text(json.dumps(runs))
  paths = plotting.plot_sweep(str(tmp_path))
  for path in paths:
    data = open(path, 'rb').read()
    assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 10_000


def test_several_workdirs_overlay_in_one_figure_and_the_hint_names_the_trainer_setting(
    tmp_path, capsys):
  from mtp_jax.commands import plot
  for name, loss in (('a', 4.0), ('b', 3.0)):
    (tmp_path / name / 'run').mkdir(parents=True)
    rows = [{'step': s, 'train/loss_main': loss - s / 10, 'train/loss_mtp_1': loss,
             'train/acc_main': 0.3, 'train/acc_mtp_1': 0.2, 'train/agree_mtp_1': 0.5}
            for s in (10, 20)]
    rows.append({'step': 20, 'eval/bpb_main': loss / 2})
    (tmp_path / name / 'run' / 'metrics.jsonl').write_text(
        ''.join(json.dumps(r) + '\n' for r in rows))
  runs = [str(tmp_path / 'a' / 'run'), str(tmp_path / 'b' / 'run')]
  assert plot.main(['--workdir', *runs, '--out', str(tmp_path / 'out')]) == 0
  data = (tmp_path / 'out' / 'compare_runs.png').read_bytes()
  assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 10_000
  from mtp_jax.research import plotting
  assert plotting.run_labels(runs) == ['a/run', 'b/run']  # the runs told apart in the legend
  capsys.readouterr()
  assert plot.main(['--workdir', runs[0], '--out', str(tmp_path / 'one')]) == 0
  hint = capsys.readouterr().out.strip().splitlines()[-1]
  assert 'train.eval_decode_prompts' in hint and 'mtp-eval' in hint and 'never writes' in hint


def test_the_paper_protocol_and_drafter_figures(tmp_path, monkeypatch):
  """bpe_names draws one induction figure per trunk size, each variant under its own name
  with the chance level the tables computed; the drafter figure plots each arm's tau minus
  the reference's on the same trunk, so it needs no trunk row and leaves the trunk out."""
  from mtp_jax.research import plotting

  model = {'d_model': 128, 'n_layers': 5, 'n_heads': 4, 'n_kv_heads': 4, 'head_dim': 32,
           'mlp_dim': 384}
  bpe = [{'variant': f'{v}@{size}', 'seed': s, 'depth': int(v != 'd0'), 'mtp_kind': 'parallel',
          'config': {'model': model},
          'curve': [{'step': i, 'flops': i * 1e9, 'copy_acc': 0.01 * i} for i in range(4)]}
         for v in ('d0', 'n2') for size in ('1m', '3m') for s in (0, 1)]
  drafter = [{'variant': v, 'seed': s, 'depth': 0 if v == 'trunk' else 3, 'mtp_kind': 'sequential',
              'evals': {'end': {'decode': {} if v == 'trunk' else {
                  t: {'tau': 2.0 + 0.1 * s + (0.5 if v == 'fwd' else 0)}
                  for t in ('T0', 'T1', 'T0.7')}}}}
             for v in ('trunk', 'ref', 'fwd') for s in (0, 1, 2)]
  (tmp_path / 'bpe_names.json').write_text(json.dumps(bpe))
  (tmp_path / 'drafter.json').write_text(json.dumps(drafter))
  (tmp_path / 'summary.json').write_text(json.dumps({'bpe_names': {'chance': 0.009}}))
  drawn = []
  real = plotting.plot_induction
  monkeypatch.setattr(plotting, 'plot_induction',
                      lambda rs, path, chance, title: drawn.append((rs, chance, title))
                      or real(rs, path, chance, title))
  paths = plotting.plot_sweep(str(tmp_path))
  assert [os.path.basename(p) for p in paths] == ['bpe_names_1m.png', 'bpe_names_3m.png',
                                                  'drafter_tau.png']
  for rs, chance, title in drawn:
    assert sorted({r['variant'] for r in rs}) == ['d0', 'n2'] and len(rs) == 4
    assert chance == 0.009 and 'random two-token names' in title
  assert '1.06 M non-embedding parameters' in drawn[0][2]
  diffs = plotting.tau_differences(drafter)
  assert list(diffs) == ['T1', 'T0.7'] and list(diffs['T1']) == ['fwd']
  np.testing.assert_allclose(diffs['T0.7']['fwd'], [0.5] * 3)
  for path in paths:
    data = open(path, 'rb').read()
    assert data[:8] == b'\x89PNG\r\n\x1a\n' and len(data) > 10_000
