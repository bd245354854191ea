"""The sweep's tables as markdown (OUT/summary.md): per group the aggregated figures, and
each test with its interval, its Holm-adjusted p and what it establishes.
"""
from __future__ import annotations

from mtp_jax.research.families import metric_corpus
from mtp_jax.research.tables import BUDGETS, TEMP_NAMES, TEMPS


def _pm(m: dict, fmt: str = '{:.3f}') -> str:
  if m is None or m['mean'] is None:
    return 'n.a.'
  if m['n'] < 2:
    return fmt.format(m['mean'])
  return f'{fmt.format(m["mean"])} ± {fmt.format(m["std"])}'


def _seeds(m: dict, fmt: str = '{:.3f}') -> str:
  return ' / '.join('n.a.' if v is None else fmt.format(v) for v in m['per_seed'].values())


def markdown(summary: dict) -> str:
  out = []
  for budget, title in BUDGETS.items():
    table = summary['lm'].get(budget, {})
    if not table:
      continue
    ns = sorted({len(row['seeds']) for row in table.values()})
    out += [f'**{title[0].upper() + title[1:]}** (mean ± std over seeds, '
            f'n = {"/".join(map(str, ns))}; '
            'bpb = bits per byte of the main head; agreement = teacher-forced agreement of '
            'MTP depth k with the main head, held-out; tau = tokens per verify step)', '',
            '| variant | steps | train TFLOP | stdlib val bpb | held-out bpb | '
            'agreement per depth | tau greedy | tau T = 1 | tau T = 0.7 | '
            'distinct 4-grams, greedy / T = 1 |',
            '|---|---|---|---|---|---|---|---|---|---|']
    for v, row in table.items():
      m = row['metrics']
      agree = ' / '.join(_pm(m[f'heldout_agree_{k}'], '{:.2f}')
                         for k in range(1, row['depth'] + 1)) or 'n.a.'
      taus = [_pm(m.get(f'tau_{t}'), '{:.2f}') if row['depth'] else '1 (n.a.)' for t in TEMPS]
      distinct = ' / '.join(f'{m[f"distinct4_{t}"]["mean"]:.2f}' for t in ('T0', 'T1')
                            if f'distinct4_{t}' in m) or 'n.a.'
      out.append(f'| {_label(v, row)} | {_pm(m["steps"], "{:.0f}")} | '
                 f'{_pm(m["train_tflop"], "{:.2f}")} | {_pm(m["stdlib_bpb"])} | '
                 f'{_pm(m["heldout_bpb"])} | {agree} | {" | ".join(taus)} | {distinct} |')
    se = [row['metrics'][k]['mean'] for row in table.values()
          for k in ('stdlib_bpb_se', 'heldout_bpb_se')]
    out += ['', f'Standard error of one run\'s bpb estimate (eval sampling, batch-level): '
            f'{min(se):.3f}-{max(se):.3f} bits; every run is scored on the same batches.', '',
            'Each seed (seeds ' + ', '.join(str(s) for s in next(iter(table.values()))['seeds'])
            + '):', '', '| variant | stdlib val bpb | held-out bpb | tau greedy | tau T = 1 | '
            'tau T = 0.7 | acceptance per depth, T = 1 (mean) |', '|---|---|---|---|---|---|---|']
    for v, row in table.items():
      m = row['metrics']
      taus = [_seeds(m[f'tau_{t}'], '{:.2f}') if f'tau_{t}' in m else 'n.a.' for t in TEMPS]
      acc = ' / '.join(f'{m[f"accept_T1_{k}"]["mean"]:.2f}' for k in range(1, row['depth'] + 1)
                       if f'accept_T1_{k}' in m) or 'n.a.'
      out.append(f'| {_label(v, row)} | {_seeds(m["stdlib_bpb"])} | {_seeds(m["heldout_bpb"])} | '
                 f'{" | ".join(taus)} | {acc} |')
    tests = summary['tests'].get(budget, {})
    if tests:
      out += ['', 'Differences (negative bpb = better than M = 0): Welch t over seeds, and '
              'paired t over seeds (same seed = same data order and trunk init):', '']
      for name, t in tests.items():
        w = t['welch']
        line = f'- {name}: {w["diff"]:+.4f}, Welch t = {w["t"]:.2f}, p = {w["p"]:.3f}'
        if 'paired' in t:
          line += (f'; paired t = {t["paired"]["t"]:.2f}, p = {t["paired"]["p"]:.3f}; eval '
                   f'SE of one seed\'s difference {t["eval_se_of_difference"]:.4f}')
        out.append(line + _holm_note(t))
    out.append('')
  ind = summary['induction']
  if ind:
    alphabet = ind_alphabet(summary)
    out += ['**Induction** (equal training FLOPs; copy accuracy = top-1 accuracy of the main '
            'head on the second occurrence of the repeated span, after its first token; '
            f'chance 1/{alphabet})', '',
            '| variant | steps | train TFLOP | copy accuracy after 1/4 of the FLOPs | '
            'after 1/2 | at the end | at the end, each seed | M = 0 at the same step |',
            '|---|---|---|---|---|---|---|---|']
    for v, row in ind.items():
      m = row['metrics']
      out.append(f'| {v} (M = {row["depth"]}) | {_pm(m["steps"], "{:.0f}")} | '
                 f'{_pm(m["train_tflop"], "{:.3f}")} | {_pm(m["copy_acc_quarter"])} | '
                 f'{_pm(m["copy_acc_half"])} | {_pm(m["copy_acc_final"])} | '
                 f'{_seeds(m["copy_acc_final"])} | '
                 f'{_pm(m.get("d0_copy_acc_same_step")) if row["depth"] else "-"} |')
    out.append('')
    for name, t in summary['tests'].get('induction', {}).items():
      w = t['welch']
      line = f'- {name}: {w["diff"]:+.3f}, Welch t = {w["t"]:.2f}, p = {w["p"]:.3f}'
      if 'paired' in t:
        line += f'; paired t = {t["paired"]["t"]:.2f}, p = {t["paired"]["p"]:.3f}'
      out.append(line + _holm_note(t))
  if summary.get('sized'):
    out += [''] + markdown_sized(summary['sized'])
  if summary.get('compute'):
    out += [''] + markdown_sized(summary['compute'], 'Compute study (the ,deep trunk)')
  if summary.get('names'):
    out += [''] + markdown_names(summary['names'])
  if summary.get('bpe_names'):
    out += [''] + markdown_names(summary['bpe_names'], BPE_TITLE)
  if summary.get('drafter'):
    out += [''] + markdown_drafter(summary['drafter'])
  out += markdown_outliers(summary)
  if summary.get('global_holm'):
    g = summary['global_holm']
    kinds = [k for *_, k in g['tests']]
    out += ['', f"Global Holm correction: one family of all {g['size']} tests above "
            f"({kinds.count('difference')} differences, {kinds.count('equivalence')} "
            "equivalence tests); each test's `global Holm p` is its p adjusted over all of them."]
  return '\n'.join(out)


