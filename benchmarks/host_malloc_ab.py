"""--host_malloc keep against system on the train steps: page faults, system time, step time.

  python benchmarks/host_malloc_ab.py --rounds 3 --steps 6 --out benchmarks/host_malloc_ab.json

The allocator setting is process-wide and must be made before JAX starts its threads
(mtp_jax/runtime/host_memory.py), so each variant runs in its own child process, the variants
interleaved round after round (odd rounds in reverse order). Each child sets its mode,
then trains on the trainer's CPU devices (--cpu_devices auto), compiles the MaxText-shape
step at D 0 / 1 / 3 and configs/stdlib_mtp.py, runs two warm-up steps of each and then
--steps timed steps, and reports per step: the median and best wall time, minor page
faults and system CPU seconds (getrusage over the timed steps), with the first step's loss
and gradient norm (the allocator must not change them). Ratio = median over rounds of
t(keep) / t(system) in the same round.
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
import json, resource, statistics, sys
sys.path.insert(0, %(here)r)
from mtp_jax.runtime import host_memory  # standard library only: configure before JAX's first thread
mode = host_memory.configure(%(mode)r)
import jax
from mtp_jax.runtime import distributed
n = distributed.resolve_cpu_devices('auto')
if n:
  jax.config.update('jax_num_cpu_devices', n)
import train_throughput as tt
tt.STEP_DEVICES = n or 1
out = {'mode': mode, 'devices': tt.STEP_DEVICES, 'runs': {}}
for name in %(configs)r:
  c = tt.load_config('stdlib_mtp') if name == 'stdlib_mtp' else tt.maxtext_config(int(name[-1]))
  s = tt.Step(c)
  s.run()
  r0 = resource.getrusage(resource.RUSAGE_SELF)
  times = [s.run()[0] for _ in range(%(steps)d)]
  r1 = resource.getrusage(resource.RUSAGE_SELF)
  k = len(times)
  out['runs'][name] = {'median_s': statistics.median(times), 'best_s': min(times),
                       'minflt_per_step': (r1.ru_minflt - r0.ru_minflt) / k,
                       'sys_s_per_step': (r1.ru_stime - r0.ru_stime) / k,
                       'user_s_per_step': (r1.ru_utime - r0.ru_utime) / k,
                       'max_rss_MiB': r1.ru_maxrss / 1024, 'first': s.first, 'temp_MiB': s.temp_mib}
  del s
print('RESULT', json.dumps(out))
'''

CONFIGS = ('maxtext_D0', 'maxtext_D1', 'maxtext_D3', 'stdlib_mtp')


def run_child(mode: str, steps: int, configs) -> dict:
  code = CHILD % {'here': HERE, 'mode': mode, 'steps': steps, 'configs': tuple(configs)}
  p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=False)
  lines = [l for l in p.stdout.splitlines() if l.startswith('RESULT ')]
  if not lines:
    return {'error': p.stderr[-1500:]}
  return json.loads(lines[-1][7:])


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--rounds', type=int, default=3)
  ap.add_argument('--steps', type=int, default=6)
  ap.add_argument('--configs', default=','.join(CONFIGS))
  ap.add_argument('--out', default='')
  a = ap.parse_args()
  configs = a.configs.split(',')
  modes = ('system', 'keep')
  out = {'load_start': os.getloadavg(), 'steps': a.steps, 'rounds': {m: [] for m in modes}}
  for rnd in range(a.rounds):
    for m in (modes if rnd % 2 == 0 else modes[::-1]):
      r = run_child(m, a.steps, configs)
      out['rounds'][m].append(r)
      print(json.dumps({'round': rnd, 'variant': m, **r}), flush=True)
  summary = {}
  for name in configs:
    pairs = [(k['runs'][name], s['runs'][name]) for k, s in zip(out['rounds']['keep'], out['rounds']['system'])
             if 'runs' in k and 'runs' in s]
    if not pairs:
      continue
    summary[name] = {
        'time_ratio_keep_vs_system_median': statistics.median(k['median_s'] / s['median_s'] for k, s in pairs),
        'best_ratio_keep_vs_system': min(k['best_s'] for k, _ in pairs) / min(s['best_s'] for _, s in pairs),
        **{f'{m}_{f}': statistics.median(p[i][f] for p in pairs)
           for i, m in enumerate(('keep', 'system'))
           for f in ('median_s', 'minflt_per_step', 'sys_s_per_step', 'max_rss_MiB')},
        'first_equal': all(k['first'] == s['first'] for k, s in pairs)}
  out['summary'] = summary
  out['load_end'] = os.getloadavg()
  print(json.dumps(summary, indent=1))
  if a.out:
    with open(a.out, 'w') as f:
      json.dump(out, f, indent=1)


if __name__ == '__main__':
  main()
