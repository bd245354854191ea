"""Start to first step with an empty and with a warm persistent compilation cache.

  python benchmarks/restart_time.py --rounds 3
  python benchmarks/restart_time.py --rounds 3 --out benchmarks/results/restart_time.json

Each round gives scripts/train.py a fresh train.compilation_cache_dir and runs the command
twice, each time in a new workdir: the first start (train.steps=1) compiles and fills the
cache; the rerun asks for more steps (--rerun_steps, as "resume with more steps" does) and
reads a copy of the cache in another directory (a cache moved or pre-warmed elsewhere).
Both starts of a round run
back to back, so they see the same background load. Per start it records the wall time
from launch to the 'Compiled the train step' line (the step runs right after it), the
trainer's own compile figure, the wall time of the whole run (which adds the final eval
and save), and the cache's entries after it. Ratio = median over rounds of rerun / first.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import common  # benchmarks/common.py

NAME = 'restart_time'
MARK = 'Compiled the train step in'
NOTE = ('Each round pairs a first start (empty cache) with a rerun reading it, back to back; '
        'compare within a round. to_first_step_s runs from launch to the trainer\'s '
        '"Compiled the train step" line; run_s adds the step, the final eval and save.')


def parse(argv):
  p = common.parser(NAME, __doc__)
  p.add_argument('--rounds', type=int, default=3, help='rounds of (first start, rerun)')
  p.add_argument('--config', default='configs/tiny.py', help='the config trained')
  p.add_argument('--rerun_steps', type=int, default=3,
                 help='train.steps of the rerun (the first start trains 1 step)')
  args = p.parse_args(argv)
  if args.rounds < 1:
    p.error('--rounds must be >= 1')
  if args.smoke:
    args.rounds = 1
  return args


def start(config: str, workdir: str, cache: str, smoke: bool, steps: int = 1) -> dict:
  """One training start; seconds to the compiled step and to the end of the run."""
  cmd = [sys.executable, os.path.join(common.REPO, 'scripts', 'train.py'), '--config',
         os.path.join(common.REPO, config), '--workdir', workdir, f'--config.train.steps={steps}',
         '--config.train.eval_every=0', '--config.train.checkpoint_every=0',
         '--config.train.eval_batches=1',
         f'--config.train.compilation_cache_dir={cache}']
  if smoke:
    cmd += ['--config.data.seq_len=32', '--config.data.batch_size=2']
  env = dict(os.environ, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
  env.pop('XLA_FLAGS', None)
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                          env=env, cwd=common.REPO)
  to_step, compile_s, tail = None, None, []
  for line in proc.stderr:
    tail = (tail + [line])[-15:]
    if to_step is None and MARK in line:
      to_step = time.perf_counter() - t0
      compile_s = float(re.search(r'in ([0-9.]+) s', line).group(1))
  rc = proc.wait()
  total = time.perf_counter() - t0
  if rc or to_step is None:
    raise SystemExit(f'error: the training start failed (exit {rc}):\n' + ''.join(tail))
  return {'to_first_step_s': to_step, 'train_step_compile_s': compile_s, 'run_s': total,
          'cache_entries': len(os.listdir(cache))}


def main(argv=None) -> int:
  args = parse(argv)
  run = common.start(args, NAME, argv)
  run.note = NOTE
  rounds = []
  with tempfile.TemporaryDirectory(prefix='restart_time_') as tmp:
    for i in range(args.rounds):
      cache = os.path.join(tmp, f'cache{i}')
      os.makedirs(cache)
      pair = {'first': start(args.config, os.path.join(tmp, f'run{i}_first'), cache, args.smoke)}
      copy = os.path.join(tmp, f'elsewhere{i}', 'cache')
      shutil.copytree(cache, copy)
      pair['rerun'] = start(args.config, os.path.join(tmp, f'run{i}_rerun'), copy, args.smoke,
                            args.rerun_steps)
      rounds.append(pair)
      print(json.dumps({'round': i, **pair}), file=sys.stderr, flush=True)
  summary = {
      'first_to_step_s_median': common.median([r['first']['to_first_step_s'] for r in rounds]),
      'rerun_to_step_s_median': common.median([r['rerun']['to_first_step_s'] for r in rounds]),
      'ratio_rerun_vs_first_median': common.median(
          [r['rerun']['to_first_step_s'] / r['first']['to_first_step_s'] for r in rounds]),
      'rerun_wrote_no_entry': all(r['rerun']['cache_entries'] == r['first']['cache_entries']
                                  for r in rounds)}
  print(json.dumps(summary, indent=1))
  common.write(run, {'config': args.config, 'rerun_steps': args.rerun_steps, 'rounds': rounds,
                     'summary': summary})
  return 0


if __name__ == '__main__':
  sys.exit(main())
