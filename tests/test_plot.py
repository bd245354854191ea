"""scripts/plot.py writes non-empty PNGs from a run's metrics."""
import os
import subprocess
import sys

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
