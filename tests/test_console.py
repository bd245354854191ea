"""What the trainer prints: console lines that name their units, and a final block whose
`next:` commands are installed and take the run's own workdir and text.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys

from helpers import REPO, jsonl_config
from mtp_jax.train import metrics as metrics_lib


def test_each_command_the_final_block_suggests_is_installed(tmp_path):
  """After `pip install -e '.[tensorboard]'` (the README's install) each `next:` command
  exists beside this interpreter and answers --help: the project's console scripts, and
  tensorboard from the `tensorboard` extra."""
  import tomllib
  project = tomllib.loads(pathlib.Path(REPO, 'pyproject.toml').read_text())['project']
  assert any(r.startswith('tensorboard>') for r in project['optional-dependencies']['tensorboard'])
  block = metrics_lib.final_block(str(tmp_path), 1, 1, 'def ').splitlines()
  commands = [line.split()[0] for line in block[block.index('next:') + 1:]]
  assert commands == ['mtp-decode', 'mtp-eval', 'tensorboard']
  bindir = os.path.dirname(sys.executable)
  for name in commands:
    assert name in project['scripts'] or name == 'tensorboard', name
    path = shutil.which(name, path=bindir)
    assert path, f'{name} is not installed in {bindir}'
    proc = subprocess.run([path, '--help'], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (name, proc.stderr[-500:])
    assert ('--logdir' if name == 'tensorboard' else '--workdir') in proc.stdout, name


def test_console_lines_name_their_units_and_the_final_block_what_to_run_next(tmp_path):
  line = metrics_lib.eval_line(40, {'eval/loss_main': 3.2, 'eval/loss_mtp_1': 3.9,
                                    'eval/bpb_main': 1.5, 'eval/acc_main': 0.4,
                                    'eval/decode_tau': 2.25})
  assert line == ('eval @ 40: loss main 3.2000 mtp_1 3.9000 nats/token | bpb main 1.5000 '
                  'bits per byte | tau 2.250 tokens per verify step')
  rows = [{'step': 10, 'train/loss': 5.0, 'perf/tokens_per_sec': 900.0, 'perf/mfu': 0.4},
          {'step': 10, 'eval/bpb_main': 2.0, 'eval/loss_main': 1.4},
          {'step': 20, 'train/loss': 4.0, 'perf/tokens_per_sec': 1000.0, 'perf/mfu': 0.5},
          {'step': 20, 'eval/bpb_main': 2.5, 'eval/loss_main': 1.7}]
  workdir = tmp_path / 'my run'
  workdir.mkdir()
  (workdir / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  block = metrics_lib.final_block(str(workdir), 20, 20, "# It's a").splitlines()
  assert block[0] == f'done: step 20 in {workdir} (checkpoint 20)'
  assert 'last train loss 4.0000 nats/token (step 20), 1000 tokens/s, MFU 0.50' in block[1]
  assert 'bits per byte, main model: last 2.5000 (step 20), best 2.0000 (step 10)' in block[2]
  quoted = f"'{workdir}'"
  assert (f'  mtp-decode --workdir {quoted} --mode compare --prompt '
          + "'# It'\"'\"'s a'") in block  # the run's own text, quoted for the shell
  assert f'  mtp-eval --workdir {quoted}' in block
  assert f"  tensorboard --logdir '{workdir}/tensorboard'" in block
  assert any('--prompts_file' in line for line in metrics_lib.final_block(str(workdir), 20, 20)
             .splitlines())  # no text from the run: a prompts file, not a made-up prompt
  config = jsonl_config('docs.jsonl')
  assert metrics_lib.data_line(config) == ('data: jsonl docs.jsonl, byte tokenizer, batches of '
                                           '8 x 32 tokens')
