"""What the trainer prints: console lines that name their units, and a final block whose
`next:` commands are installed and take the run's own workdir and text.
"""
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

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
  commands = [os.path.basename(line.split()[0]) for line in block[block.index('next:') + 1:]]
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
  decode, evaluate, board = (metrics_lib.command(n) for n in ('mtp-decode', 'mtp-eval',
                                                              'tensorboard'))
  assert (f'  {decode} --workdir {quoted} --mode compare --prompt '
          + "'# It'\"'\"'s a' --max_new_tokens 128") in block  # the run's own text, quoted
  assert f'  {evaluate} --workdir {quoted}' in block
  assert f"  {board} --logdir '{workdir}/tensorboard'" in block
  short = metrics_lib.final_block(str(workdir), 20, 20, 'def ', room=60).splitlines()
  assert any(line.endswith('--max_new_tokens 60') for line in short)  # fits the cache
  assert any('--prompts_file' in line for line in metrics_lib.final_block(str(workdir), 20, 20)
             .splitlines())  # no text from the run: a prompts file, not a made-up prompt
  config = jsonl_config('docs.jsonl')
  assert metrics_lib.data_line(config) == ('data: jsonl docs.jsonl, byte tokenizer, batches of '
                                           '8 x 32 tokens')


def test_a_suggested_command_names_the_interpreters_bin_when_path_does_not(monkeypatch, tmp_path):
  bindir = os.path.dirname(sys.executable)
  assert os.path.isfile(os.path.join(bindir, 'mtp-decode'))  # the editable install's script
  monkeypatch.setenv('PATH', bindir + os.pathsep + os.environ.get('PATH', ''))
  assert metrics_lib.command('mtp-decode') == 'mtp-decode'  # an activated venv
  monkeypatch.setenv('PATH', str(tmp_path))  # not activated: the path beside the interpreter
  monkeypatch.chdir(os.path.dirname(os.path.dirname(bindir)))  # where the venv folder is
  expected = os.path.join(os.path.basename(os.path.dirname(bindir)), 'bin', 'mtp-decode')
  assert metrics_lib.command('mtp-decode') == expected  # e.g. .venv/bin/mtp-decode
  monkeypatch.chdir(tmp_path)
  assert metrics_lib.command('mtp-decode') == os.path.join(bindir, 'mtp-decode')
  assert metrics_lib.command('no-such-command') == 'no-such-command'


def _next_commands(stderr: str) -> list[list[str]]:
  lines = stderr.splitlines()
  start = max(i for i, line in enumerate(lines) if line == 'next:')
  return [shlex.split(line) for line in lines[start + 1:] if line.startswith('  ')]


def _run_suggestion(argv: list[str], cwd, path: str) -> str:
  """Runs one suggested command as printed, under the PATH of the run that printed it;
  tensorboard until it serves (then stopped)."""
  env = dict(os.environ, XLA_FLAGS='', PATH=path)
  if os.path.basename(argv[0]) != 'tensorboard':
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert proc.returncode == 0, (argv, proc.stderr[-2000:])
    return proc.stdout + proc.stderr
  with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        env=env, cwd=cwd) as proc:
    seen = ''
    try:
      for line in proc.stdout:
        seen += line
        if 'http://' in line or 'already in use' in line:
          break
    finally:
      proc.terminate()
      proc.communicate(timeout=60)
  assert 'http://' in seen or 'already in use' in seen, seen[-2000:]  # ran; a port is free or not
  return seen


