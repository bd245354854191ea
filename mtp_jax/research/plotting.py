"""Figures from a run's metrics.jsonl: per-depth loss, accuracy / agreement, acceptance.

Also the views of one speculative decode: text coloured by token source, acceptance.
"""
from __future__ import annotations

import html
import json
import os

import matplotlib
import numpy as np

matplotlib.use('Agg')  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402

import mtp_jax.research.stats as stats  # noqa: E402
from mtp_jax.research.results import load_results  # noqa: E402
from mtp_jax.train.metrics import TAU_KEY, key_depths, metric_key  # noqa: E402


def load_metrics(workdir: str) -> list[dict]:
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    raise FileNotFoundError(f'no metrics.jsonl in {workdir}')
  with open(path) as f:
    # A live trainer may be writing the last line: only whole lines are read.
    return [json.loads(line) for line in f if line.endswith('\n') and line.strip()]


def _series(rows: list[dict], key: str):
  pts = [(r['step'], r[key]) for r in rows if key in r]
  return [p[0] for p in pts], [p[1] for p in pts]


def depths(rows: list[dict]) -> list[int]:
  return key_depths({k for r in rows for k in r}, ('train', 'eval'), 'loss')


def _label(k: int) -> str:
  return 'main' if k == 0 else f'depth {k}'


def plot_losses(rows: list[dict], path: str) -> str:
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for k in [0] + depths(rows):
    (line,) = ax.plot(*_series(rows, metric_key('train', 'loss', k)), label=f'train {_label(k)}')
    xs, ys = _series(rows, metric_key('eval', 'loss', k))
    if xs:
      ax.plot(xs, ys, 'o--', color=line.get_color(), label=f'eval {_label(k)}')
  ax.set_xlabel('step')
  ax.set_ylabel('cross-entropy (nats / token)')
  ax.set_title('Loss per depth')
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  return _save(fig, path)


def plot_accuracy(rows: list[dict], path: str) -> str:
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
  for k in [0] + depths(rows):
    a1.plot(*_series(rows, metric_key('train', 'acc', k)), label=_label(k))
    if k:
      a2.plot(*_series(rows, metric_key('train', 'agree', k)), label=_label(k))
  a1.set_title('Top-1 accuracy vs the true token (train)')
  a2.set_title("Agreement with the main model's argmax (train)")
  for a in (a1, a2):
    a.set_xlabel('step')
    a.set_ylim(0, 1)
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
  return _save(fig, path)


def plot_acceptance(rows: list[dict], path: str) -> str | None:
  """Free-running acceptance per depth and tau from the last eval that measured them."""
  evals = [r for r in rows if TAU_KEY in r]
  if not evals:
    return None
  last = evals[-1]
  ks = key_depths(last, 'eval', 'decode_accept')
  fig, ax = plt.subplots(figsize=(6, 4.5))
  ax.bar([str(k) for k in ks], [last[metric_key('eval', 'decode_accept', k)] for k in ks])
  ax.set_xlabel('draft depth k')
  ax.set_ylabel('acceptance rate')
  ax.set_ylim(0, 1)
  ax.set_title(f'Free-running acceptance at step {last["step"]}: tau = {last[TAU_KEY]:.2f}')
  ax.grid(alpha=0.3, axis='y')
  return _save(fig, path)


def _save(fig, path: str, layout: bool = True) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  if layout:
    fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_run(workdir: str, out_dir: str | None = None) -> list[str]:
  """Writes every figure the run's metrics allow; returns their paths."""
  rows = load_metrics(workdir)
  out_dir = out_dir or os.path.join(workdir, 'plots')
  paths = [plot_losses(rows, os.path.join(out_dir, 'loss_per_depth.png')),
           plot_accuracy(rows, os.path.join(out_dir, 'accuracy_agreement.png'))]
  acc = plot_acceptance(rows, os.path.join(out_dir, 'acceptance.png'))
  return paths + ([acc] if acc else [])


