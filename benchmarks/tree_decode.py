"""Draft shapes side by side: AR, chains, trees and the picker's `auto` shape, in one process.

  python benchmarks/tree_decode.py --workdir runs/stdlib_mtp --chains 1,2,3 \
      --trees '2,1,1 2,2,1 0;1;0.0;0.0.0' --num_prompts 8 --prompt_len 64 \
      --max_new_tokens 128 --repeats 2 --batch_size 1 --temperature 0

Restores the latest checkpoint and takes held-out validation prompts: --num_prompts to
time, and as many other ones to measure the acceptance rates the picker reads
(acceptance.measure, not stored in the workdir here). Then calibrates this machine's cost
model (cost.calibrate; cached per model shape, backend and host, so only a first run pays
for it), lets the picker choose (`auto`), and decodes every batch of --batch_size timed
prompts greedily (or at --temperature, by sampling) with plain AR, each chain of --chains,
each tree of --trees (space-separated; a shape `3,2,1` or a node list `0;1;0.0`) and the
auto shape, alternating the variants per batch so that load from other processes hits all
of them alike; the fastest of --repeats runs counts. Per variant: tau, acceptance per
depth, rows verified per iteration, the matmul FLOPs of an iteration, tokens/s, the
speed-up over AR, and the cost model's expected tau and speed-up; then `auto` against the
best measured shape. Writes one run into --out, replacing the run of the same workdir,
temperature and batch size (a file from another machine is replaced whole). --smoke
decodes with a tiny random model and random prompts instead of a checkpoint.
"""
import json
import os
import sys
import time

import numpy as np

import common  # benchmarks/common.py

NAME = 'tree_decode'


def parse(argv):
  p = common.parser(NAME, __doc__)
  p.add_argument('--workdir', default='', help='training workdir of the model (required)')
  p.add_argument('--chains', default='', help='comma-separated chain lengths (default: 1..M)')
  p.add_argument('--trees', default='2,1,1 2,2,1', help='space-separated draft trees')
  p.add_argument('--num_prompts', type=int, default=8, help='timed validation prompts')
  p.add_argument('--prompt_len', type=int, default=64, help='prompt tokens')
  p.add_argument('--max_new_tokens', type=int, default=128)
  p.add_argument('--temperature', type=float, default=0.0, help='0: greedy')
  p.add_argument('--batch_size', type=int, default=1, help='prompts decoded together')
  p.add_argument('--max_rows', type=int, default=16, help="the picker's row budget")
  p.add_argument('--repeats', type=int, default=2, help='timed runs per prompt; the fastest counts')
  p.add_argument('--no_auto', action='store_true', help='leave out the picker')
  args = p.parse_args(argv)
  if args.smoke:
    args.num_prompts, args.prompt_len, args.max_new_tokens, args.repeats = 2, 8, 8, 1
    args.trees, args.batch_size, args.max_rows = '2,1', 1, 4
  elif not args.workdir:
    p.error('--workdir is required (the training workdir of the model to decode)')
  if args.num_prompts % args.batch_size:
    p.error('--num_prompts must be a multiple of --batch_size')
  return args


def merge(path: str, doc: dict) -> dict:
  """This run's object with `runs`: every run of the file at `path` and this one, the run
  of the same workdir, temperature and batch size replaced (a file from another CPU:
  none of its runs kept)."""
  try:
    with open(path) as f:
      old = json.load(f)
  except (OSError, ValueError):
    old = {}
  same_cpu = old.get('machine', {}).get('cpu') == doc['machine']['cpu']
  runs = old.get('runs', []) if same_cpu and not old.get('smoke') else []
  key = lambda r: (str(r['result']['workdir']), r['result']['temperature'],  # noqa: E731
                   r['result'].get('batch_size', 1))
  run = {k: v for k, v in doc.items() if k not in ('benchmark', 'machine', 'note', 'smoke')}
  runs = [r for r in runs if key(r) != key(run)] + [run]
  return doc | {'runs': sorted(runs, key=key)}


