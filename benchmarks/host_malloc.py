"""The trainer's --host_malloc keep against system: page faults, system time, step time.

  python benchmarks/host_malloc.py --configs maxtext_M3 --rounds 2 --steps 8
  python benchmarks/host_malloc.py --rounds 3 --steps 6 --out benchmarks/results/host_malloc.json

The allocator setting is process-wide and must be made before JAX starts its threads
(mtp_jax/runtime/host_memory.py), so each mode runs in its own child process, the modes
interleaved round after round (odd rounds in reverse order). A child sets its mode,
trains on the trainer's CPU devices (--cpu_devices auto), compiles each of --configs
(train_throughput.named_config: the MaxText-shape step at M 0 / 1 / 3, configs/stdlib_mtp.py),
runs one warm-up step and then --steps timed steps, and reports per step the median and
best wall time, minor page faults and system CPU seconds (getrusage over the timed
steps), the peak resident set, and the first step's loss and gradient norm (the
allocator must not change them). Ratio = median over rounds of t(keep) / t(system).
"""
from __future__ import annotations

import json
import os
import sys

import common  # benchmarks/common.py

NAME = 'host_malloc'
MODES = ('system', 'keep')
CONFIGS = ('maxtext_M0', 'maxtext_M1', 'maxtext_M3', 'stdlib_mtp')

CHILD = r'''
import resource, statistics
from mtp_jax.runtime import host_memory  # standard library only: before JAX's first thread
mode = host_memory.configure(%(mode)r)
import jax
from mtp_jax.runtime import distributed
n = None if %(smoke)r else distributed.resolve_cpu_devices('auto')
if n:
  jax.config.update('jax_num_cpu_devices', n)
import common
import train_throughput as tt
tt.STEP_DEVICES = n or 1
out = {'mode': mode, 'devices': tt.STEP_DEVICES, 'runs': {}}
for name in %(configs)r:
  s = tt.Step(tt.named_config(name, smoke=%(smoke)r))
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
common.emit(out)
'''


def parse(argv):
  p = common.parser(NAME, __doc__)
  p.add_argument('--rounds', type=int, default=3, help='rounds; each runs one child per mode')
  p.add_argument('--steps', type=int, default=6, help='timed steps per config and child')
  p.add_argument('--configs', default=','.join(CONFIGS),
                 help=f'comma-separated, of {", ".join(CONFIGS)}')
  args = p.parse_args(argv)
  args.configs = common.names_flag(p, args.configs, CONFIGS, '--configs')
  if args.rounds < 1 or args.steps < 1:
    p.error('--rounds and --steps must be >= 1')
  if args.smoke:
    args.rounds, args.steps, args.configs = 1, 1, args.configs[:1]
  return args


def run_child(mode: str, steps: int, configs, smoke: bool) -> dict:
  env = dict(os.environ)
  if smoke:
    env.pop('XLA_FLAGS', None)  # one CPU device, whatever the caller forced
  return common.run_child(CHILD % {'mode': mode, 'steps': steps, 'configs': tuple(configs),
                                   'smoke': smoke}, env)


def summarize(rounds: dict, configs) -> dict:
  summary = {}
  for name in configs:
    pairs = [(k['runs'][name], s['runs'][name]) for k, s in zip(rounds['keep'], rounds['system'])]
    summary[name] = {
        'time_ratio_keep_vs_system_median': common.median(
            [k['median_s'] / s['median_s'] for k, s in pairs]),
        'best_ratio_keep_vs_system': (min(k['best_s'] for k, _ in pairs)
                                      / min(s['best_s'] for _, s in pairs)),
        **{f'{m}_{f}': common.median([p[i][f] for p in pairs])
           for i, m in enumerate(('keep', 'system'))
           for f in ('median_s', 'minflt_per_step', 'sys_s_per_step', 'max_rss_MiB')},
        'first_equal': all(k['first'] == s['first'] for k, s in pairs)}
  return summary


def main(argv=None) -> int:
  args = parse(argv)
  run = common.start(args, NAME, argv)
  rounds = {m: [] for m in MODES}
  for i in range(args.rounds):
    for mode in (MODES if i % 2 == 0 else MODES[::-1]):
      r = run_child(mode, args.steps, args.configs, args.smoke)
      rounds[mode].append(r)
      print(json.dumps({'round': i, 'variant': mode, **r}), file=sys.stderr, flush=True)
  summary = summarize(rounds, args.configs)
  print(json.dumps(summary, indent=1))
  common.write(run, {'steps': args.steps, 'configs': args.configs, 'rounds': rounds,
                     'summary': summary})
  return 0


if __name__ == '__main__':
  sys.exit(main())