def run_labels(workdirs: list[str]) -> list[str]:
  """The shortest path endings that tell the runs apart: 'a/run', 'b/run' for two 'run's."""
  parts = [os.path.normpath(os.path.abspath(w)).split(os.sep) for w in workdirs]
  for n in range(1, max(map(len, parts)) + 1):
    labels = [os.sep.join(p[-n:]) for p in parts]
    if len(set(labels)) == len(labels):
      return labels
  return [str(i) for i in range(len(workdirs))]


def plot_runs(workdirs: list[str], out_dir: str | None = None) -> list[str]:
  """Several runs in one figure, compare_runs.png: the main head's train loss, and its
  evaluation bits per byte where the runs have evaluations (out_dir default: the first
  run's plots/)."""
  runs = [load_metrics(w) for w in workdirs]
  out_dir = out_dir or os.path.join(workdirs[0], 'plots')
  have_eval = any(metric_key('eval', 'bpb', 0) in r for rows in runs for r in rows)
  fig, axes = plt.subplots(1, 2 if have_eval else 1, figsize=(12 if have_eval else 7, 4.5),
                           squeeze=False)
  for label, rows in zip(run_labels(workdirs), runs):
    (line,) = axes[0, 0].plot(*_series(rows, metric_key('train', 'loss', 0)), label=label)
    if have_eval:
      axes[0, 1].plot(*_series(rows, metric_key('eval', 'bpb', 0)), 'o-',
                      color=line.get_color(), label=label)
  axes[0, 0].set_ylabel('train loss, main head (nats / token)')
  if have_eval:
    axes[0, 1].set_ylabel('validation bits per byte, main head')
  for a in axes[0]:
    a.set_xlabel('step')
    a.grid(alpha=0.3)
    a.legend(fontsize=8)
  fig.suptitle(f'{len(workdirs)} runs')
  return [_save(fig, os.path.join(out_dir, 'compare_runs.png'))]


# -- one speculative decode ------------------------------------------------------------------
# Background per token source (generate.token_sources): 0 = the main model's own token.
SOURCE_COLORS = ('#e0e0e0', '#ffe082', '#a5d6a7', '#90caf9', '#ce93d8', '#f48fb1', '#80cbc4')


def source_color(k: int) -> str:
  return SOURCE_COLORS[k] if k < len(SOURCE_COLORS) else SOURCE_COLORS[1 + (k - 1) % 6]


def token_pieces(tokenizer, prompt_ids, ids) -> list[str]:
  """The text each of `ids` adds after the prompt, one string per token.

  Decodes growing prefixes (SentencePiece spaces depend on context); a character split
  over several byte tokens goes to its last one, the others get ''.
  """
  ids = [int(i) for i in ids]
  done = tokenizer.decode(list(prompt_ids))
  pieces = []
  for i in range(len(ids)):
    text = tokenizer.decode(list(prompt_ids) + ids[:i + 1])
    if text.endswith('\ufffd') and i + 1 < len(ids):  # maybe a character still incomplete
      pieces.append('')
      continue
    pieces.append(text[len(done):])
    done = text
  return pieces


def _span(text: str, k: int, title: str, edge: bool = False) -> str:
  shown = html.escape(text.replace('\n', '\u21b5\n'))  # a visible mark for newlines
  border = '; border-right:1px solid #666' if edge else ''
  return f'<span style="background:{source_color(k)}{border}" title="{title}">{shown}</span>'


def sources_html(prompt: str, pieces, sources, num_drafts: int, legend: bool = True) -> str:
  """The prompt (grey), then each generated piece on its source's colour; a legend first.

  A bar follows each main-model token: the end of the prefill or of a verify step.
  """
  names = ['main model (prefill / bonus)'] + [f'draft depth {k}' for k in range(1, num_drafts + 1)]
  head = ' '.join(_span(name, k, name) for k, name in enumerate(names)) + '\n\n' if legend else ''
  body = ''.join(_span(p, int(k), names[int(k)], edge=k == 0) for p, k in zip(pieces, sources))
  style = 'white-space:pre-wrap; font-family:monospace; line-height:1.5'
  return (f'<div style="{style}">{head}<span style="color:#888">{html.escape(prompt)}</span>'
          f'{body}</div>')


