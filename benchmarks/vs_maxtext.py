"""This project against MaxText 0.2.5 on MaxText's CPU peer model, in interleaved pairs.

  python benchmarks/vs_maxtext.py --peer PATH/run_peer.sh --pairs 2 --rounds 10
  python benchmarks/vs_maxtext.py --peer PATH/run_peer.sh --depths 3 \\
    --out benchmarks/results/vs_maxtext.json

The model: 4 layers, d 256, 8 x 32 heads, no GQA, MLP 704, V 1024, batch 16 x 256,
float32 (train_throughput.maxtext_config). MaxText runs with remat_policy=minimal,
this project with model.remat=block (the same policy: matmul outputs without batch
dimensions saved); both at their own defaults otherwise (this project: the trainer's
CPU devices and allocator setting). For each of --pairs pairs and each depth, one
MaxText run and one process of this project (its median step over --rounds steps)
run back to back, the order flipped every other pair, so the host's drift over
minutes hits both sides alike; the ratio of a pair is this project's tokens/s over
MaxText's. The load average is recorded before and after every run.

The peer script (--peer) installs MaxText into its own Python >= 3.12 virtual
environment under --peer_root on first use and prints one JSON line per run; it is
not part of this repository.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import common  # benchmarks/common.py

NAME = 'vs_maxtext'

OURS = r'''
from mtp_jax.runtime import host_memory
host_memory.configure('auto')  # what the trainer does, before JAX starts
import jax
from mtp_jax.runtime import distributed
n = None if %(smoke)r else distributed.resolve_cpu_devices('auto')
if n:
  jax.config.update('jax_num_cpu_devices', n)
import common
import train_throughput as tt
tt.STEP_DEVICES = n or 1
common.emit(tt.bench_maxtext(%(rounds)d, (%(depth)d,), smoke=%(smoke)r))
'''


def parse(argv):
  p = common.parser(NAME, __doc__)
  p.add_argument('--peer', default='', help="MaxText's run_peer.sh (required)")
  p.add_argument('--peer_root', default=os.path.join(common.REPO, 'runs', 'peer_maxtext'),
                 help="the peer's virtual environment and logs")
  p.add_argument('--pairs', type=int, default=2, help='interleaved pairs per depth')
  p.add_argument('--depths', default='0,1,3', help='MTP depths, comma-separated')
  p.add_argument('--rounds', type=int, default=10, help='timed steps of this project per run')
  p.add_argument('--peer_steps', type=int, default=30, help="MaxText's steps per run")
  args = p.parse_args(argv)
  if not args.peer or not os.path.isfile(args.peer):
    p.error(f'--peer must name MaxText\'s run_peer.sh, got {args.peer or "nothing"!r}')
  try:
    args.depths = [int(d) for d in args.depths.split(',')]
  except ValueError:
    p.error(f'--depths must be comma-separated integers, got {args.depths!r}')
  if args.pairs < 1 or args.rounds < 1 or any(d < 0 for d in args.depths):
    p.error('--pairs and --rounds must be >= 1, --depths >= 0')
  if args.smoke:
    args.pairs, args.rounds, args.depths, args.peer_steps = 1, 1, args.depths[:1], 2
  return args


def _load(what: str) -> dict:
  return {'load_average': common.load_average(), 'what': what,
          'at': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}


def peer_run(args, depth: int) -> list:
  env = dict(os.environ, PEER_ROOT=args.peer_root, MTP_LIST=str(depth), DTYPE='float32',
             REMAT='minimal', STEPS=str(args.peer_steps), WAIT_IDLE_S='0')
  proc = subprocess.run(['bash', args.peer], env=env, capture_output=True, text=True, check=False)
  recs = [json.loads(l) for l in proc.stdout.splitlines() if l.strip().startswith('{')]
  if proc.returncode or not recs:
    tail = '\n'.join(proc.stderr.strip().splitlines()[-10:])
    raise SystemExit(f'error: the peer failed at M {depth} (exit {proc.returncode}):\n{tail}')
  return recs


def ours_run(args, depth: int) -> dict:
  env = dict(os.environ)
  if args.smoke:
    env.pop('XLA_FLAGS', None)
  code = OURS % {'rounds': args.rounds, 'depth': depth, 'smoke': args.smoke}
  return {'mtp_jax': common.run_child(code, env)}


def pairs(records: list) -> dict:
  """Every depth's k-th MaxText run and k-th run of this project form pair k."""
  peer, ours, loads = {}, {}, []
  for rec in records:
    if 'what' in rec:
      loads.append(rec['load_average'][0])
    elif 'mtp_num_layers' in rec:
      if rec.get('rc') != 0 or not rec.get('tokens_per_sec'):
        raise SystemExit(f'error: MaxText run M={rec["mtp_num_layers"]} failed: {rec}')
      peer.setdefault(int(rec['mtp_num_layers']), []).append(rec['tokens_per_sec'])
    elif 'mtp_jax' in rec:
      for d, v in rec['mtp_jax']['depths'].items():
        ours.setdefault(int(d), []).append(v['tokens_per_sec_median'])
  out = {'load_average_1min': {'min': min(loads), 'max': max(loads)} if loads else None,
         'depths': {}}
  for d in sorted(peer):
    n = min(len(peer[d]), len(ours.get(d, [])))
    ratios = [ours[d][k] / peer[d][k] for k in range(n)]
    out['depths'][str(d)] = {
        'maxtext_tokens_per_sec': peer[d][:n], 'mtp_jax_tokens_per_sec': ours.get(d, [])[:n],
        'ratios': [round(r, 3) for r in ratios],
        'ratio_median': round(common.median(ratios), 3) if ratios else None,
        'ratio_min': round(min(ratios), 3) if ratios else None,
        'ratio_max': round(max(ratios), 3) if ratios else None}
  return out


def main(argv=None) -> int:
  args = parse(argv)
  run = common.start(args, NAME, argv)
  records = []

  def peer(d):
    records.append(_load(f'maxtext M={d} start'))
    records.extend(peer_run(args, d))
    records.append(_load(f'maxtext M={d} end'))

  def ours(d):
    records.append(_load(f'mtp_jax M={d} start'))
    records.append(ours_run(args, d))
    records.append(_load(f'mtp_jax M={d} end'))

  for i in range(1, args.pairs + 1):
    for d in args.depths:
      for side in ((peer, ours) if i % 2 else (ours, peer)):
        side(d)
      print(json.dumps(records[-1]), file=sys.stderr, flush=True)
  summary = pairs(records)
  print(json.dumps(summary, indent=1))
  common.write(run, {'pairs': args.pairs, 'depths': args.depths, 'rounds': args.rounds,
                     'peer_steps': args.peer_steps, 'summary': summary, 'records': records})
  return 0


if __name__ == '__main__':
  sys.exit(main())
