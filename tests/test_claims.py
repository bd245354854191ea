"""What the research tables let a claim rest on: exact sign-flip tests for few seeds,
equivalence only against a declared margin, outliers reported and kept, one Holm correction
over every test, and the studies declared before they run."""
import itertools
import math

import numpy as np
import pytest

from mtp_jax.research import design as design_lib
from mtp_jax.research import families, stats
from mtp_jax.research import markdown as markdown_lib


def _brute_sign_flip(d):
  obs = abs(sum(d))
  sums = [abs(sum(s * x for s, x in zip(signs, d)))
          for signs in itertools.product((1, -1), repeat=len(d))]
  return sum(v >= obs - 1e-12 for v in sums) / len(sums)


def test_the_sign_flip_test_is_exact_and_cannot_go_below_two_in_two_to_the_n():
  rng = np.random.default_rng(0)
  for n in (3, 5, 7):
    d = list(rng.normal(0.1, 1.0, n))
    assert stats.sign_flip(d) == pytest.approx(_brute_sign_flip(d))
  # five differences all of one sign: the least two-sided p five pairs can give
  assert stats.sign_flip([0.04, 0.03, 0.05, 0.02, 0.06]) == pytest.approx(2 / 32)
  assert stats.sign_flip([0.04, 0.03, 0.05, 0.02, 0.06], alternative='greater') == \
      pytest.approx(1 / 32)
  with pytest.raises(ValueError, match='alternative'):
    stats.sign_flip([1.0, 2.0], alternative='both')


def test_a_paired_test_of_at_most_ten_seeds_takes_the_exact_p():
  a = {s: 1.0 + 0.05 * s for s in range(5)}
  b = {s: 0.9 + 0.05 * s + 0.001 * s * s for s in range(5)}
  t = families.paired_test(a, b)
  assert t['test'] == 'sign-flip (exact)' and t['p'] == pytest.approx(2 / 32)
  assert t['p_t'] < 0.001 < t['p']  # the t test would call it; five pairs cannot
  many = families.paired_test({s: float(s) + 0.1 for s in range(12)},
                              {s: float(s) + 0.01 * (s % 3) for s in range(12)})
  assert many['test'] == 'paired t' and 'p_t' not in many


def test_equivalence_needs_the_interval_inside_the_margin():
  rng = np.random.default_rng(1)
  close = list(rng.normal(0.01, 0.05, 20))
  e = stats.equivalence(close, 0.1)
  assert e['p'] < 0.05 and -0.1 < e['ci90'][0] < e['ci90'][1] < 0.1
  assert stats.equivalence(close, 0.02)['p'] > 0.05  # the same data, a tighter margin
  far = [x + 0.2 for x in close]
  assert stats.equivalence(far, 0.1)['p'] > 0.5
  # the exact form: five pairs cannot show equivalence at 0.05 (least one-sided p 1/32 > 0)
  few = stats.equivalence([0.0, 0.01, -0.01, 0.005, 0.0], 0.1)
  assert few['test'] == 'sign-flip (exact)' and few['p'] == pytest.approx(1 / 32)


def test_outliers_are_flagged_by_the_modified_z_score():
  vals = {s: 3.2 + 0.02 * (s % 5) for s in range(20)}
  vals[18] = 3.976
  assert stats.outliers(vals) == {18: 3.976}
  assert stats.outliers({s: v for s, v in vals.items() if s < 4}) == {}  # too few to judge
  agg = families.aggregate({s: {'stdlib_bpb': v, 'steps': 1} for s, v in vals.items()})
  assert agg['stdlib_bpb']['outliers'] == {18: 3.976} and 'outliers' not in agg['steps']
  assert agg['stdlib_bpb']['n'] == 20  # reported, never left out


def _test(p, **extra):
  return {'p': p, 'diff': 0.0, 'ci95': [-1.0, 1.0], 't': 0.0, 'n': 20, 'sd': 1.0, 'mde': 1.0,
          'p_holm': p, 'family_size': 1, **extra}