def plot_decode_acceptance(stats: dict, accepted_hist, path: str) -> str:
  """P(first k drafts accepted) per depth with tau, and accepted drafts per verify step.

  stats: DecodeResult.stats(); accepted_hist: [A+1] verify steps that accepted exactly
  j drafts (DecodeResult.accepted summed over rows).
  """
  d = stats['num_drafts']
  steps = max(stats['verify_steps'], 1)
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
  ks_i = range(1, d + 1)
  ks = [str(k) for k in ks_i]
  bars = a1.bar(ks, stats['acceptance_per_depth'], color=[source_color(k) for k in ks_i],
                edgecolor='k', label='P(first k drafts accepted)')
  a1.bar_label(bars, fmt='%.2f', label_type='center')
  a1.plot(ks, stats['conditional_acceptance'], 'ko--', label='P(draft k | drafts < k accepted)')
  a1.set_ylim(0, 1.3)  # room for the legend above bars that may reach 1
  a1.set_xlabel('draft depth k')
  a1.set_title(f"tau = {stats['mean_accepted_length']:.2f}   "
                f"(1 + sum_k P(first k accepted) = {1 + sum(stats['acceptance_per_depth']):.2f})")
  a1.legend(fontsize=8, loc='upper right')
  hist = list(accepted_hist)
  js = [str(j) for j in range(d + 1)]
  bars = a2.bar(js, [h / steps for h in hist], color='#90a4ae', edgecolor='k')
  a2.bar_label(bars, labels=[str(int(h)) for h in hist])
  a2.set_xlabel('drafts accepted in a verify step (commits that + 1 tokens)')
  a2.set_ylabel('fraction of verify steps')
  a2.set_title(f"{stats['verify_steps']} verify steps, {stats['new_tokens']} new tokens")
  for a in (a1, a2):
    a.grid(alpha=0.3, axis='y')
  return _save(fig, path)


# -- multi-seed sweeps (scripts/ablation.py's JSON) --------------------------------------------
VARIANT_COLORS = {'d0': '#424242', 'd1': '#1e88e5', 'p2': '#fb8c00', 'n2': '#fb8c00',
                  'd3': '#e53935', 'd3f': '#8e24aa', 'd3r': '#43a047', 'd3p': '#fb8c00',
                  't1': '#00acc1'}


def _group_by_variant(results: list[dict]) -> dict[str, list[dict]]:
  order = list(VARIANT_COLORS)
  rank = lambda v: order.index(v) if v in order else len(order)  # noqa: E731
  out = {}
  for r in sorted(results, key=lambda r: (rank(r['variant']), r['variant'], r['seed'])):
    out.setdefault(r['variant'], []).append(r)
  return out


def _variant_label(rs: list[dict]) -> str:
  r = rs[0]
  kind = f' {r["mtp_kind"]}' if r['depth'] else ''
  curriculum = r.get('config', {}).get('model', {}).get('mtp', {}).get('curriculum', 'none')
  kind += f', {curriculum} curriculum' if curriculum != 'none' else ''
  return f'{r["variant"]}: M = {r["depth"]}{kind} (n = {len(rs)})'


def _smooth(y, width: int):
  """Trailing mean over `width` points (fewer at the start): the same x, less noise."""
  c = np.cumsum(np.insert(np.asarray(y, np.float64), 0, 0.0))
  i = np.arange(1, len(y) + 1)
  lo = np.maximum(i - width, 0)
  return (c[i] - c[lo]) / (i - lo)


def _mean_band(ax, xs, ys_by_seed, color, label, smooth: int = 1):
  """Mean over seeds with a ±1 std band, on the x points every seed has."""
  n = min(len(y) for y in ys_by_seed)
  ys = np.asarray([_smooth(y[:n], smooth) for y in ys_by_seed], np.float64)
  mean = ys.mean(0)
  std = ys.std(0, ddof=1) if len(ys) > 1 else np.zeros_like(mean)
  ax.plot(xs[:n], mean, color=color, label=label)
  ax.fill_between(xs[:n], mean - std, mean + std, color=color, alpha=0.25, linewidth=0)


