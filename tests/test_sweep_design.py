"""The sized sweep: the minimum detectable effect, the design chosen from the committed
spread, its variants and budgets, and name-story induction (task, runs, resumption)."""
import dataclasses
import json
import math
import os
import platform

import jax
import numpy as np
import pytest

from helpers import REPO
from mtp_jax import config_lib
from mtp_jax.commands import ablation as A
from mtp_jax.data import induction
from mtp_jax.research import ablation as ablation_lib
from mtp_jax.research import design as design_lib
from mtp_jax.research import markdown as markdown_lib
from mtp_jax.research import results as results_lib
from mtp_jax.research import stats, studies, tables
from mtp_jax.research import sweep as research

COMMITTED = os.path.join(REPO, 'benchmarks', 'research')


def test_minimum_detectable_effect_has_the_stated_power():
  """At the MDE the paired t test rejects in ~80 % of simulated experiments (alpha 0.05);
  it shrinks with n, and seeds_for_effect is the first n that reaches a target."""
  from scipy import stats as sps
  sd, n = 0.1, 8
  mde = stats.min_detectable_effect(sd, n)
  rng = np.random.default_rng(0)
  d = rng.normal(mde, sd, (20000, n))
  p = sps.ttest_1samp(d, 0.0, axis=1).pvalue
  assert abs(np.mean(p < 0.05) - 0.8) < 0.015
  assert stats.paired_power(mde, sd, n) == pytest.approx(0.8, abs=1e-6)
  assert stats.min_detectable_effect(sd, 20) < mde < stats.min_detectable_effect(sd, 5)
  need = stats.seeds_for_effect(0.05, sd)
  assert stats.min_detectable_effect(sd, need) <= 0.05 < stats.min_detectable_effect(sd, need - 1)
  assert stats.min_detectable_effect(sd, 1) == math.inf
  # the large-sample limit: (z_0.975 + z_0.8) sd / sqrt(n)
  assert stats.min_detectable_effect(sd, 400) == pytest.approx(2.8016 * sd / 20, rel=0.01)
  sd_pooled, dof = stats.pooled_sd([[1.0, 2.0, 3.0], [10.0, 12.0]])
  assert dof == 3 and sd_pooled == pytest.approx(math.sqrt((2 + 2) / 3))


def test_committed_spread_pools_the_paired_differences():
  spread = design_lib.committed_spread(COMMITTED)
  _, by = design_lib.committed_evals(COMMITTED)
  seeds = spread['seeds']
  groups = []
  fingerprint = results_lib.corpus_fingerprint
  unpaired = 0
  for v in sorted({v for v, _, _ in by} - {'d0'}):
    for corpus in ('stdlib_val', 'heldout'):  # each arm over the seeds it ran (d3f: 7 of 13)
      ran = [s for s in seeds if (v, 'equal_tokens', s) in by]
      # a difference pairs two runs scored on one corpus
      paired = [s for s in ran if fingerprint(by[(v, 'equal_tokens', s)], corpus)
                == fingerprint(by[('d0', 'equal_tokens', s)], corpus)]
      unpaired += len(ran) - len(paired)
      groups.append([by[(v, 'equal_tokens', s)]['evals']['equal_tokens'][corpus]['bpb'][0]
                     - by[('d0', 'equal_tokens', s)]['evals']['equal_tokens'][corpus]['bpb'][0]
                     for s in paired])
  assert unpaired == 7  # t1's seeds 0-6 were scored on another held-out corpus than d0's
  tok = spread['budgets']['equal_tokens']
  assert tok['dof'] == sum(len(g) - 1 for g in groups)
  assert tok['pooled_sd'] == pytest.approx(stats.pooled_sd(groups)[0])
  assert len(seeds) >= 3 and spread['tokens_per_run'] == spread['steps'] * spread['tokens_per_step']


def test_a_sized_sweeps_spread_pairs_each_budget_with_the_baselines_one_run(tmp_path):
  """Sized runs are one budget each (d1@tokens, d1@flops); d0's one equal-token run is the
  reference of both, as in the tables."""
  def run(variant, seed, budget, bpb):
    return {'variant': variant, 'seed': seed, 'steps': 100, 'tokens_per_step': 64,
            'evals': {budget: {'stdlib_val': {'bpb': [bpb]}, 'heldout': {'bpb': [bpb + 1]}}}}
  runs = []
  for s, base in enumerate((3.0, 3.2, 3.1)):
    runs += [run('d0@tokens', s, 'equal_tokens', base),
             run('d1@tokens', s, 'equal_tokens', base - 0.1 * (s + 1)),
             run('d1@flops', s, 'equal_flops', base + 0.2 * s)]
  (tmp_path / 'sized.json').write_text(json.dumps(runs))
  spread = design_lib.committed_spread(str(tmp_path))
  assert spread['group'] == 'sized' and spread['seeds'] == [0, 1, 2]
  assert spread['tokens_per_run'] == 6400
  tok, flops = spread['budgets']['equal_tokens'], spread['budgets']['equal_flops']
  assert tok['pooled_sd'] == pytest.approx(0.1) and tok['dof'] == 4  # -0.1, -0.2, -0.3
  assert flops['pooled_sd'] == pytest.approx(0.2) and flops['dof'] == 4  # 0, 0.2, 0.4


