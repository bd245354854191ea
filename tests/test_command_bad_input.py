"""Every user command's bad input, a case per command: exit 2, one `error:` line, no traceback,
and nothing on disk changed.

Each case runs a command on input that is refused before anything compiles, in a folder
of its own; a snapshot of that folder (names, sizes, modification times) before and after
must match. The first case of each command (a flag error, refused in a fraction of a
second) and every training case run as a user does: scripts/<name>.py in a fresh process.
The others call the command's main(argv) in this process (the same code after the
imports, without their seconds of start-up; the trainer's sets up JAX, so it runs apart).
"""
import concurrent.futures
import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
import traceback

from helpers import REPO

TINY = os.path.join(REPO, 'configs', 'tiny.py')
MODULES = {'train': 'train', 'decode': 'decode', 'eval': 'evaluate', 'export': 'export',
           'self_distill': 'self_distill', 'plot': 'plot', 'ablation': 'ablation'}

# (command, arguments, words of the error line); paths are relative to the case folder.
CASES = [
    ('train', ['--config', TINY, '--config.train.stepz=3'], ['stepz']),
    ('train', ['--config', 'no_such_config.py'], ['no_such_config.py']),
    ('train', ['--config', TINY, '--workdir', 'a_file'], ['a_file', 'not a directory']),
    ('train', ['--config', TINY, '--workdir', 'w', '--config.data.source=jsonl',
               '--config.data.path=empty'], ['contains no .jsonl files', 'point data.path']),
    ('train', ['--config', TINY, '--workdir', 'w', '--config.data.source=jsonl',
               '--config.data.path=missing.jsonl'], ['missing.jsonl']),
    ('train', ['--config', TINY, '--cpu_devices=many'], ['--cpu_devices']),
    ('decode', ['--workdir', 'broken', '--mode', 'fast'], ['--mode']),
    ('decode', ['--workdir', 'missing', '--prompt', 'def '], ['does not exist']),
    ('decode', ['--workdir', 'empty', '--prompt', 'def '], ['no checkpoints/ directory']),
    ('decode', ['--workdir', 'broken', '--prompt', 'def '], ['step 5', 'Nothing was changed']),
    ('eval', ['--workdir', 'broken', '--step', 'last'], ['--step']),
    ('eval', ['--workdir', 'missing'], ['does not exist']),
    ('eval', ['--workdir', 'broken', '--eval_batches', '0'], ['--eval_batches']),
    ('eval', ['--workdir', 'broken'], ['step 5']),
    ('export', ['--workdir', 'broken', '--out', 'out', '--layout', 'llama2'], ['--layout']),
    ('export', ['--workdir', 'missing', '--out', 'out', '--layout', 'mimo'], ['does not exist']),
    ('export', ['--workdir', 'broken', '--out', 'a_dir', '--layout', 'mimo'], ['a_dir']),
    ('export', ['--workdir', 'broken', '--out', 'out', '--layout', 'mimo', '--shard_mb', '0'],
     ['--shard_mb']),
    ('self_distill', ['--workdir', 'broken', '--out', 'out', '--num_prompts', 'many'],
     ['--num_prompts']),
    ('self_distill', ['--workdir', 'missing', '--out', 'out'], ['does not exist']),
    ('self_distill', ['--workdir', 'broken', '--out', 'out'], ['step 5']),
    ('plot', ['--workdir', 'empty'], ['no metrics.jsonl']),
    ('plot', [], ['exactly one of --workdir']),
    ('ablation', ['--seeds', '0,x'], ['--seeds']),
    ('ablation', ['--groups', 'nope', '--no_run'], ['nope']),
]


def _tree(root) -> dict:
  """{relative path: (size, mtime_ns)} of everything under root (directories included)."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames + filenames:
      path = os.path.join(dirpath, name)
      st = os.lstat(path)
      out[os.path.relpath(path, root)] = (st.st_size if name in filenames else 0, st.st_mtime_ns)
  return out


def _make_inputs(root):
  """The folder a case runs in: an empty folder, a file, a broken checkpoint, a full folder."""
  os.makedirs(os.path.join(root, 'empty'))
  with open(os.path.join(root, 'a_file'), 'w') as f:
    f.write('not a directory\n')
  meta = os.path.join(root, 'broken', 'checkpoints', '5', 'meta')
  os.makedirs(meta)
  os.makedirs(os.path.join(root, 'broken', 'checkpoints', '5', 'state'))
  with open(os.path.join(meta, 'metadata'), 'w') as f:
    f.write('{"step": 5, "config": ')  # cut short
  with open(os.path.join(root, 'broken', 'config.json'), 'w') as f:
    json.dump({}, f)
  os.makedirs(os.path.join(root, 'a_dir'))
  with open(os.path.join(root, 'a_dir', 'keep.txt'), 'w') as f:
    f.write('a user file\n')


class Result:
  def __init__(self, returncode, stdout, stderr):
    self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _run(case, root):
  command, args, _ = case
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, os.path.join(REPO, 'scripts', f'{command}.py'), *args],
                        capture_output=True, text=True, cwd=root, env=env, timeout=300)


def _run_here(case, root):
  """main(argv) in this process, in `root`; an escaping exception is a traceback."""
  command, args, _ = case
  main = importlib.import_module(f'mtp_jax.commands.{MODULES[command]}').main
  out, err = io.StringIO(), io.StringIO()
  cwd = os.getcwd()
  os.chdir(root)
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      try:
        code = main(args)
      except SystemExit as e:  # argparse's error()
        code = e.code
      except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
        code = None
  finally:
    os.chdir(cwd)
  return Result(code, out.getvalue(), err.getvalue())


def _in_process(i: int) -> bool:
  command = CASES[i][0]
  return command != 'train' and any(c[0] == command for c in CASES[:i])


def test_every_command_refuses_bad_input_in_one_line_and_changes_nothing(tmp_path):
  roots = []
  for i in range(len(CASES)):
    roots.append(str(tmp_path / f'case_{i}'))
    _make_inputs(roots[-1])
  before = [_tree(r) for r in roots]
  procs = [None] * len(CASES)
  fresh = [i for i in range(len(CASES)) if not _in_process(i)]
  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    for i, proc in zip(fresh, pool.map(lambda i: _run(CASES[i], roots[i]), fresh)):
      procs[i] = proc
  for i in range(len(CASES)):
    if procs[i] is None:
      procs[i] = _run_here(CASES[i], roots[i])
  failures = []
  for case, root, snapshot, proc in zip(CASES, roots, before, procs):
    command, args, words = case
    errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
    problems = []
    if proc.returncode != 2:
      problems.append(f'exit {proc.returncode}')
    if len(errors) != 1:
      problems.append(f'{len(errors)} error lines')
    if 'Traceback' in proc.stderr + proc.stdout:
      problems.append('a traceback')
    problems += [f'{w!r} not in the error' for w in words if not errors or w not in errors[0]]
    after = _tree(root)
    if after != snapshot:
      changed = sorted(set(after.items()) ^ set(snapshot.items()))
      problems.append(f'files changed: {changed[:5]}')
    if problems:
      failures.append(f'{command} {" ".join(args)}: {"; ".join(problems)}\n'
                      f'  stderr: {proc.stderr[-600:]!r}')
  assert not failures, '\n'.join(failures)


def test_the_catalogue_covers_every_user_command():
  assert set(MODULES) == {c[0] for c in CASES}
  for command in MODULES:
    assert os.path.isfile(os.path.join(REPO, 'scripts', f'{command}.py')), command