def test_one_holm_correction_runs_over_every_test_the_summary_holds():
  summary = {
      'sized': {'equal_tokens': {'tests': {'a': _test(0.001), 'b': _test(0.04)}}},
      'compute': {'equal_flops': {'tests': {'c': _test(0.01)}}},
      'drafter': {'tests': {'d': _test(0.5, equivalence={'p': 0.002, 'margin': 0.1,
                                                         'ci90': [-0.05, 0.05],
                                                         'test': 'paired t'})}},
      'bpe_names': {'tests': {'e': _test(0.0625)}}, 'tests': {}}
  g = families.holm_global(summary)
  assert g['size'] == 6
  assert [k for *_, k in g['tests']].count('equivalence') == 1
  ps = [0.001, 0.04, 0.01, 0.5, 0.002, 0.0625]
  want = stats.holm(ps)
  got = [summary['sized']['equal_tokens']['tests']['a']['p_holm_global'],
         summary['sized']['equal_tokens']['tests']['b']['p_holm_global'],
         summary['compute']['equal_flops']['tests']['c']['p_holm_global'],
         summary['drafter']['tests']['d']['p_holm_global'],
         summary['drafter']['tests']['d']['equivalence']['p_holm_global'],
         summary['bpe_names']['tests']['e']['p_holm_global']]
  assert got == pytest.approx(want)
  # a test that survives its family but not the global correction says so, with its interval
  t = summary['sized']['equal_tokens']['tests']['b']
  t['p_holm'] = 0.04
  line = markdown_lib._test_line('b', t)  # pylint: disable=protected-access
  assert 'not after the global Holm' in line and 'between -1.0000 and +1.0000' in line


def test_the_compute_study_is_declared_with_its_primary_endpoint_and_seeds():
  spread = {'seeds': list(range(20)),
            'budgets': {'equal_flops': {'comparisons': {'d1 - d0 heldout': 0.1174},
                                        'pairs': {'d1 - d0 heldout': 13}}}}
  d = design_lib.compute_design(spread)
  assert d['primary'] == ['d1', 'd0', 'heldout_bpb', 'equal_flops']
  assert d['mde_at_seeds'] <= 0.05 < stats.min_detectable_effect(0.1174, d['seeds'] - 1)
  assert d['planning_dof'] == 12 and d['seeds_at_upper_sd'] > d['seeds']
  assert math.isclose(d['target_mde'], design_lib.TARGET_MDE)
  first = next(iter(design_lib.COMPUTE_FAMILIES.values()))[0]
  assert first == tuple(d['primary'][:3])  # the primary test leads its family


def test_the_compute_group_runs_d0_and_d1_on_the_deep_trunk_at_both_budgets(tmp_path):
  from mtp_jax.commands import ablation as command
  from mtp_jax.research import ablation, studies
  args = command.parse(['--groups', 'compute', '--seeds', '3', '--smoke', '--out', str(tmp_path),
                        '--workdir', str(tmp_path / 'w')])
  runs = ablation.make_runs(args)
  assert [(r.group, r.variant, r.seed) for r in runs] == [
      ('compute', 'd0@tokens', 3), ('compute', 'd1@tokens', 3), ('compute', 'd1@flops', 3)]
  layers = {r.config.model.n_layers for r in runs}
  assert layers == {studies.ABLATION.SMOKE_DEEP_LAYERS}
  steps = {r.variant: r.config.train.steps for r in runs}
  assert steps['d1@flops'] < steps['d1@tokens'] == steps['d0@tokens']
  # at the full shape one module is at most 15 % of a d1 step's training FLOPs
  from mtp_jax.train import flops
  f = flops.config_flops_per_token(studies.ABLATION.get_config('d1,decay,deep'))
  share = (f.mtp_eh_proj + f.mtp_block + f.vocab / 2) / f.forward
  two = flops.config_flops_per_token(studies.ABLATION.get_config('d1,decay'))
  assert share <= 0.15 < (two.mtp_eh_proj + two.mtp_block + two.vocab / 2) / two.forward
  with pytest.raises(ValueError, match='unknown argument'):
    studies.ABLATION.get_config('d1,deep')  # the deep trunk is the decayed sweep's only


def test_the_powered_induction_endpoints_and_their_censoring():
  from mtp_jax.research import tables
  curve = [{'step': s, 'copy_acc': a} for s, a in ((0, 0.0), (100, 0.1), (200, 0.2))]
  e = tables._induction_endpoints(curve)  # pylint: disable=protected-access
  assert e['copy_acc_auc'] == pytest.approx((0.05 * 100 + 0.15 * 100) / 200)
  assert e['steps_to_0.15'] == 200
  never = tables._induction_endpoints(curve[:2])  # pylint: disable=protected-access
  assert never['steps_to_0.15'] == 200  # censored: the last step plus one interval