def markdown_outliers(summary: dict) -> list[str]:
  """Every flagged per-seed value of an endpoint (families.OUTLIER_METRICS): reported, kept."""
  rows = []
  parts = [(f'sized, {b}', p['table']) for b, p in (summary.get('sized') or {}).items()]
  parts += [(g, summary[g]['table']) for g in ('drafter', 'names', 'bpe_names')
            if summary.get(g)]
  seen = set()
  for where, table in parts:
    for v, row in table.items():
      for metric, m in row['metrics'].items():
        for seed, x in m.get('outliers', {}).items():
          key = (v, metric, seed, x)
          if key not in seen:
            seen.add(key)
            rows.append(f'- {where}: {v} seed {seed} {metric} {x:.3f} (median of its '
                        f'{m["n"]} seeds {_median(m):.3f})')
  if not rows:
    return []
  return ['', 'Outliers (modified z-score > 3.5 among an arm\'s seeds; reported, no run left '
          'out of any test):', ''] + rows


def _median(m: dict) -> float:
  xs = sorted(v for v in m['per_seed'].values() if v is not None)
  mid = len(xs) // 2
  return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def _drafter_label(v: str, row: dict) -> str:
  """What a drafter row is: its heads and what it changes against the reference."""
  if not row['depth']:
    return f'{v} (the frozen next-token trunk)'
  parts = [f"M = {row['depth']} {row['mtp_kind']}"]
  if row.get('share_modules'):
    parts.append('one shared module')
  if row.get('target_offsets'):
    parts.append('leap offsets ' + '/'.join(map(str, row['target_offsets'])))
  if row.get('mtp_targets', 'data') != 'data':
    parts.append(f"{row['mtp_targets']} targets")
  if row.get('lambda', ['step'])[0] != 'step':
    parts.append('lambda ' + ' -> '.join(f'{x:g}' for x in row['lambda'][1]))
  if row.get('curriculum', 'none') != 'none':
    parts.append(f"{row['curriculum']} curriculum")
  return f"{v} ({', '.join(parts)})"


