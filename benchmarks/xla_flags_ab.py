"""XLA:CPU flags A/B on the MaxText-shape train step: flags are process-wide, so each
variant runs in its own child process, the variants interleaved round after round.

  python benchmarks/xla_flags_ab.py --depth 0 --rounds 2 --steps 5 \
      --flags='|--xla_cpu_enable_concurrency_optimized_scheduler=false'

Each child compiles train_throughput.maxtext_config(depth), runs one warm-up step, then
--steps timed steps, and reports the median step time and the first step's loss and
gradient norm (same init and batch in every child: a flag that changes them beyond float
rounding changes numerics). Ratio = median over rounds of t(variant) / t(first variant)
in the same round (odd rounds run the variants in reverse order).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r'''
import json, statistics, sys
sys.path.insert(0, %(here)r)
import train_throughput as tt
s = tt.Step(tt.maxtext_config(%(depth)d))
times = [s.run()[0] for _ in range(%(steps)d)]
print('RESULT', json.dumps({'median_s': statistics.median(times), 'best_s': min(times),
                            'first': s.first, 'compile_s': s.compile_s}))
'''


def run_child(flags: str, depth: int, steps: int) -> dict:
  env = dict(os.environ, XLA_FLAGS=flags)
  code = CHILD % {'here': HERE, 'depth': depth, 'steps': steps}
  p = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True)
  lines = [l for l in p.stdout.splitlines() if l.startswith('RESULT ')]
  if not lines:
    return {'error': p.stderr[-1500:]}
  return json.loads(lines[-1][7:])


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--depth', type=int, default=0)
  ap.add_argument('--rounds', type=int, default=2)
  ap.add_argument('--steps', type=int, default=5)
  ap.add_argument('--flags', default='', help="flag sets separated by '|' (the first, often "
                  "empty = XLA's defaults, is the control); pass as --flags='|--xla_...'")
  ap.add_argument('--out', default='')
  a = ap.parse_args()
  a.flags = a.flags.split('|')
  out = {'depth': a.depth, 'load_start': os.getloadavg(), 'variants': {f: [] for f in a.flags}}
  for rnd in range(a.rounds):
    for f in (a.flags if rnd % 2 == 0 else a.flags[::-1]):  # odd rounds reversed: no order bias
      r = run_child(f, a.depth, a.steps)
      out['variants'][f].append(r)
      print(json.dumps({'flags': f, **r}), flush=True)
  base = a.flags[0]
  summary = {}
  for f, rs in out['variants'].items():
    ok = [(r, b) for r, b in zip(rs, out['variants'][base]) if 'median_s' in r and 'median_s' in b]
    if ok:
      summary[f] = {'time_ratio_vs_first_median': statistics.median(r['median_s'] / b['median_s'] for r, b in ok),
                    'median_s': statistics.median(r['median_s'] for r, _ in ok),
                    'first_step': ok[0][0]['first']}
  out['summary'] = summary
  out['load_end'] = os.getloadavg()
  print(json.dumps(summary, indent=1))
  if a.out:
    with open(a.out, 'w') as fh:
      json.dump(out, fh, indent=1)


if __name__ == '__main__':
  main()
