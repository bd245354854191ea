"""The main job's step-300 figures against README's table, within the spread seen across hosts.

  python benchmarks/main_job.py                          # trains it (runs/benchmarks/main_job_run)
  python benchmarks/main_job.py --workdir runs/stdlib_mtp  # a finished run of it

Trains `configs/stdlib_mtp.py` (300 steps; the same command as README's) unless --workdir
names a finished run, reads its last evaluation from metrics.jsonl and checks each figure of
README's table against the range the listed hosts gave, widened by SPREAD. The figures
depend on the host: XLA:CPU picks other kernels on other instruction sets, so float
reductions run in another order and the runs drift apart over 300 steps. Exit 1 when a
figure falls outside; the JSON records each figure, the range and the verdict.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import common  # benchmarks/common.py

NAME = 'main_job'
NOTE = ('Validation figures at the main job\'s last step; within: inside the listed hosts\' '
        'range widened by the spread. Speed is not compared (it is the host\'s and its load\'s).')
# Each host's figures at step 300 (None: not recorded). Keys: metrics.jsonl's eval keys.
HOSTS = {
    'AMD EPYC, AVX-512 (2 vCPU)': {
        'eval/bpb_main': 3.34, 'eval/bpb_mtp_1': 2.95, 'eval/bpb_mtp_2': 2.86,
        'eval/bpb_mtp_3': 2.81, 'eval/acc_main': 0.444, 'eval/agree_mtp_1': 0.65,
        'eval/agree_mtp_2': 0.63, 'eval/agree_mtp_3': 0.62, 'eval/decode_accept_mtp_1': 0.90,
        'eval/decode_accept_mtp_2': 0.83, 'eval/decode_accept_mtp_3': 0.83,
        'eval/decode_tau': 3.48},
    'Intel Xeon (2 vCPU)': {
        'eval/bpb_main': 3.29, 'eval/bpb_mtp_1': 2.92, 'eval/acc_main': 0.438,
        'eval/decode_accept_mtp_2': 0.85, 'eval/decode_accept_mtp_3': 0.84,
        'eval/decode_tau': 3.50},
    'AMD EPYC, AVX2 only (2 vCPU)': {
        'eval/bpb_main': 3.32, 'eval/bpb_mtp_1': 2.95, 'eval/bpb_mtp_2': 2.86,
        'eval/bpb_mtp_3': 2.82, 'eval/acc_main': 0.422, 'eval/agree_mtp_1': 0.63,
        'eval/agree_mtp_2': 0.61, 'eval/agree_mtp_3': 0.61, 'eval/decode_accept_mtp_1': 0.90,
        'eval/decode_accept_mtp_2': 0.86, 'eval/decode_accept_mtp_3': 0.82,
        'eval/decode_tau': 3.50},
}
# How far beyond the hosts' range a figure may fall, per kind of figure (README states it).
SPREAD = {'bpb': 0.08, 'acc': 0.012, 'agree': 0.03, 'decode_accept': 0.04, 'decode_tau': 0.1}


def spread_of(key: str) -> float:
  stat = key.split('/', 1)[1]
  return next(v for k, v in SPREAD.items() if stat.startswith(k))


def compare(figures: dict, hosts: dict = HOSTS) -> dict:
  """{key: {'value', 'low', 'high', 'within'}} for every key a host recorded."""
  out = {}
  for key in sorted({k for h in hosts.values() for k in h}):
    seen = [h[key] for h in hosts.values() if h.get(key) is not None]
    low, high = min(seen) - spread_of(key), max(seen) + spread_of(key)
    value = figures.get(key)
    out[key] = {'value': value, 'low': round(low, 4), 'high': round(high, 4),
                'within': value is not None and low <= value <= high}
  return out


def last_eval(workdir: str) -> dict:
  """The last metrics.jsonl row holding the decode figures (the final evaluation)."""
  rows = []
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    rows = [json.loads(line) for line in f if line.strip()]
  evals = [r for r in rows if 'eval/decode_tau' in r]
  if not evals:
    raise SystemExit(f'error: no evaluation with decode figures in {workdir}/metrics.jsonl')
  return evals[-1]


def parse(argv):
  p = common.parser(NAME, __doc__)
  p.add_argument('--workdir', help='a finished run of configs/stdlib_mtp.py (default: train one)')
  p.add_argument('--data_dir', help='data.data_dir for the run this script trains')
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse(argv)
  run = common.start(args, NAME, argv)
  workdir = args.workdir
  if workdir is None:
    workdir = os.path.join(os.path.dirname(os.path.abspath(args.out)), NAME + '_run')
    # the smoke's batch of 2 on one device, whatever device count the caller's XLA_FLAGS set
    extra = ['--cpu_devices=1', '--config.train.steps=2', '--config.train.warmup_steps=1',
             '--config.data.batch_size=2', '--config.train.eval_batches=1',
             '--config.train.eval_decode_prompts=1'] if args.smoke else []
    if args.data_dir:
      extra.append(f'--config.data.data_dir={args.data_dir}')
    subprocess.run([sys.executable, os.path.join(common.REPO, 'scripts', 'train.py'),
                    '--config', os.path.join(common.REPO, 'configs', 'stdlib_mtp.py'),
                    '--workdir', workdir, *extra], check=True)
  row = last_eval(workdir)
  table = compare(row)
  for key, r in table.items():
    value = '-' if r['value'] is None else f"{r['value']:.3f}"
    print(f"{key:28s} {value:>7s}  [{r['low']:.3f}, {r['high']:.3f}]  "
          f"{'ok' if r['within'] else 'OUTSIDE'}")
  common.write(run, {'step': row['step'], 'figures': table, 'hosts': HOSTS, 'spread': SPREAD,
                     'note': NOTE})
  return 0 if all(r['within'] for r in table.values()) or args.smoke else 1


if __name__ == '__main__':
  sys.exit(main())