@pytest.mark.slow
@pytest.mark.parametrize('spec,extra', [
    ('tiny.py', None),  # tiny_run's own output
    ('ablation.py:d1', ['--config.train.steps=2', '--config.train.warmup_steps=1']),
    ('stdlib_mtp.py', ['--config.train.steps=2', '--config.train.warmup_steps=1',
                       '--config.data.batch_size=2', '--config.train.eval_decode_prompts=2']),
])
def test_every_command_of_the_final_block_runs_as_printed(spec, extra, request,
                                                          stdlib_data_dir, tmp_path):
  """The trainer's `next:` commands, copied from its output and run with the venv not
  activated: decode fits the config's sequence length, each program is found."""
  path = '/usr/bin:/bin'  # the venv not activated
  if extra is None:
    workdir, proc = request.getfixturevalue('tiny_run')
    path = os.environ['PATH']
  else:
    workdir = tmp_path / 'run'
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, 'scripts', 'train.py'), '--config',
         os.path.join(REPO, 'configs', spec), '--workdir', str(workdir),
         f'--config.data.data_dir={stdlib_data_dir}', '--config.train.eval_batches=1',
         '--config.train.log_every=1', *extra],
        capture_output=True, text=True, env=dict(os.environ, XLA_FLAGS='', PATH=path),
        cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
  commands = _next_commands(proc.stderr)
  assert [os.path.basename(c[0]) for c in commands] == ['mtp-decode', 'mtp-eval', 'tensorboard']
  for argv in commands:
    out = _run_suggestion(argv, REPO, path)
    if os.path.basename(argv[0]) == 'mtp-decode':
      assert 'identical=True' in out, out[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize('script,flags,lead', [
    ('self_distill.py', ['--num_prompts', '40', '--batch_size', '40', '--prompt_len', '16',
                         '--max_new_tokens', '16'], 'train MTP modules on it: '),
    ('export.py', ['--layout', 'mimo'], 'Train from it: '),
])
def test_the_training_command_self_distill_and_export_print_runs_as_printed(
    script, flags, lead, tiny_run, tmp_path):
  """mtp-self-distill's and mtp-export's last line, a training command on what they wrote
  (the trunk's saved config.json as --config), copied and run with the venv not activated."""
  workdir, _ = tiny_run
  path = '/usr/bin:/bin'
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu', PATH=path)
  proc = subprocess.run([sys.executable, os.path.join(REPO, 'scripts', script), '--workdir',
                         str(workdir), '--out', str(tmp_path / 'out'), *flags],
                        capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  printed = [line[len(lead):] for line in (proc.stdout + proc.stderr).splitlines()
             if line.startswith(lead)]
  assert len(printed) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  argv = shlex.split(printed[0])
  assert os.path.basename(argv[0]) == 'mtp-train' and argv[1:3] == [
      '--config', os.path.join(str(workdir), 'config.json')]
  run = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
  assert run.returncode == 0, (argv, run.stderr[-3000:])
  assert 'done: step 40' in run.stderr, run.stderr[-2000:]
  new_workdir = argv[argv.index('--workdir') + 1]
  assert new_workdir == str(tmp_path / ('out_mtp' if script == 'self_distill.py' else 'out_train'))
  saved = json.loads(pathlib.Path(new_workdir, 'config.json').read_text())
  if script == 'self_distill.py':  # the trunk frozen, MTP modules on the sampled text
    assert saved['model']['mtp']['freeze_trunk'] and saved['data']['source'] == 'jsonl'


def test_metric_lines_go_to_an_offline_wandb_run_that_a_resume_continues(tmp_path):
  """train.wandb.project: the writer's rows also go to a Weights & Biases run, offline (no
  network, no account), under WORKDIR/wandb; a second writer on the workdir (a resume)
  continues the same run."""
  import ml_collections
  settings = ml_collections.ConfigDict({'project': 'mtp-test', 'mode': 'offline', 'name': ''})
  runs = []
  for step in (1, 2):
    writer = metrics_lib.MetricWriter(str(tmp_path), tensorboard=False, wandb=settings,
                                      run_config={'train': {'steps': 2}})
    writer.write(step, {'train/loss': 5.0 - step, 'perf/tokens_per_sec': 100.0 * step,
                        'train/skipped': float('nan')})
    writer.close()
    runs.append(sorted((tmp_path / 'wandb').glob('offline-run-*')))
  run_id = (tmp_path / 'wandb' / 'run_id').read_text().strip()
  assert len(runs[0]) == 1 and len(runs[1]) == 2, runs
  # One run, resumed: both folders record the same run id. (wandb names a folder by start time
  # and id, with '-1' added when the resume starts within the same second.)
  assert all((p / f'run-{run_id}.wandb').exists() for p in runs[1]), runs
  import time
  for path in runs[1]:  # the run's records (protobuf): the metric names, not the NaN one
    deadline = time.time() + 60  # wandb's service process writes them as finish() returns
    while b'train/loss' not in (data := (path / f'run-{run_id}.wandb').read_bytes()):
      assert time.time() < deadline, data
      time.sleep(0.5)
    assert b'train/loss' in data and b'perf/tokens_per_sec' in data
    assert b'train/skipped' not in data


def test_progress_off_hides_the_live_line_only():
  import io
  stream = io.StringIO()
  progress = metrics_lib.Progress(10, live=False, stream=stream)
  progress.update(3, 2.5, 1000.0)
  progress.message('devices: 2 cpu in 1 process, mesh data 2')
  progress.close()
  assert stream.getvalue() == 'devices: 2 cpu in 1 process, mesh data 2\n'
  quiet = metrics_lib.Progress(10, enabled=False, stream=stream)  # another process of a job
  quiet.message('eval @ 5: ...')
  quiet.update(5, 2.0, 900.0)
  assert stream.getvalue() == 'devices: 2 cpu in 1 process, mesh data 2\n'
