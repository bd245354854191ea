"""Ratios from a `PAIRS=N bash benchmarks/vs_maxtext.sh OUT.jsonl` run.

Each depth's runs alternate peer / mtp_jax (order flipped every other pair), so the k-th
MaxText run and the k-th mtp_jax run of a depth form one pair, a few minutes apart. The
ratio of a pair is mtp_jax's median-step tokens/s over MaxText's median-step tokens/s;
the summary gives every pair's ratio, their median and range, and the load averages seen.

  python benchmarks/vs_maxtext_pairs.py OUT.jsonl [--json SUMMARY.json]
"""
import argparse
import collections
import json
import statistics


def pairs(lines: list) -> dict:
  peer, ours = collections.defaultdict(list), collections.defaultdict(list)
  loads = []
  for rec in lines:
    if 'load_average' in rec and 'what' in rec:
      loads.append(float(rec['load_average'].split()[0]))
    elif 'mtp_num_layers' in rec:
      if rec.get('rc') != 0 or not rec.get('tokens_per_sec'):
        raise SystemExit(f'MaxText run D={rec["mtp_num_layers"]} failed: {rec}')
      peer[rec['mtp_num_layers']].append(rec['tokens_per_sec'])
    elif 'mtp_jax' in rec:
      for d, v in rec['mtp_jax']['depths'].items():
        ours[int(d)].append(v['tokens_per_sec_median'])
  out = {'load_average_1min': {'min': min(loads), 'max': max(loads)} if loads else None,
         'depths': {}}
  for d in sorted(peer):
    n = min(len(peer[d]), len(ours[d]))
    ratios = [ours[d][k] / peer[d][k] for k in range(n)]
    out['depths'][str(d)] = {
        'maxtext_tokens_per_sec': peer[d][:n], 'mtp_jax_tokens_per_sec': ours[d][:n],
        'ratios': [round(r, 3) for r in ratios],
        'ratio_median': round(statistics.median(ratios), 3) if ratios else None,
        'ratio_min': round(min(ratios), 3) if ratios else None,
        'ratio_max': round(max(ratios), 3) if ratios else None}
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('jsonl')
  p.add_argument('--json', help='also write the summary here')
  a = p.parse_args()
  with open(a.jsonl) as f:
    lines = [json.loads(x) for x in f if x.strip()]
  out = pairs(lines)
  text = json.dumps(out, indent=1)
  print(text)
  if a.json:
    with open(a.json, 'w') as f:
      f.write(text + '\n')


if __name__ == '__main__':
  main()