def markdown_drafter(drafter: dict) -> list[str]:
  table = drafter['table']
  ns = sorted({len(row['seeds']) for row in table.values()})
  ep = drafter['endpoints']
  out = [f'**Drafters on a frozen verifier** (one next-token trunk per seed, every arm\'s '
         f'MTP modules trained on it; mean ± std over seeds, n = {"/".join(map(str, ns))}; '
         f"primary endpoint {ep['primary']}, secondary {ep['secondary']}; tau = tokens per "
         'verify step from the held-out prompts)', '',
         '| arm | steps | held-out bpb (main head) | agreement per depth | tau greedy | '
         'tau T = 1 | tau T = 0.7 | acceptance per depth, T = 1 | projected speed-up at '
         'd 768 (not measured), T = 1 / T = 0.7 |',
         '|---|---|---|---|---|---|---|---|---|']
  for v, row in table.items():
    m = row['metrics']
    agree = ' / '.join(_pm(m[f'heldout_agree_{k}'], '{:.2f}')
                       for k in range(1, row['depth'] + 1) if f'heldout_agree_{k}' in m)
    taus = [_pm(m.get(f'tau_{t}'), '{:.2f}') if f'tau_{t}' in m else 'n.a.' for t in TEMPS]
    acc = ' / '.join(f'{m[f"accept_T1_{k}"]["mean"]:.2f}' for k in range(1, 9)
                     if f'accept_T1_{k}' in m)
    speed = ' / '.join(_pm(m[f'projected_speedup_d768_{t}'], '{:.2f}') for t in ('T1', 'T0.7')
                       if f'projected_speedup_d768_{t}' in m)
    out.append(f'| {_drafter_label(v, row)} | {_pm(m["steps"], "{:.0f}")} | '
               f'{_pm(m["heldout_bpb"])} | {agree or "n.a."} | {" | ".join(taus)} | '
               f'{acc or "n.a."} | {speed or "n.a."} |')
  out.append('')
  if drafter.get('d768'):
    d = drafter['d768']
    costs = '; '.join(f'{TEMP_NAMES[t]}: ' + ', '.join(
        f'{r:.2f} ({k} draft{"s" if k != "1" else ""})'
        for k, r in sorted(d['cost_ratio'][t].items()))
        for t in ('T1', 'T0.7') if t in d['cost_ratio'])
    out += ['Projected speed-up at d 768 (a projection, not a measurement: these drafters were '
            'not timed): each run\'s tau over the cost of one verify iteration relative to one '
            'autoregressive step of another model, configs/decode_768.py (d 768, 12 layers, '
            'batch 1, float32, a trained checkpoint), at the same temperature and number of '
            f"drafts, as benchmarks/decode_speed.py measured it while decoding ({costs}; "
            f"{d['machine']}, commit {d['commit']}). It assumes drafters at d 768 accept as "
            'these do; prefill is left out.', '']
  for family, d in drafter['mde'].items():
    out.append(_mde_sentence(f'{d["metric"]}, family "{family}"', d, 'tokens per verify step',
                             f"{d['mde_familywise']:.3f} at Holm's first step; pooled sd "
                             f"{d['pooled_sd']:.4f}, {d['dof']} dof"))
  out += _families(drafter['tests'], 'positive tau = more tokens per verify step than ref',
                   '{:+.3f}')
  out.append('')
  return out