def plot_sweep_loss(results: list[dict], path: str) -> str:
  """Main-head training loss vs training FLOPs per variant, mean ± std over seeds.

  Each point is the mean over the last `smooth` log windows (10 steps each) of fresh
  training batches; the dotted line is M = 0's budget, where the equal-FLOP table reads
  each run.
  """
  smooth = 5
  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  by = _group_by_variant(results)
  for v, rs in by.items():
    curves = [[p for p in r['curve'] if 'train_loss' in p] for r in rs]
    xs = np.asarray([p['flops'] / 1e12 for p in curves[0]])
    ys = [[p['train_loss'][0] for p in c] for c in curves]
    _mean_band(ax, xs, ys, VARIANT_COLORS.get(v), _variant_label(rs), smooth)
  base = [r for r in results if r['depth'] == 0]
  if base:
    ax.axvline(base[0]['steps'] * base[0]['flops_per_step'] / 1e12, color='k', ls=':', lw=1,
               label='equal-FLOP budget (M = 0 at its last step)')
  ax.set_xlabel('training FLOPs (TFLOP, mtp_jax/train/flops.py)')
  ax.set_ylabel('main-head train loss (nats / byte)')
  ax.set_ylim(top=min(ax.get_ylim()[1], 4.0))
  ax.set_title(f'Main-head train loss vs compute (trailing mean of {10 * smooth} steps; '
               'band: ±1 std over seeds)', fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  return _save(fig, path)


def plot_induction(results: list[dict], path: str, chance: float | None = None,
                   title: str = '') -> str:
  """Copy accuracy on the second occurrence vs training steps and vs FLOPs: the mean over
  seeds, and each seed as a thin line (induction forms in some seeds and not in others,
  which a mean and a band would hide)."""
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.3), sharey=True)
  top = 0.0
  for v, rs in _group_by_variant(results).items():
    curves = [[p for p in r['curve'] if 'copy_acc' in p] for r in rs]
    ys = [[p['copy_acc'] for p in c] for c in curves]
    top = max(top, max(max(y) for y in ys))
    n = min(len(y) for y in ys)
    color = VARIANT_COLORS.get(v)
    for ax, key, scale in ((axes[0], 'step', 1.0), (axes[1], 'flops', 1e12)):
      xs = np.asarray([p[key] / scale for p in curves[0]])[:n]
      for y in ys:
        ax.plot(xs, y[:n], color=color, lw=0.7, alpha=0.45)
      ax.plot(xs, np.mean([y[:n] for y in ys], axis=0), color=color, lw=2,
              label=_variant_label(rs))
  for ax, xl in zip(axes, ('training step', 'training FLOPs (TFLOP)')):
    if chance:
      ax.axhline(chance, color='grey', ls=':', lw=1, label=f'chance ({chance:.3f})')
    ax.set_xlabel(xl)
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('accuracy on the 2nd occurrence')
  axes[0].set_ylim(0, min(1.0, top * 1.25 + 0.02))
  axes[0].legend(fontsize=8)
  axes[0].set_title('Induction vs steps (thick: mean over seeds; thin: each seed)')
  axes[1].set_title('Induction vs compute (equal-FLOP budgets)')
  if title:
    fig.suptitle(title, fontsize=10)
  return _save(fig, path)


def plot_bpe_names(results: list[dict], fig_dir: str, chance: float | None = None) -> list[str]:
  """One induction figure per trunk size of the `bpe_names` group (variants `d0@1m`, ...):
  bpe_names_<size>.png, each variant under its own name and colour."""
  by_size = {}
  for r in results:
    variant, size = r['variant'].split('@')
    by_size.setdefault(size, []).append(dict(r, variant=variant))
  paths = []
  for size, rs in sorted(by_size.items()):
    m = rs[0]['config']['model']
    title = (f'Trained on ordinary names, tested on random two-token names; trunk {size}: '
             f'd {m["d_model"]}, {m["n_layers"]} layers, '
             f'{_dense_block_params(m) / 1e6:.2f} M non-embedding parameters')
    paths.append(plot_induction(rs, os.path.join(fig_dir, f'bpe_names_{size}.png'), chance,
                                title))
  return paths


