"""kill -9 chaos: trains configs/tiny.py while SIGKILLing it at random moments, then checks
that nothing was lost.

  python scripts/chaos_train.py [--kills 10] [--seed 0] [--workdir runs/chaos]

1. An uninterrupted reference run of scripts/train.py.
2. The same command in another workdir, SIGKILLed `--kills` times and restarted each
   time with the very same command. Kill moments, drawn from --seed: while a checkpoint
   is being written (an `*.orbax-checkpoint-tmp` directory exists), at a random time
   while steps run, or at a random time during start-up / restore.
3. Compares the final parameters (bit for bit) and every logged training / eval number
   (each logged step, including steps redone after a kill) with the reference.

Prints kills, resumes, lost steps (steps redone after a kill) and `identical: true/false`;
exits 0 only when identical.
"""
import argparse
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TMP_MARKER = '.orbax-checkpoint-tmp'


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--kills', type=int, default=10, help='SIGKILLs to deliver (at least)')
  p.add_argument('--seed', type=int, default=0, help='seeds the kill schedule')
  p.add_argument('--workdir', default=os.path.join('runs', 'chaos'),
                 help='reference/ and chaos/ go here')
  p.add_argument('--data_dir', default='', help='passed as --config.data.data_dir')
  p.add_argument('--steps', type=int, default=40)
  p.add_argument('--checkpoint_every', type=int, default=4)
  p.add_argument('--timeout', type=float, default=1200, help='seconds for the whole chaos phase')
  return p.parse_args()


def train_command(args, workdir):
  cmd = [sys.executable, os.path.join(REPO, 'scripts', 'train.py'),
         '--config', os.path.join(REPO, 'configs', 'tiny.py'), f'--workdir={workdir}',
         f'--config.train.steps={args.steps}', '--config.train.log_every=1',
         f'--config.train.checkpoint_every={args.checkpoint_every}',
         f'--config.train.eval_every={args.steps // 2}', '--config.train.eval_batches=1']
  if args.data_dir:
    cmd.insert(4, f'--config.data.data_dir={args.data_dir}')
  return cmd


def environment(args):
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1')
  # Every restart would otherwise recompile the same programs.
  env.setdefault('JAX_COMPILATION_CACHE_DIR', os.path.join(args.workdir, 'jax_cache'))
  env.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  return env


def read_log(workdir):
  """[(step, kind, numbers)] in file order, timings dropped."""
  rows = []
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return rows
  for line in pathlib.Path(path).read_text().splitlines(keepends=True):
    if not line.endswith('\n'):
      break  # cut short by the kill; the next run repairs it
    row = {k: v for k, v in json.loads(line).items() if not k.startswith('perf/')}
    step = row.pop('step')
    rows.append((step, 'eval' if any(k.startswith('eval/') for k in row) else 'train', row))
  return rows


def saves_in_progress(ckpt_dir) -> set:
  """Steps whose checkpoint is being written (an incomplete orbax temporary directory)."""
  try:
    return {n.split('.')[0] for n in os.listdir(ckpt_dir) if TMP_MARKER in n}
  except FileNotFoundError:
    return set()


def tmp_dir_ids(ckpt_dir) -> set:
  """(name, inode, ctime) of incomplete checkpoint directories: tells a new one from a stale
  one of the same name (a step saved again after a resume)."""
  out = set()
  for name in saves_in_progress_names(ckpt_dir):
    try:
      st = os.stat(os.path.join(ckpt_dir, name))
    except FileNotFoundError:
      continue
    out.add((name, st.st_ino, st.st_ctime_ns))
  return out


def saves_in_progress_names(ckpt_dir) -> list:
  try:
    return [n for n in os.listdir(ckpt_dir) if TMP_MARKER in n]
  except FileNotFoundError:
    return []


def latest_checkpoint(ckpt_dir) -> int:
  try:
    return max([int(n) for n in os.listdir(ckpt_dir) if n.isdigit()] + [0])
  except FileNotFoundError:
    return 0


def final_params(workdir):
  # JAX starts only here: the chaos loop itself only runs and kills subprocesses.
  from mtp_jax import checkpoint  # pylint: disable=g-import-not-at-top
  ckpt_dir = os.path.join(workdir, 'checkpoints')
  step = max(int(n) for n in os.listdir(ckpt_dir) if n.isdigit())
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    return step, checkpoint.read_state_arrays(ckpt_dir, step)