def _mde_sentence(subject: str, d: dict, unit: str, spread: str) -> str:
  """The minimum detectable effect of a set of paired tests, with the spread it rests on."""
  return (f'Minimum detectable paired effect on {subject} (alpha 0.05, power 0.8, '
          f'n = {d["n"]}): {d["mde"]:.3f} {unit} ({spread}).')


def _families(tests: dict, sign: str, fmt: str = '{:+.4f}') -> list[str]:
  """Every test, under its family's heading (`sign`: what a positive difference means)."""
  families, out = {}, []
  for name, t in tests.items():
    families.setdefault(t.get('family', ''), []).append(name)
  for family, names in families.items():
    out += ['', f'Paired differences, family "{family}" (Holm\'s correction over its '
            f'{len(names)} tests; {sign}):', '']
    out += [_test_line(name, tests[name], fmt) for name in names]
  return out


ALPHA = 0.05  # the family-wise level the tables judge Holm-adjusted p against


def _verdict(t: dict, fmt: str) -> str:
  """Significant after Holm's correction within its family (and after the global one), or
  the interval the effect lies in: a null is a range, not a zero."""
  lo, hi = (fmt.format(x) for x in t['ci95'])
  glob = t.get('p_holm_global')
  if t['p_holm'] < ALPHA and (glob is None or glob < ALPHA):
    return 'significant after Holm' + ('' if glob is None else ' (family and global)')
  if t['p_holm'] < ALPHA:
    return (f'significant after its family\'s Holm, not after the global Holm; the effect '
            f'lies between {lo} and {hi} (95 % CI)')
  return f'not established after Holm: the effect lies between {lo} and {hi} (95 % CI)'


def _equivalence_note(t: dict, fmt: str) -> str:
  """A declared equivalence test: its margin, TOST p (global Holm) and what it shows."""
  e = t.get('equivalence')
  if not e:
    return ''
  m, lo, hi = (fmt.format(x) for x in (e['margin'], *e['ci90']))
  glob = e.get('p_holm_global', e['p'])
  shown = ('equivalent within the margin' if glob < ALPHA
           else 'equivalence within the margin not shown')
  return (f'; equivalence against the declared margin ±{m.lstrip("+")}: TOST p = {e["p"]:.3g} '
          f'({e["test"]}), global Holm p = {glob:.3g}, 90 % CI {lo} to {hi}: {shown}')


def _test_line(name: str, t: dict, fmt: str = '{:+.4f}') -> str:
  ci = (f' (95 % CI {fmt.format(t["ci95"][0])} to {fmt.format(t["ci95"][1])})'
        if 'ci95' in t else '')
  glob = (f', global Holm p = {t["p_holm_global"]:.3f}' if 'p_holm_global' in t else '')
  holm = (f', Holm p = {t["p_holm"]:.3f} (family of {t["family_size"]}){glob}; '
          f'{_verdict(t, fmt)}' if 'p_holm' in t else '')
  exact = t.get('test') == 'sign-flip (exact)'
  test = (f'sign-flip p (exact) = {t["p"]:.3f}, at least {t["p_min"]:.3f} at n = {t["n"]}; '
          f'paired t = {t["t"]:.2f}' if exact else f'paired t = {t["t"]:.2f}, p = {t["p"]:.3f}')
  other = t.get('other_corpus_seeds')
  corpus = {'heldout': 'held-out corpora', 'stdlib_val': 'stdlib validation splits'}.get(
      metric_corpus(name.rsplit(' ', 1)[-1]), 'corpora')
  left_out = (f'; seeds {", ".join(map(str, other))} left out (their two runs were scored on '
              f'different {corpus})' if other else '')
  return (f'- {name}: {fmt.format(t["diff"])}{ci}, {test}'
          f'{holm}; n = {t["n"]}, minimum detectable effect {t["mde"]:.3f} (paired t; sd of the '
          f'differences {t["sd"]:.4f}){left_out}{_equivalence_note(t, fmt)}')


