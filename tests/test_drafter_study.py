"""The drafter study (configs/drafter.py, the `drafter` group of mtp-ablation): arms on one
frozen trunk, endpoints and families declared in advance, the design, the tables, and the
whole group run at tiny steps."""
import json
import os

import numpy as np
import pytest

from helpers import REPO
from mtp_jax import config_lib
from mtp_jax.commands import ablation as A
from mtp_jax.research import ablation as ablation_lib
from mtp_jax.research import design as design_lib
from mtp_jax.research import families, stats, studies, tables
from mtp_jax.research import markdown as markdown_lib
from mtp_jax.research import results as results_lib

DRAFTER = studies.DRAFTER


def _flat(d, prefix=()):
  out = {}
  for k, v in d.items():
    out.update(_flat(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
  return out


@pytest.mark.parametrize('smoke', [False, True])
def test_arms_differ_from_ref_only_in_what_they_declare(smoke):
  """Every arm validates and differs from ref only in its declared fields; ref is ref's
  spec (M = 3 chained, frozen trunk); the trunk is the sized sweep's d0 at the design's
  equal-token steps; the families hold every arm against ref on both endpoints."""
  opt = ',smoke' if smoke else ''
  ref = DRAFTER.get_config('ref' + opt)
  config_lib.validate(ref)
  m = ref.model.mtp
  assert (m.depth, m.kind, m.freeze_trunk, m.curriculum, tuple(m.lambda_values)) == (
      3, 'sequential', True, 'none', (0.3,))
  assert ref.loss.mtp_targets == 'data' and not m.share_modules and not m.target_offsets
  flat_ref = _flat(json.loads(ref.to_json_best_effort()))
  for arm, fields in DRAFTER.ARMS.items():
    c = DRAFTER.get_config(arm + opt)
    config_lib.validate(c)
    flat = _flat(json.loads(c.to_json_best_effort()))
    differ = {'.'.join(k) for k in flat.keys() | flat_ref.keys() if flat.get(k) != flat_ref.get(k)}
    assert differ == set(fields), (arm, differ)
    assert c.train.steps == ref.train.steps  # the same steps and tokens per arm
  trunk = DRAFTER.get_config('trunk' + opt)
  sized_d0 = studies.ABLATION.get_config('d0,decay' + opt)
  sized_d0.train.steps = trunk.train.steps
  assert trunk.to_dict() == sized_d0.to_dict()
  if not smoke:
    with open(os.path.join(REPO, 'benchmarks', 'research', 'design.json')) as f:
      assert trunk.train.steps == json.load(f)['steps']
  assert set(DRAFTER.ARMS) == {design_lib.DRAFTER_REFERENCE, *design_lib.DRAFTER_ARMS}
  for family, tests in design_lib.DRAFTER_FAMILIES.items():
    assert sorted(t[0] for t in tests) == sorted(design_lib.DRAFTER_ARMS), family
    assert {t[1] for t in tests} == {'ref'} and len({t[2] for t in tests}) == 1
  assert {t[2] for ts in design_lib.DRAFTER_FAMILIES.values() for t in ts} == set(
      design_lib.DRAFTER_ENDPOINTS.values()) == {'tau_T1', 'tau_T0.7'}


def test_the_design_sizes_the_study_from_the_committed_tau_spread():
  """The planning spread pools the committed sweep's paired tau differences; the seeds
  are the fewest reaching the target MDE (at least 10), and the MDE at them is <= target."""
  spread = design_lib.committed_tau_spread(os.path.join(REPO, 'benchmarks', 'research'))
  sized = {(r['variant'], r['seed']): r for r in results_lib.load_results(
      os.path.join(REPO, 'benchmarks', 'research'), 'sized')}
  groups = []
  for v in ('d3f', 'd3r'):  # each curriculum over the seeds it shares with d3 (d3f: 7, d3r: 13)
    seeds = sorted(s for (name, s) in sized if name == f'{v}@tokens' and ('d3@tokens', s) in sized)
    groups.append([sized[(f'{v}@tokens', s)]['evals']['equal_tokens']['decode']['T1']['tau']
                   - sized[('d3@tokens', s)]['evals']['equal_tokens']['decode']['T1']['tau']
                   for s in seeds])
  assert len(groups[0]) >= 7 and len(groups[1]) >= 7
  assert spread['metrics']['tau_T1']['pooled_sd'] == pytest.approx(stats.pooled_sd(groups)[0])
  d = design_lib.drafter_design(spread)
  n, target = d['seeds'], d['target_mde']
  primary = d['per_endpoint']['tau_T1']
  assert n == max(10, primary['seeds_for_target'])
  assert primary['mde_at_seeds'] <= target < stats.min_detectable_effect(
      primary['pooled_sd'], primary['seeds_for_target'] - 1)
  assert primary['family_size'] == len(design_lib.DRAFTER_ARMS)
  assert primary['seeds_familywise'] >= primary['seeds_for_target']
  assert primary['seeds_at_upper_sd'] >= primary['seeds_familywise']


def _run(variant, seed, taus, bpb=3.0):
  """A drafter result as the sweep writes one, with the figures the tables read."""
  depth = 0 if variant == 'trunk' else 3
  decode = {} if not depth else {
      t: {'tau': taus[t], 'acceptance_per_depth': [0.5, 0.3, 0.2], 'distinct_4grams': 0.8}
      for t in ('T0', 'T1', 'T0.7')}
  corpus = {'bpb': [bpb] + [4.0] * depth, 'bpb_se_main': 0.01, 'agree': [0.6] * depth}
  mtp = {'depth': depth, 'kind': 'sequential', 'lambda_schedule': 'step', 'lambda_values': [0.3],
         'curriculum': 'none', 'share_modules': variant == 'shared', 'target_offsets': []}
  return {'group': 'drafter', 'variant': variant, 'seed': seed, 'depth': depth,
          'mtp_kind': 'sequential' if depth else None, 'steps': 6, 'tokens_per_step': 256,
          'config': {'model': {'mtp': mtp}, 'loss': {'mtp_targets': 'data'}},
          'evals': {'end': {'step': 6, 'flops': 1e9, 'stdlib_val': corpus, 'heldout': corpus,
                            'decode': decode}}}


def test_tables_pair_each_arm_with_ref_within_declared_families(tmp_path):
  """Per arm the mean of tau; per family the paired differences against ref with Holm's
  correction over the family's tests; the MDE per family; the markdown rows; --no_run
  twice writes the same bytes."""
  rng = np.random.default_rng(0)
  seeds = range(4)
  ref = {s: 2.5 + 0.1 * rng.standard_normal() for s in seeds}
  shift = {'shared': 0.3, 'self': -0.2, 'lamdecay': 0.0, 'fwd': 0.05, 'rev': -0.4, 'leap': -0.9}
  runs = [_run('trunk', s, {}) for s in seeds]
  for s in seeds:
    runs.append(_run('ref', s, {'T0': 3.0, 'T1': ref[s], 'T0.7': ref[s] + 0.1}))
    for arm, d in shift.items():
      noise = 0.05 * rng.standard_normal()
      runs.append(_run(arm, s, {'T0': 3.0, 'T1': ref[s] + d + noise,
                                'T0.7': ref[s] + 0.1 + d + noise}))
  for r in runs:
    results_lib.save_result(str(tmp_path), 'drafter', r)
  summary = tables.tabulate(str(tmp_path))
  dr = summary['drafter']
  assert list(dr['table']) == list(DRAFTER.VARIANTS)  # the trunk first, then ref and the arms
  assert dr['table']['shared']['share_modules'] and not dr['table']['ref']['share_modules']
  by = {(r['variant'], r['seed']): r for r in runs}
  for fam_name, members in design_lib.DRAFTER_FAMILIES.items():
    names = [f'{v} - {r} {m}' for v, r, m in members]
    ps = []
    for (v, r, m), name in zip(members, names):
      temp = m.split('_')[1]
      diffs = [by[(v, s)]['evals']['end']['decode'][temp]['tau']
               - by[(r, s)]['evals']['end']['decode'][temp]['tau'] for s in seeds]
      t = dr['tests'][name]
      assert t['diff'] == pytest.approx(np.mean(diffs)) and t['n'] == 4
      assert t['family'] == fam_name and t['family_size'] == len(members)
      assert t['ci95'][0] < t['diff'] < t['ci95'][1]
      ps.append(t['p'])
    for name, adj in zip(names, stats.holm(ps)):
      assert dr['tests'][name]['p_holm'] == pytest.approx(adj)
    assert dr['mde'][fam_name]['n'] == 4 and dr['mde'][fam_name]['mde'] > 0
  # four seeds: the exact sign-flip test, whose least p (2 / 2^4) no Holm family lets through
  leap = dr['tests']['leap - ref tau_T1']
  assert leap['test'] == 'sign-flip (exact)' and leap['p'] == pytest.approx(2 / 16)
  assert leap['p_holm'] >= 0.125 and leap['p_t'] < 0.05  # the t test would have called it
  text = markdown_lib.markdown(summary)
  assert '**Drafters on a frozen verifier**' in text
  assert '| shared (M = 3 sequential, one shared module) |' in text
  assert text.count(' - ref tau_T1: ') == len(design_lib.DRAFTER_ARMS)
  args = A.parse(['--groups', 'drafter', '--seeds', '0,1,2,3', '--out', str(tmp_path),
                  '--no_run'])
  ablation_lib.run(args)
  first = {n: (tmp_path / n).read_bytes() for n in ('summary.json', 'summary.md')}
  ablation_lib.run(args)
  assert first == {n: (tmp_path / n).read_bytes() for n in ('summary.json', 'summary.md')}
  assert json.loads(first['summary.json'])['drafter']['tests'].keys() == dr['tests'].keys()


def test_the_projected_speed_up_at_d768_is_tau_over_another_models_iteration_cost(tmp_path):
  """d768_iteration_costs reads only the d 768 model's batch-1 float32 rows with every
  draft taken; each run's speed-up is its tau at T over the cost at T with as many drafts
  as it drafted (one for a leap drafter), and a temperature the benchmark lacks has none."""
  def row(batch, temp, drafts, ratio, dtype='float32', threshold=0.0):
    return {'batch_size': batch, 'temperature': temp, 'num_drafts': drafts,
            'weight_dtype': dtype, 'draft_threshold': threshold, 'iteration_cost_ratio': ratio}
  small = {'d_model': 256, 'n_layers': 4}
  d768 = {'d_model': 768, 'n_layers': 12}
  bench = {'machine': {'cpu': 'test CPU'}, 'runs': [
      {'command': 'small', 'result': {'model': small, 'results': [row(1, 1.0, 3, 9.0)]}},
      {'command': 'd768', 'commit': 'abc', 'result': {'model': d768, 'results': [
          row(1, 1.0, 3, 2.0), row(1, 1.0, 1, 1.25), row(8, 1.0, 3, 7.0),
          row(1, 1.0, 2, 5.0, dtype='bfloat16'), row(1, 1.0, 2, 6.0, threshold=0.5)]}}]}
  path = tmp_path / 'decode_speed.json'
  path.write_text(json.dumps(bench))
  costs = studies.d768_iteration_costs(str(path))
  assert costs['cost_ratio'] == {'T1': {'3': 2.0, '1': 1.25}}
  assert (costs['command'], costs['commit'], costs['machine']) == ('d768', 'abc', 'test CPU')
  assert studies.d768_iteration_costs(str(tmp_path / 'none.json')) is None
  ref = _run('ref', 0, {'T0': 3.0, 'T1': 2.6, 'T0.7': 2.9})
  leap = _run('leap', 0, {'T0': 2.0, 'T1': 1.5, 'T0.7': 1.6})
  for t in ('T0', 'T1', 'T0.7'):
    leap['evals']['end']['decode'][t]['acceptance_per_depth'] = [0.5]
  dr = tables.tabulate_drafter([_run('trunk', 0, {}), ref, leap], d768=costs)
  metrics = {v: dr['table'][v]['metrics'] for v in ('ref', 'leap')}
  assert metrics['ref']['projected_speedup_d768_T1']['mean'] == pytest.approx(2.6 / 2.0)
  assert metrics['leap']['projected_speedup_d768_T1']['mean'] == pytest.approx(1.5 / 1.25)
  assert 'projected_speedup_d768_T0.7' not in dr['table']['ref']['metrics']
  assert 'projected_speedup_d768_T1' not in dr['table']['trunk']['metrics']
  assert dr['d768'] == costs
  text = '\n'.join(markdown_lib.markdown_drafter(dr))
  assert '| 1.30 |' in text and '2.00 (3 drafts)' in text
  assert 'Projected speed-up at d 768 (a projection, not a measurement' in text


def test_a_design_file_declares_the_families_the_tables_use(tmp_path):
  """Families in OUT/design.json's `drafter` key (written before the runs) are the ones the
  tables test, not design_lib's current ones."""
  (tmp_path / 'design.json').write_text(json.dumps(
      {'drafter': {'families': {'only shared': [['shared', 'ref', 'tau_T1']]}}}))
  assert tables.declared_drafter_families(str(tmp_path)) == {
      'only shared': [('shared', 'ref', 'tau_T1')]}
  assert tables.declared_drafter_families(str(tmp_path / 'none')) == {
      k: [tuple(t) for t in v] for k, v in design_lib.DRAFTER_FAMILIES.items()}


def test_each_seed_is_its_trunk_then_every_arm_started_from_it(tmp_path):
  """make_runs: per seed the trunk first (keeping its final state while an arm of the seed
  is unfinished), then every arm, started from that state; the same steps for every arm."""
  args = A.parse(['--groups', 'drafter', '--seeds', '3,5', '--out', str(tmp_path / 'out'),
                  '--workdir', str(tmp_path / 'work')])
  runs = ablation_lib.make_runs(args)
  assert [(r.variant, r.seed) for r in runs] == [(v, s) for s in (3, 5) for v in DRAFTER.VARIANTS]
  for s in (3, 5):
    trunk, *arms = [r for r in runs if r.seed == s]
    final = str(tmp_path / 'work' / 'drafter' / f'trunk_s{s}_final')
    assert trunk.keep_final == final and trunk.final_needed and not trunk.init_from
    assert trunk.steps == DRAFTER.TRUNK_STEPS
    assert all(a.init_from == final and not a.keep_final for a in arms)
    assert {a.steps for a in arms} == {DRAFTER.ARM_STEPS}
    assert all(a.config.seed == s == a.config.data.shuffle_seed for a in [trunk, *arms])
  for arm in DRAFTER.ARMS:  # every arm of seed 3 finished: its trunk is no longer needed
    results_lib.save_result(str(tmp_path / 'out'), 'drafter', {'variant': arm, 'seed': 3})
  needed = {r.seed: r.final_needed for r in ablation_lib.make_runs(args) if r.variant == 'trunk'}
  assert needed == {3: False, 5: True}
  only = A.parse(['--groups', 'drafter', '--seeds', '0', '--variants', 'shared'])
  assert [r.variant for r in ablation_lib.make_runs(only)] == ['trunk', 'shared']


@pytest.mark.slow  # 258 s at load 5 on 2 cores: 2 seeds x 3 tiny runs, 3 programs
def test_the_group_runs_on_one_frozen_trunk_resumes_and_tabulates(stdlib_data_dir, tmp_path):
  """--smoke, 2 seeds, ref and shared: every arm starts from its seed's trunk and keeps it
  frozen (the main head's held-out bpb of every arm is the trunk's, bit for bit); the arms
  differ in their drafting; the kept trunks are removed once every arm of their seed has
  finished; a rerun trains nothing; the summary has the drafter rows and tests. (The whole
  group: `mtp-ablation --smoke --groups drafter`, about 12 minutes here.)"""
  out, work = str(tmp_path / 'out'), str(tmp_path / 'work')
  argv = ['--smoke', '--groups', 'drafter', '--seeds', '0,1', '--variants', 'ref,shared',
          '--temperatures', '1,0.7', '--out', out, '--workdir', work,
          '--data_dir', stdlib_data_dir]
  assert A.main(argv) == 0
  runs = {(r['variant'], r['seed']): r for r in results_lib.load_results(out, 'drafter')}
  assert set(runs) == {(v, s) for v in ('trunk', 'ref', 'shared') for s in (0, 1)}
  for s in (0, 1):
    trunk = runs[('trunk', s)]['evals']['end']['heldout']['bpb'][0]
    for arm in ('ref', 'shared'):
      r = runs[(arm, s)]
      assert r['evals']['end']['heldout']['bpb'][0] == trunk, (arm, s)
      assert r['init_from'] == os.path.join('drafter', f'trunk_s{s}_final')
      assert r['config']['model']['mtp']['freeze_trunk']
    assert runs[('ref', s)]['evals']['end']['heldout']['bpb'][1:] != \
        runs[('shared', s)]['evals']['end']['heldout']['bpb'][1:]
  # the other arms have not run: the trunks stay for them
  assert os.path.isdir(os.path.join(work, 'drafter', 'trunk_s0_final'))
  summary = json.loads(open(os.path.join(out, 'summary.json')).read())
  assert set(summary['drafter']['table']) == {'trunk', 'ref', 'shared'}
  assert set(summary['drafter']['tests']) == {'shared - ref tau_T1', 'shared - ref tau_T0.7'}
  before = open(os.path.join(out, 'drafter.json')).read()
  assert A.main(argv) == 0  # everything asked for finished: nothing trains
  assert open(os.path.join(out, 'drafter.json')).read() == before


def test_design_command_adds_the_drafter_design_and_keeps_the_rest(tmp_path, monkeypatch,
                                                                    capsys):
  """`--design --groups drafter` writes design.json's `drafter` key (the families the tables
  then read, the seeds, the wall time from the measured seconds, the command) and leaves
  every other key as it was; the measuring is stubbed here (the sized design's test runs it)."""
  research = ablation_lib.research
  monkeypatch.setattr(research, 'measure_step_seconds', lambda c, n: 0.5 if c.model.mtp.depth
                      else 0.25)
  monkeypatch.setattr(research, 'measure_eval_seconds', lambda c, **kw: 2.0)
  (tmp_path / 'design.json').write_text(json.dumps({'steps': 1010, 'seeds': 7}))
  assert A.main(['--design', '--groups', 'drafter', '--out', str(tmp_path),
                 '--workdir', 'runs/drafter/workdirs']) == 0
  whole = json.loads((tmp_path / 'design.json').read_text())
  assert (whole['steps'], whole['seeds']) == (1010, 7)
  d = whole['drafter']
  n = d['seeds']
  assert n >= design_lib.DRAFTER_MIN_SEEDS and d['spread']['group'] == 'sized'
  per_seed = (DRAFTER.TRUNK_STEPS * 0.25 + 2.0
              + len(DRAFTER.ARMS) * (DRAFTER.ARM_STEPS * 0.5 + 2.0))
  assert d['per_seed_seconds'] == pytest.approx(per_seed)
  assert d['wall_seconds'] == pytest.approx(n * per_seed)
  assert d['command'] == (f'mtp-ablation --groups drafter --seeds '
                          f'{",".join(map(str, range(n)))} --out {tmp_path} '
                          '--workdir runs/drafter/workdirs')
  assert tables.declared_drafter_families(str(tmp_path)) == {
      k: [tuple(t) for t in v] for k, v in design_lib.DRAFTER_FAMILIES.items()}
  printed = capsys.readouterr().out
  assert 'primary endpoint tau_T1' in printed and d['command'] in printed


def test_figures_pair_only_runs_scored_on_the_same_corpus(tmp_path):
  """The held-out corpus is built from the installed packages and the stdlib split from the
  interpreter's library, so two machines can score a seed's runs on different corpora: a
  figure (tau here; bits per byte in the sized sweep) then pairs only the seeds whose two
  runs share its corpus, names the seeds left out, and a figure of the other corpus keeps
  every seed."""
  seeds = range(5)
  runs = []
  for s in seeds:
    for v in DRAFTER.VARIANTS:
      r = _run(v, s, {'T0': 3.0, 'T1': 2.5 + 0.01 * s + (0.3 if v == 'shared' else 0.0),
                      'T0.7': 2.6})
      # seed 0's shared arm ran where the packages (so the held-out corpus) differed
      r['evaluation'] = {'heldout': {'fingerprint': 'b' if (s, v) == (0, 'shared') else 'a'}}
      runs.append(r)
  for r in runs:
    results_lib.save_result(str(tmp_path), 'drafter', r)
  summary = tables.tabulate(str(tmp_path))
  dr = summary['drafter']
  shared, self_ = dr['tests']['shared - ref tau_T1'], dr['tests']['self - ref tau_T1']
  assert shared['n'] == 4 and shared['other_corpus_seeds'] == [0]
  assert self_['n'] == 5 and 'other_corpus_seeds' not in self_
  assert dr['mde']['drafter arms against the reference, tau at T = 1 (primary)']['n'] == 4
  assert 'seeds 0 left out (their two runs were scored on different held-out corpora)' in (
      markdown_lib.markdown(summary))
  a, b = {0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.5, 1: 1.5, 2: 2.5}
  table = {'x': {'metrics': {m: {'per_seed': a} for m in ('stdlib_bpb', 'heldout_bpb')}},
           'y': {'metrics': {m: {'per_seed': b} for m in ('stdlib_bpb', 'heldout_bpb')}}}
  scored = lambda heldout: {'evaluation': {'heldout': {'fingerprint': heldout}}}  # noqa: E731
  runs = {'x': {0: scored('a'), 1: scored('a'), 2: scored('b')},
          'y': {0: scored('a'), 1: scored('a'), 2: scored('a')}}
  tests, _ = families.family_tests(
      table, {'f': [('x', 'y', 'stdlib_bpb'), ('x', 'y', 'heldout_bpb')]}, runs)
  assert tests['x - y stdlib_bpb']['n'] == 3 and tests['x - y heldout_bpb']['n'] == 2
  assert tests['x - y heldout_bpb']['other_corpus_seeds'] == [2]
  # seed 1's x ran on another interpreter's standard library: only the stdlib figure drops it
  runs['x'][1]['evaluation']['stdlib_val'] = {'fingerprint': 'c'}
  runs['y'][1]['evaluation']['stdlib_val'] = {'fingerprint': 'a'}
  tests, _ = families.family_tests(
      table, {'f': [('x', 'y', 'stdlib_bpb'), ('x', 'y', 'heldout_bpb')]}, runs)
  assert tests['x - y stdlib_bpb']['other_corpus_seeds'] == [1]
  assert tests['x - y heldout_bpb']['other_corpus_seeds'] == [2]
  assert 'different stdlib validation splits' in markdown_lib._test_line(  # pylint: disable=protected-access
      'x - y stdlib_bpb', tests['x - y stdlib_bpb'])
  del runs['y'][1]['evaluation']['stdlib_val']  # a run that recorded no fingerprint pairs
  tests, _ = families.family_tests(table, {'f': [('x', 'y', 'stdlib_bpb')]}, runs)
  assert tests['x - y stdlib_bpb']['n'] == 3
  assert 'other_corpus_seeds' not in tests['x - y stdlib_bpb']
