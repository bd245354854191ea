"""Figures from a run's metrics.jsonl: per-depth loss, accuracy / agreement, acceptance."""
from __future__ import annotations

import json
import os
import re

import matplotlib

matplotlib.use('Agg')  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402


def load_metrics(workdir: str) -> list[dict]:
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    raise FileNotFoundError(f'no metrics.jsonl in {workdir}')
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _series(rows: list[dict], key: str):
  pts = [(r['step'], r[key]) for r in rows if key in r]
  return [p[0] for p in pts], [p[1] for p in pts]


def depths(rows: list[dict]) -> list[int]:
  found = {int(m.group(1)) for r in rows for k in r
           for m in [re.match(r'(?:train|eval)/loss_mtp_(\d+)$', k)] if m}
  return sorted(found)


def _label(k: int) -> str:
  return 'main' if k == 0 else f'depth {k}'


def plot_losses(rows: list[dict], path: str) -> str:
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for k in [0] + depths(rows):
    name = 'loss_main' if k == 0 else f'loss_mtp_{k}'
    (line,) = ax.plot(*_series(rows, f'train/{name}'), label=f'train {_label(k)}')
    xs, ys = _series(rows, f'eval/{name}')
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
    a1.plot(*_series(rows, 'train/acc_main' if k == 0 else f'train/acc_mtp_{k}'), label=_label(k))
    if k:
      a2.plot(*_series(rows, f'train/agree_mtp_{k}'), label=_label(k))
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
  evals = [r for r in rows if 'eval/decode_tau' in r]
  if not evals:
    return None
  last = evals[-1]
  ks = sorted(int(m.group(1)) for key in last
              for m in [re.match(r'eval/decode_accept_mtp_(\d+)$', key)] if m)
  fig, ax = plt.subplots(figsize=(6, 4.5))
  ax.bar([str(k) for k in ks], [last[f'eval/decode_accept_mtp_{k}'] for k in ks])
  ax.set_xlabel('draft depth k')
  ax.set_ylabel('acceptance rate')
  ax.set_ylim(0, 1)
  ax.set_title(f'Free-running acceptance at step {last["step"]}: tau = {last["eval/decode_tau"]:.2f}')
  ax.grid(alpha=0.3, axis='y')
  return _save(fig, path)


def _save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
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