def _holm_note(t: dict) -> str:
  """The legacy groups' Holm-adjusted p (holm_family)."""
  return (f'; Holm p = {t["p_holm"]:.3f} (family of {t["family_size"]})' if 'p_holm' in t
          else '')


def markdown_sized(sized: dict, title_of: str = 'Sized sweep') -> list[str]:
  out = []
  for budget, title in BUDGETS.items():
    part = sized.get(budget)
    if not part or not part['table']:
      continue
    table = part['table']
    ns = sorted({len(row['seeds']) for row in table.values()})
    out += [f'**{title_of}, {title}** (decayed learning rate, one run per budget; mean ± std '
            f'over seeds, n = {"/".join(map(str, ns))})', '',
            '| variant | steps | train TFLOP | stdlib val bpb | held-out bpb | '
            'agreement per depth | tau greedy | tau T = 1 |', '|---|---|---|---|---|---|---|---|']
    for v, row in table.items():
      m = row['metrics']
      agree = ' / '.join(_pm(m[f'heldout_agree_{k}'], '{:.2f}')
                         for k in range(1, row['depth'] + 1)) or 'n.a.'
      taus = [_pm(m.get(f'tau_{t}'), '{:.2f}') if row['depth'] else '1 (n.a.)'
              for t in ('T0', 'T1')]
      label = _label(v, row) + (f', {row["curriculum"]} curriculum'
                                if row.get('curriculum', 'none') != 'none' else '')
      out.append(f'| {label} | {_pm(m["steps"], "{:.0f}")} | {_pm(m["train_tflop"], "{:.2f}")} '
                 f'| {_pm(m["stdlib_bpb"])} | {_pm(m["heldout_bpb"])} | {agree} | '
                 f'{" | ".join(taus)} |')
    out.append('')
    for metric, d in part['mde'].items():
      out.append(_mde_sentence(metric, d, 'bits per byte', 'pooled sd of the paired differences '
                               f'of {", ".join(d["arms"])} against d0: {d["pooled_sd"]:.4f}, '
                               f'{d["dof"]} dof'))
    out += _families(part['tests'], 'negative bpb = better than the reference')
    out.append('')
  return out


NAMES_TITLE = ('Induction on stories with random names', 'a name')
BPE_TITLE = ('Induction as Gloeckle et al. ran it: trained on ordinary names, tested on random '
             'two-token names of the run\'s own BPE', 'a test name')


def markdown_names(names: dict, title=NAMES_TITLE) -> list[str]:
  table = names['table']
  out = [f'**{title[0]}** (copy accuracy = main-head top-1 '
         f'accuracy on the second token of {title[1]} at its second mention; chance '
         f'{names["chance"]:.3f}; mean ± std over seeds)', '',
         '| variant | steps | after 1/4 of the steps | after 1/2 | at the end (equal steps) | '
         'at equal FLOPs | steps to 50 % | at the end, each seed |',
         '|---|---|---|---|---|---|---|---|']
  for v, row in table.items():
    m = row['metrics']
    reach = m['steps_to_half']
    reached = f'{reach["n"]}/{len(row["seeds"])} seeds' + (
        f', {reach["mean"]:.0f}' if reach['n'] else '')
    eqf = _pm(m.get('copy_acc_equal_flops')) if row['depth'] else '(= at the end)'
    label = f'{v} (M = 0)' if not row['depth'] else f'{v} (M = {row["depth"]} {row["mtp_kind"]})'
    out.append(f'| {label} | {_pm(m["steps"], "{:.0f}")} | {_pm(m["copy_acc_quarter"])} | '
               f'{_pm(m["copy_acc_half"])} | {_pm(m["copy_acc_final"])} | {eqf} | {reached} | '
               f'{_seeds(m["copy_acc_final"])} |')
  out.append('')
  out += [_test_line(name, t, '{:+.3f}') for name, t in names['tests'].items()]
  out.append('')
  return out


def ind_alphabet(summary: dict):
  return summary.get('induction_task', {}).get('alphabet', '?')


def _label(v: str, row: dict) -> str:
  if not row['depth']:
    return f'{v} (M = 0)'
  return f'{v} (M = {row["depth"]} {row["mtp_kind"]})'