def _spread(sd=0.1):
  return {'seeds': [0, 1, 2], 'steps': 320, 'tokens_per_step': 1024,
          'tokens_per_run': 320 * 1024,
          'budgets': {'equal_tokens': {'pooled_sd': sd, 'dof': 12, 'comparisons': {}},
                      'equal_flops': {'pooled_sd': 2 * sd, 'dof': 12, 'comparisons': {}}}}


def _runs_for(steps):
  return [('d0', 'tokens', steps), ('d1', 'tokens', steps), ('d1', 'flops', steps // 2)]


@pytest.mark.parametrize('hours,sd,case', [
    (100.0, 0.05, 'target met'), (2.0, 0.1, 'the most seeds'), (0.5, 0.1, 'over budget')])
def test_design_choice(hours, sd, case):
  step_s, eval_s = {'d0': 0.1, 'd1': 0.2}, {'d0': 5.0, 'd1': 5.0}
  d = design_lib.choose(_spread(sd), _runs_for, step_s, eval_s, budget_hours=hours)
  per = lambda s: sum(step_s[v] * n + eval_s[v] for v, _, n in _runs_for(s))  # noqa: E731
  assert d['case'].startswith(case)
  assert d['steps'] >= 960 and d['steps'] % 10 == 0 and d['seeds'] >= 5
  assert d['wall_seconds'] == pytest.approx(d['seeds'] * per(d['steps']))
  assert d['min_detectable_effect']['equal_tokens'] == pytest.approx(
      stats.min_detectable_effect(sd, d['seeds']))
  if case == 'over budget':
    assert (d['seeds'], d['steps'], d['fits_budget']) == (5, 960, False)
    return
  assert d['fits_budget'] and d['seeds'] * per(d['steps'] + 10) > hours * 3600  # the largest
  if case == 'target met':
    assert d['seeds'] == max(5, d['seeds_needed_for_target'])
    assert d['min_detectable_effect']['equal_tokens'] <= 0.05
  else:
    assert d['seeds'] == int(hours * 3600 // per(960)) < d['seeds_needed_for_target']
  assert 'Chosen' in design_lib.describe(d)


def test_sized_variants_and_budgets():
  base = studies.ABLATION.get_config('d0,decay')
  flat = lambda c: {k: v for k, v in config_lib.base_config().items()}  # noqa: E731,F841
  for v, (depth, kind, cur) in studies.ABLATION.SIZED_VARIANTS.items():
    c = studies.ABLATION.get_config(v + ',decay')
    config_lib.validate(c)
    assert (c.model.mtp.depth, c.model.mtp.kind, c.model.mtp.curriculum) == (depth, kind, cur)
    assert c.train.min_lr_ratio == 0.1 and c.model.d_model == base.model.d_model
  runs = ablation_lib.sized_runs(960)
  assert runs[0] == ('d0', 'tokens', 960) and len(runs) == 13
  flops = {v: n for v, b, n in runs if b == 'flops'}
  assert flops['d3'] == flops['d3f'] == flops['d3r'] < flops['d1'] < 960  # same compiled shapes
  # TOP adds one [D, V] unembedding and no block: cheaper than a sequential module
  assert flops['d1'] < flops['t1'] < 960
  with pytest.raises(ValueError, match='unknown argument'):
    studies.ABLATION.get_config('d3f')  # the curricula exist in the sized sweep only


def test_name_stories_score_the_second_token_at_the_second_mention():
  task = induction.NameStoryTask(seq_len=128)
  a, b = task.batch(3, 7, 16), task.batch(3, 7, 16)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a['tokens'], task.batch(3, 8, 16)['tokens'])
  text, scored = task.story(np.random.default_rng(5))
  for c in scored:  # the scored letter is a name's 2nd letter, and that name occurred before
    start = c - 1
    end = start + next(i for i, ch in enumerate(text[start:] + ' ') if not ch.isalpha())
    name = text[start:end]
    assert name[0].isupper() and name[1:].islower() and len(name) >= 3
    assert text.count(name) >= 2 and text.find(name) < start
    assert text.find(name, text.find(name) + 1) == start  # the second mention
  tok, mask, seg = a['tokens'], a['copy_mask'], a['segment_ids']
  assert mask.sum() >= 16 and seg.min() >= 1  # rows are full of stories, no padding
  raw = (tok - 2).astype(np.uint8)
  for r, i in zip(*np.nonzero(mask)):
    assert chr(raw[r, i]).islower() and chr(raw[r, i - 1]).isupper()
    # the name's first mention in the same story has the same two letters
    same = np.nonzero(seg[r] == seg[r, i])[0]
    before = [j for j in same if j < i - 1 and raw[r, j] == raw[r, i - 1]]
    assert any(raw[r, j + 1] == raw[r, i] for j in before)
  # a perfect copier scores 1
  copier = np.zeros_like(tok)
  for r, i in zip(*np.nonzero(mask)):
    j = next(j for j in range(i - 1) if seg[r, j] == seg[r, i] and tok[r, j] == tok[r, i - 1])
    copier[r, i - 1] = tok[r, j + 1]
  assert induction.copy_accuracy(copier, a) == 1.0
  assert isinstance(induction.make_task(64, **studies.NAMES.TASK), induction.NameStoryTask)
  with pytest.raises(ValueError, match='kind'):
    induction.make_task(64, kind='cards')


def test_sized_and_names_sweeps_run_resume_and_tabulate(stdlib_data_dir, tmp_path):
  """Tiny sized (d0, d3r) and names (d0, p2) runs, 2 seeds: a sized run stopped after its
  checkpoint resumes to the uninterrupted result; the tables carry the minimum detectable
  effect; the names table reads equal steps and equal FLOPs off the curves."""
  out, work = str(tmp_path / 'out'), str(tmp_path / 'work')
  args = A.parse(['--smoke', '--seeds', '0,1', '--groups', 'sized,names', '--variants',
                  'd0,d3r,p2', '--temperatures', '0', '--out', out, '--workdir', work,
                  '--data_dir', stdlib_data_dir])
  runs = ablation_lib.make_runs(args)
  names = [(r.group, r.variant, r.seed) for r in runs]
  assert names[:3] == [('sized', 'd0@tokens', 0), ('sized', 'd3r@tokens', 0),
                       ('sized', 'd3r@flops', 0)]
  assert ('names', 'p2', 1) in names and all(r.steps == studies.NAMES.SMOKE_STEPS
                                             for r in runs if r.group == 'names')
  sweep = ablation_lib.make_sweep(args, runs)
  last = [r for r in runs if r.group == 'sized' and r.steps > r.save_every][-1]  # d3r@tokens, s1
  story = [r for r in runs if r.group == 'names'][-1]  # p2, seed 1
  for r in runs:
    if r is not last and r is not story:
      sweep.run(r)
  fresh = research.Sweep(work + '2', out + '2')
  # pylint: disable=protected-access
  fresh._setups, fresh.lm_eval, fresh.induction_evals = (sweep._setups, sweep.lm_eval,
                                                          sweep.induction_evals)
  results = {}
  for run in (last, story):
    sweep.stop_at = run.save_every
    with pytest.raises(research.Interrupted):
      sweep.run(run)
    sweep.stop_at = None
    results[run.group] = sweep.run(run), fresh.run(run)
    for a, b in zip(*(r['curve'] for r in results[run.group])):
      assert a['step'] == b['step'] and a.get('copy_acc') == b.get('copy_acc')
      np.testing.assert_allclose(a.get('train_loss', 0), b.get('train_loss', 0), rtol=1e-5)
  # A run keeping its final state, trained again after its result was removed (a seed whose
  # arms were not all finished), replaces the state it kept before.
  again = research.Sweep(work + '3', out + '3')
  again._setups, again.lm_eval, again.induction_evals = (sweep._setups, sweep.lm_eval,
                                                          sweep.induction_evals)
  kept = dataclasses.replace(story, keep_final=str(tmp_path / 'kept'))
  first = again.run(kept)
  os.remove(again.result_path(kept))
  assert again.run(kept)['curve'] == first['curve'] and research.has_final(kept)
  resumed, straight = results['sized']
  for r in (resumed, straight, *results['names']):  # where its train_seconds were taken
    assert r['host']['cpu'] and r['host']['cores'] >= 1 and len(r['host']['load_average']) == 3
    assert r['host']['python'] == platform.python_version()
    assert r['host']['jax'] == jax.__version__
  assert [p['step'] for p in results['names'][0]['curve'] if 'copy_acc' in p] == [0, 4, 8]
  budget = next(iter(last.eval_at))
  np.testing.assert_allclose(resumed['evals'][budget]['heldout']['bpb'],
                             straight['evals'][budget]['heldout']['bpb'], rtol=1e-5)
  assert len(resumed['evals'][budget]['heldout']['bpb']) == 4  # every depth, curriculum or not
  summary = tables.tabulate(out, {0, 1})
  tok = summary['sized']['equal_tokens']
  assert set(tok['table']) == {'d0', 'd3r'} and tok['table']['d3r']['curriculum'] == 'reverse'
  # a main-head arm (design_lib.MAIN_HEAD_ARMS): its tests carry Holm's p, the MDE pools it
  t = tok['tests']['d3r - d0 stdlib_bpb']
  assert t['family'] == 'main head against d0' and t['family_size'] == 2 and t['p_holm'] >= t['p']
  assert tok['mde']['stdlib_bpb']['n'] == 2 and tok['mde']['stdlib_bpb']['arms'] == ['d3r']
  assert summary['sized']['equal_flops']['table']['d3r']['metrics']['steps']['mean'] < \
      tok['table']['d3r']['metrics']['steps']['mean']
  nm = summary['names']
  assert set(nm['table']) == {'d0', 'p2'}
  p2 = nm['table']['p2']['metrics']
  assert p2['equal_flop_step']['mean'] < studies.NAMES.SMOKE_STEPS
  assert 'p2 - d0 copy accuracy, equal FLOPs' in nm['tests']
  text = markdown_lib.markdown(summary)
  assert 'Minimum detectable paired effect on stdlib_bpb' in text
  # A restarted sweep builds its runs afresh (vocabulary size still 0) and skips the finished
  # ones: every result is found, none refused as another config's.
  restarted = research.Sweep(work, out)
  assert all(restarted.saved(r) is not None for r in ablation_lib.make_runs(args))
  assert 'minimum detectable effect' in text and 'stories with random names' in text


def test_design_command_measures_prints_and_saves(tmp_path, capsys):
  """--design at smoke size: the step times are measured, the design printed with the
  command to run, and OUT/design.json is what the sized group then reads its steps from."""
  out = str(tmp_path / 'design')
  assert A.main(['--design', '--smoke', '--out', out, '--measure_steps', '1',
                 '--temperatures', '0', '--budget_hours', '0.5']) == 0
  text = capsys.readouterr().out
  d = json.load(open(os.path.join(out, 'design.json')))
  assert d['seeds'] >= 5 and d['steps'] >= 960 and d['runs_per_seed'] == 13
  assert all(d['step_seconds'][v] > 0 for v in studies.ABLATION.SIZED_VARIANTS)
  assert d['step_seconds']['d3f'] == d['step_seconds']['d3']  # measured once per shape
  assert f"--sized_steps {d['steps']}" in text and 'Minimum detectable paired effect' in text
  assert d['names']['wall_seconds'] > 0 and 'mtp-ablation --groups names' in text
  # the main-head arms: seeds to the target at the committed spread, the command that adds
  # them, and the families of tests the tables will correct within
  mh = d['main_head']
  assert mh['mde_at_seeds'] <= design_lib.TARGET_MDE
  assert mh['seeds_at_upper_sd'] >= mh['seeds']
  if mh['mde_committed'] > design_lib.TARGET_MDE:  # seeds still to add, and their time
    assert mh['seeds'] > len(mh['committed_seeds']) and mh['wall_seconds_to_add'] > 0
  else:  # the committed seeds reach the target: nothing left to run
    assert mh['seeds'] <= len(mh['committed_seeds']) and mh['wall_seconds_to_add'] == 0
  assert mh['command'] in text and '--variants d0,d1,d3,d3r,t1' in mh['command']
  assert set(d['families']) == set(design_lib.FAMILIES)
  args = A.parse(['--groups', 'sized', '--out', out])
  assert ablation_lib.sized_steps(args) == d['steps']
  assert A.main(['--groups', 'sized', '--out', str(tmp_path / 'none'), '--seeds', '0']) == 2
  assert 'run mtp-ablation --design' in capsys.readouterr().err


def test_a_failure_inside_the_sweep_reads_as_one_line(monkeypatch, capsys):
  """An expected failure while the sweep runs (a checkpoint that cannot be saved) is one
  `error:` line and exit 2; anything else keeps its traceback."""
  from mtp_jax.checkpoint.store import CheckpointError
  def fail(args):
    raise CheckpointError('could not save the checkpoint of step 3 in /x (disk full)')
  monkeypatch.setattr(ablation_lib, 'run', fail)
  assert A.main(['--groups', 'drafter', '--seeds', '0']) == 2
  err = capsys.readouterr().err
  assert err == 'error: could not save the checkpoint of step 3 in /x (disk full)\n'
  monkeypatch.setattr(ablation_lib, 'run', lambda args: 1 / 0)
  with pytest.raises(ZeroDivisionError):
    A.main(['--groups', 'drafter', '--seeds', '0'])