def main(argv=None) -> int:
  args = parse(argv)
  # pylint: disable=import-outside-toplevel
  from mtp_jax import checkpoint, train_state
  from mtp_jax.data import tokenizers
  from mtp_jax.decode import Decoder, acceptance, cost, picker
  from mtp_jax.train import evaluation
  # pylint: enable=import-outside-toplevel

  run = common.start(args, NAME, argv)
  run.note = ('AR, the chains, the trees and the auto shape alternate per batch of prompts in '
              'one process, so load hits all alike; the fastest of --repeats runs counts. '
              'expected_*: the picker\'s models (acceptance rates measured on other held-out '
              'prompts, the cost model calibrated on this machine). flops_per_iteration: '
              'matmul FLOPs of the weights in one verify step (attention over the cache '
              'left out).')
  n = args.num_prompts
  if args.smoke:
    import decode_speed  # pylint: disable=import-outside-toplevel
    config, step = decode_speed.smoke_config(), 0
    model = decode_speed.random_model(config, config.model.d_model, config.model.n_layers)
    rng = np.random.default_rng(0)
    everything = rng.integers(1, config.model.vocab_size, (2 * n, args.prompt_len)).tolist()
  else:
    config, step = checkpoint.load_workdir(args.workdir)
    model = train_state.restore_model(config, args.workdir, step)
    tokenizer = tokenizers.get_tokenizer(config.data)
    everything = evaluation.validation_prompts(config, tokenizer, 2 * n, args.prompt_len)
  prompts, held_out = everything[::2], everything[1::2]
  depth = int(config.model.mtp.depth)
  base = Decoder(model)
  chains = ([int(c) for c in args.chains.split(',')] if args.chains
            else list(range(1, depth + 1)))
  variants = {'ar': (None, 0)} | {f'chain {a}': (None, a) for a in chains}
  variants |= {f'tree {t}': (t, None) for t in args.trees.split()}
  kw = dict(eos_id=None, pad_to=(args.prompt_len, args.max_new_tokens),
            temperature=args.temperature)
  t0 = time.perf_counter()
  auto = None
  if not args.no_auto:
    max_depth = cost.max_depth(model.args)
    acc = acceptance.measure(base, held_out, args.max_new_tokens, depths=max_depth,
                             temperature=args.temperature, batch_size=args.batch_size)
    accept_s = time.perf_counter() - t0
    cal = cost.calibrate(base, args.batch_size, args.prompt_len, args.max_new_tokens,
                         temperature=args.temperature, max_rows=args.max_rows,
                         depth=max_depth, log=lambda s: print(s, file=sys.stderr))
    auto = picker.choose(acc, cal, max_depth=max_depth, max_rows=args.max_rows)
    print(auto.line(), file=sys.stderr)
    variants['auto'] = (auto.tree, None if auto.tree else auto.num_drafts)
  decs = {name: base.with_tree(t) for name, (t, _) in variants.items()}
  t1 = time.perf_counter()
  for name, dec in decs.items():
    dec.compile(dec.program(args.batch_size, args.prompt_len, args.max_new_tokens,
                            num_drafts=variants[name][1], temperature=args.temperature))
  compile_s = time.perf_counter() - t1
  batches = [prompts[i:i + args.batch_size] for i in range(0, n, args.batch_size)]
  best = {v: [np.inf] * len(batches) for v in decs}
  runs = {}
  for _ in range(args.repeats):
    for i, p in enumerate(batches):
      for name, dec in decs.items():  # alternate: every variant sees the same load
        r = dec.generate(p, args.max_new_tokens, num_drafts=variants[name][1], seed=i, **kw)
        best[name][i] = min(best[name][i], r.seconds)
        runs[name, i] = r
  seconds = {v: sum(b) for v, b in best.items()}
  rows = []
  for name in decs:
    rs = [runs[name, i] for i in range(len(batches))]
    verify = sum(int(r.verify_steps.sum()) for r in rs)
    new = sum(r.new_tokens for r in rs)
    tree, drafts = variants[name]
    row = {'variant': name, 'new_tokens': new, 'tokens_per_sec': new / seconds[name],
           'speedup_over_ar': seconds['ar'] / seconds[name],
           'ms_per_iteration': 1e3 * seconds[name] / sum(r.steps for r in rs)}
    if name != 'ar':
      hist = sum(r.accepted.sum(0) for r in rs)
      st = rs[0].stats()
      row |= {
          'identical_to_ar': None if args.temperature else all(
              np.array_equal(a, b) for x, y in zip(rs, [runs['ar', i] for i in
                                                          range(len(batches))])
              for a, b in zip(x.tokens, y.tokens)),
          'tau': sum(int(r.committed.sum()) for r in rs) / verify,
          'acceptance_per_depth': [float(hist[k:].sum() / verify) for k in range(1, len(hist))],
          'verify_rows_per_iteration': st['verify_rows_per_iteration'],
          'flops_per_iteration': st['flops_per_iteration']}
    if auto is not None:
      t = None if tree is None else decs[name].tree
      a = drafts if t is None else t.depth
      row |= {'expected_tau': acc.expected_tau(t, a),
              'expected_ms_per_iteration': 1e3 * cal.seconds(t, a),
              'expected_speedup_over_ar': (acc.expected_tau(t, a) / cal.seconds(t, a))
                                          / (1 / cal.seconds(None, 0))}
    rows.append(row)
    print(json.dumps(row), file=sys.stderr)
  report = {
      'workdir': os.path.relpath(os.path.abspath(args.workdir), common.REPO) if args.workdir
                 else None, 'step': step,
      'model': {k: config.model[k] for k in ('d_model', 'n_layers', 'n_heads', 'mlp_dim')}
      | {'mtp_depth': depth},
      'prompts': len(prompts), 'prompt_len': args.prompt_len, 'batch_size': args.batch_size,
      'max_new_tokens': args.max_new_tokens, 'temperature': args.temperature,
      'compile_seconds': compile_s, 'results': rows}
  if auto is not None:
    measured = [r for r in rows if r['variant'] != 'auto']
    top = max(measured, key=lambda r: r['speedup_over_ar'])
    mine = next(r for r in rows if r['variant'] == 'auto')
    report['auto'] = {
        'chosen': auto.best.name, 'line': auto.line(), 'shapes_considered': len(auto.ranked),
        'best_measured': top['variant'],
        'speedup_vs_best_measured': mine['speedup_over_ar'] / top['speedup_over_ar'],
        'expected_tau': mine['expected_tau'], 'measured_tau': mine.get('tau', 1.0),
        'expected_speedup_over_ar': mine['expected_speedup_over_ar'],
        'measured_speedup_over_ar': mine['speedup_over_ar'],
        'acceptance': acc.to_json(), 'acceptance_seconds': accept_s,
        'cost': cal.to_json(), 'calibration_seconds': t1 - t0 - accept_s}
    print(json.dumps({k: v for k, v in report['auto'].items()
                      if k not in ('acceptance', 'cost', 'line')}), file=sys.stderr)
  print(json.dumps(report, indent=1))
  doc = run.envelope() | {'result': report}
  run.release()
  doc = merge(args.out, doc)
  common.write_doc(doc, args.out)
  return 0


if __name__ == '__main__':
  sys.exit(main())