def _dense_block_params(m: dict) -> int:
  """A dense trunk's block matrices (attention q, k, v, o and the gated MLP's three), the
  count the paper's sizes name; norms left out."""
  attention = 2 * m['d_model'] * m['head_dim'] * (m['n_heads'] + m['n_kv_heads'])
  return m['n_layers'] * (attention + 3 * m['d_model'] * m['mlp_dim'])


def tau_differences(results: list[dict], reference: str = 'ref') -> dict:
  """{temperature: {arm: [tau(arm) - tau(reference) per seed both have]}}: the paired
  differences the drafter study tests, at every sampled temperature (greedy left out: its
  continuations loop). Runs that cannot draft (the trunk) have no decode evaluation."""
  taus = {}  # arm -> seed -> {temperature: tau}
  for r in results:
    decode = r['evals']['end'].get('decode') or {}
    if r['depth'] and decode:
      taus.setdefault(r['variant'], {})[r['seed']] = {t: d['tau'] for t, d in decode.items()}
  ref = taus.pop(reference)
  temps = [t for t in next(iter(ref.values())) if t != 'T0']
  return {t: {arm: [by_seed[s][t] - ref[s][t] for s in sorted(set(by_seed) & set(ref))]
              for arm, by_seed in taus.items()}
          for t in temps}


def plot_drafter(results: list[dict], path: str, reference: str = 'ref') -> str:
  """The drafter study: each arm's tau (tokens per verify step, free-running, held-out
  prompts) minus the reference arm's on the same trunk, per seed (dots) and the mean with
  its 95 % interval (paired t), one panel per sampling temperature."""
  diffs = tau_differences(results, reference)
  ref_tau = {t: float(np.mean([r['evals']['end']['decode'][t]['tau'] for r in results
                               if r['variant'] == reference])) for t in diffs}
  fig, axes = plt.subplots(1, len(diffs), figsize=(5.2 * len(diffs), 4.3), squeeze=False)
  rng = np.random.default_rng(0)
  for ax, (t, by_arm) in zip(axes[0], diffs.items()):
    for i, d in enumerate(by_arm.values()):
      ax.scatter(i + rng.uniform(-0.15, 0.15, len(d)), d, s=12, color='#757575', alpha=0.6,
                 linewidths=0)
      if len(d) > 1:
        test = stats.paired(d, np.zeros(len(d)))
        lo, hi = test['ci95']
        ax.errorbar(i, test['diff'], yerr=[[test['diff'] - lo], [hi - test['diff']]], fmt='o',
                    color='k', capsize=4, ms=5)
    ax.axhline(0, color='grey', ls=':', lw=1)
    ax.set_xticks(range(len(by_arm)), [f'{a}\n(n = {len(d)})' for a, d in by_arm.items()],
                  fontsize=8)
    ax.set_title(f'T = {t[1:]}: {reference} tau {ref_tau[t]:.2f}', fontsize=10)
    ax.grid(alpha=0.3, axis='y')
  axes[0][0].set_ylabel(f'tau(arm) - tau({reference}), same trunk')
  fig.suptitle('Drafters on a frozen verifier (dots: seeds; bars: mean and 95 % interval, '
               'not Holm-adjusted)', fontsize=10)
  return _save(fig, path)