def chaos(args, workdir, env):
  """Runs the command until it completes, SIGKILLing it args.kills times. Returns the kills."""
  rng = random.Random(args.seed)
  n_save = max(2, args.kills * 2 // 5)
  n_startup = max(1, args.kills // 10)
  modes = ['save'] * n_save + ['startup'] * n_startup + ['step'] * (args.kills - n_save - n_startup)
  rng.shuffle(modes)
  ckpt_dir = os.path.join(workdir, 'checkpoints')
  kills, lives = [], []
  deadline = time.time() + args.timeout
  while True:
    logged_before = len(read_log(workdir))
    log_path = os.path.join(workdir, f'life_{len(lives)}.stderr')
    os.makedirs(workdir, exist_ok=True)
    with open(log_path, 'w') as err:
      proc = subprocess.Popen(train_command(args, workdir), stdout=subprocess.DEVNULL,
                              stderr=err, env=env, cwd=REPO)
    mode = modes[len(kills)] if len(kills) < len(modes) else None
    t0 = time.time()
    stale_ids = tmp_dir_ids(ckpt_dir)
    base = latest_checkpoint(ckpt_dir)
    if mode == 'startup':  # imports, compilation, restore
      target = t0 + rng.uniform(0.5, 6.0)
      while proc.poll() is None and time.time() < target:
        time.sleep(0.01)
    elif mode == 'step':  # a random moment once this life is a few steps past its checkpoint
      # Before the first checkpoint a kill only restarts from scratch; aim past it.
      low = 1 if base else args.checkpoint_every + 1
      target_step = base + rng.randint(low, 2 * args.checkpoint_every)
      while proc.poll() is None and max(
          [s for s, _, _ in read_log(workdir)[logged_before:]] + [0]) < target_step:
        time.sleep(0.01)
      target = time.time() + rng.uniform(0.0, 0.3)
      while proc.poll() is None and time.time() < target:
        time.sleep(0.002)
    elif mode == 'save':  # while the n-th checkpoint of this life is being written
      nth, seen = rng.randint(1 if base else 2, 3), set()
      stale = saves_in_progress(ckpt_dir)  # left by the last kill; the new process removes it
      while proc.poll() is None and stale & saves_in_progress(ckpt_dir):
        time.sleep(0.001)
      while proc.poll() is None and len(seen) < nth:
        seen |= saves_in_progress(ckpt_dir)
        time.sleep(0.001)
    if mode is not None and proc.poll() is None:
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      in_save = bool(tmp_dir_ids(ckpt_dir) - stale_ids)  # a kill mid-save leaves one
      kills.append({'mode': mode, 'in_save': in_save, 'after_s': time.time() - t0})
      lives.append({'rc': -9, 'log': log_path, 'logged': read_log(workdir)[logged_before:]})
    else:
      remaining = max(1.0, deadline - time.time())
      rc = proc.wait(timeout=remaining)
      lives.append({'rc': rc, 'log': log_path, 'logged': read_log(workdir)[logged_before:]})
      if rc != 0:
        raise SystemExit(f'training exited with {rc} after {len(kills)} kills; see {log_path}')
      return kills, lives
    if time.time() > deadline:
      raise SystemExit(f'chaos phase exceeded --timeout {args.timeout} s')


def resumed_step(log_path):
  for line in pathlib.Path(log_path).read_text().splitlines():
    if line.startswith('Resumed from') and ' at step ' in line:
      return int(line.split(' at step ')[1].split('.')[0])
  return None


def main():
  args = parse_args()
  ref_dir, chaos_dir = (os.path.join(args.workdir, n) for n in ('reference', 'chaos'))
  for d in (ref_dir, chaos_dir):
    shutil.rmtree(d, ignore_errors=True)
  env = environment(args)

  t0 = time.time()
  ref = subprocess.run(train_command(args, ref_dir), stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
  if ref.returncode:
    raise SystemExit(f'reference run failed ({ref.returncode}):\n{ref.stderr[-3000:]}')
  print(f'reference run: {args.steps} steps, {time.time() - t0:.1f} s')

  t0 = time.time()
  kills, lives = chaos(args, chaos_dir, env)
  print(f'chaos run: {len(lives)} processes, {time.time() - t0:.1f} s')

  # Steps redone after each kill: how far the killed process had logged, minus where the
  # next process resumed.
  resumes, fresh, unstarted, lost = 0, 0, 0, 0
  reached = 0  # the furthest step logged so far by the current line of progress
  for i, life in enumerate(lives):
    steps = [s for s, kind, _ in life['logged'] if kind == 'train']
    start = resumed_step(life['log'])
    if i > 0:
      if start is not None:
        resumes += 1
      elif steps:
        fresh += 1  # no checkpoint existed yet: started again from step 0
        start = 0
      else:
        unstarted += 1  # killed during start-up, before it could restore anything
    if start is not None:
      lost += max(0, reached - start)
      reached = start
    reached = max([reached] + steps)

  ref_log, chaos_log = read_log(ref_dir), read_log(chaos_dir)
  want = {(s, k): row for s, k, row in ref_log}
  log_diffs = [(s, k) for s, k, row in chaos_log if want.get((s, k)) != row]
  missing = set(want) - {(s, k) for s, k, _ in chaos_log}
  ref_step, ref_params = final_params(ref_dir)
  chaos_step, chaos_params = final_params(chaos_dir)
  import numpy as np  # pylint: disable=g-import-not-at-top
  same_params = (ref_step == chaos_step and len(ref_params) == len(chaos_params)
                 and all(np.array_equal(a, b) for a, b in zip(ref_params, chaos_params)))
  identical = same_params and not log_diffs and not missing

  by_mode = {m: sum(k['mode'] == m for k in kills) for m in ('save', 'step', 'startup')}
  print(f'kills: {len(kills)}')
  in_save = sum(k['in_save'] for k in kills)
  print(f'kills during saves: {in_save}')
  print(f'kills between saves: {len(kills) - in_save}')
  print(f'kill moments: {by_mode["save"]} aimed at saves, {by_mode["step"]} while steps ran, '
        f'{by_mode["startup"]} during start-up/restore')
  print(f'resumes: {resumes}')
  print(f'restarts from scratch (killed before the first checkpoint): {fresh}')
  print(f'restarts killed during start-up, before restoring: {unstarted}')
  print(f'lost steps: {lost}')
  print(f'logged rows compared: {len(chaos_log)} (reference {len(ref_log)}), '
        f'differing: {len(log_diffs)}, missing: {len(missing)}')
  print(f'final step: reference {ref_step}, chaos {chaos_step}; parameters bit-identical: '
        f'{str(same_params).lower()}')
  print(f'identical: {str(identical).lower()}')
  if log_diffs or missing:
    print(f'first differences: {sorted(log_diffs)[:5]} missing: {sorted(missing)[:5]}')
  sys.exit(0 if identical else 1)


if __name__ == '__main__':
  main()