def plot_sweep_acceptance(results: list[dict], path: str, budget: str = 'equal_tokens') -> str:
  """Free-running acceptance per depth (greedy, T = 1, T = 0.7), mean ± std over seeds,
  with the teacher-forced agreement per depth (held-out) as black marks. Variants that
  cannot draft (no MTP depth, or TOP's ranking head: no decode evaluation) are left out."""
  by = {v: rs for v, rs in _group_by_variant(results).items()
        if rs[0]['depth'] and rs[0]['evals'][budget].get('decode')}
  present = next(iter(by.values()))[0]['evals'][budget]['decode']
  temps = [(t, 'greedy' if t == 'T0' else f'T = {t[1:]}') for t in present]
  fig, axes = plt.subplots(1, len(temps), figsize=(4.4 * len(temps), 4.3), sharey=True,
                           squeeze=False)
  axes = axes[0]
  width = 0.8 / max(len(by), 1)
  for ax, (t, name) in zip(axes, temps):
    for i, (v, rs) in enumerate(by.items()):
      mtp_depth = rs[0]['depth']
      acc = np.asarray([r['evals'][budget]['decode'][t]['acceptance_per_depth'] for r in rs])
      agree = np.asarray([r['evals'][budget]['heldout']['agree'] for r in rs])
      xs = np.arange(1, mtp_depth + 1) + (i - (len(by) - 1) / 2) * width
      ax.bar(xs, acc.mean(0), width, yerr=acc.std(0, ddof=1) if len(rs) > 1 else None,
             color=VARIANT_COLORS.get(v), label=_variant_label(rs), capsize=2)
      ax.plot(xs, agree.mean(0), 'k_', ms=12, mew=2,
              label='teacher-forced agreement' if i == 0 else None)
    ax.set_xticks(range(1, 4))
    ax.set_xlabel('draft depth k')
    ax.set_title(f'{name}: P(first k drafts accepted)')
    ax.grid(alpha=0.3, axis='y')
  axes[0].set_ylabel('acceptance')
  axes[0].set_ylim(0, 1)
  handles, labels = axes[0].get_legend_handles_labels()
  ncol = min(len(labels), 3)  # rows of three: a single row ran past the figure's edges
  fig.legend(handles, labels, loc='lower center', ncol=ncol, fontsize=8)
  fig.suptitle(f'Held-out prompts, {budget.replace("_", " ")} (error bars: ±1 std over seeds)',
               fontsize=10)
  fig.tight_layout(rect=(0, 0.045 * -(-len(labels) // ncol) + 0.02, 1, 1))
  return _save(fig, path, layout=False)


def _equal_token_runs(results: list[dict]) -> list[dict]:
  """The sized sweep's equal-token runs (`d1@tokens`, ...), named by their variant alone."""
  return [dict(r, variant=r['variant'].split('@')[0]) for r in results
          if r['variant'].endswith('@tokens')]


def plot_sweep(out_dir: str, fig_dir: str | None = None) -> list[str]:
  """The sweep's figures from OUT/{lm,sized,induction,names,bpe_names,drafter}.json; their
  paths.

  The sized sweep's curves are its equal-token runs: each equal-FLOP run is a separate,
  shorter run with its own decay, so it has no curve of its own worth overlaying.
  """
  fig_dir = fig_dir or out_dir
  names = ('lm', 'sized', 'induction', 'names', 'bpe_names', 'drafter')
  groups = {g: load_results(out_dir, g) for g in names}
  if not any(groups.values()):
    raise FileNotFoundError(f'no {", ".join(g + ".json" for g in names)} under {out_dir}')
  paths = []
  for group, prefix in (('lm', ''), ('sized', 'sized_')):
    runs = groups.get(group) or []
    runs = _equal_token_runs(runs) if group == 'sized' else runs
    if runs:
      paths.append(plot_sweep_loss(runs, os.path.join(fig_dir, f'{prefix}loss_vs_flops.png')))
      if any(r['depth'] for r in runs):
        paths.append(plot_sweep_acceptance(
            runs, os.path.join(fig_dir, f'{prefix}acceptance_per_depth.png')))
  if groups.get('induction'):
    alphabet = groups['induction'][0].get('task', {}).get('alphabet')
    paths.append(plot_induction(groups['induction'], os.path.join(fig_dir, 'induction.png'),
                                1 / alphabet if alphabet else None))
  if groups.get('names'):  # the second letter of a random name: one of 26
    paths.append(plot_induction(groups['names'], os.path.join(fig_dir, 'names.png'), 1 / 26))
  if groups.get('bpe_names'):  # chance as the tables computed it, where they have
    chance = _summary(out_dir).get('bpe_names', {}).get('chance')
    paths += plot_bpe_names(groups['bpe_names'], fig_dir, chance)
  if any(r['depth'] for r in groups.get('drafter') or []):
    paths.append(plot_drafter(groups['drafter'], os.path.join(fig_dir, 'drafter_tau.png')))
  return paths


def _summary(out_dir: str) -> dict:
  path = os.path.join(out_dir, 'summary.json')
  if not os.path.exists(path):
    return {}
  with open(path, encoding='utf-8') as f:
    return json.load(f)
