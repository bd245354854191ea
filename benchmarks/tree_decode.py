"""Tree drafting vs the chain vs AR: tau and wall-clock, side by side in one run.

  python benchmarks/tree_decode.py --workdir runs/stdlib_mtp --trees '3,2,1 2,2,1 2,1,1' \
      --num_prompts 8 --prompt_len 64 --max_new_tokens 128 --repeats 2

Restores the latest checkpoint, takes held-out validation prompts and decodes each one
greedily (or at --temperature, by sampling) with plain AR, the chain of every drafting
depth and each tree of --trees (space-separated; each a shape `3,2,1` or a node list
`0;1;0.0`), alternating the variants per prompt so that load from other processes hits
all of them alike; the fastest of --repeats runs counts. Prints one JSON object: per
variant tau, acceptance per depth, rows verified per iteration, the matmul FLOPs of an
iteration, tokens/s and the speed-up over AR and over the chain. --smoke decodes with a
tiny random model and random prompts instead of a checkpoint.
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
  p.add_argument('--trees', default='3,2,1 2,2,1 2,1,1', help='space-separated draft trees')
  p.add_argument('--num_prompts', type=int, default=8, help='validation prompts, batch 1')
  p.add_argument('--prompt_len', type=int, default=64, help='prompt tokens')
  p.add_argument('--max_new_tokens', type=int, default=128)
  p.add_argument('--temperature', type=float, default=0.0, help='0: greedy')
  p.add_argument('--repeats', type=int, default=2, help='timed runs per prompt; the fastest counts')
  args = p.parse_args(argv)
  if args.smoke:
    args.num_prompts, args.prompt_len, args.max_new_tokens, args.repeats = 1, 8, 8, 1
    args.trees = '2,1'
  elif not args.workdir:
    p.error('--workdir is required (the training workdir of the model to decode)')
  return args


def main(argv=None) -> int:
  args = parse(argv)
  # pylint: disable=import-outside-toplevel
  from mtp_jax import checkpoint, train_state
  from mtp_jax.data import tokenizers
  from mtp_jax.decode import Decoder
  from mtp_jax.train import evaluation
  # pylint: enable=import-outside-toplevel

  run = common.start(args, NAME, argv)
  run.note = ('Batch 1. AR, the chain of every drafting depth and each tree alternate per '
              'prompt in one process, so load hits all alike; the fastest of --repeats runs '
              'counts. flops_per_iteration: matmul FLOPs of the weights in one verify step '
              '(attention over the cache left out).')
  if args.smoke:
    import decode_speed  # pylint: disable=import-outside-toplevel
    config, step = decode_speed.smoke_config(), 0
    model = decode_speed.random_model(config, config.model.d_model, config.model.n_layers)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, config.model.vocab_size, (1, args.prompt_len)).tolist()
  else:
    config, step = checkpoint.load_workdir(args.workdir)
    model = train_state.restore_model(config, args.workdir, step)
    tokenizer = tokenizers.get_tokenizer(config.data)
    prompts = evaluation.validation_prompts(config, tokenizer, args.num_prompts, args.prompt_len)
  depth = int(config.model.mtp.depth)
  decs = {'ar': Decoder(model), 'chain': Decoder(model)}
  decs.update({t: Decoder(model, tree=t) for t in args.trees.split()})
  drafts = {'ar': 0}
  kw = dict(eos_id=None, pad_to=(args.prompt_len, args.max_new_tokens),
            temperature=args.temperature)
  t0 = time.perf_counter()
  for name, dec in decs.items():
    dec.compile(dec.program(1, args.prompt_len, args.max_new_tokens, num_drafts=drafts.get(name),
                            temperature=args.temperature))
  compile_s = time.perf_counter() - t0
  best = {n: [np.inf] * len(prompts) for n in decs}
  runs = {}
  for _ in range(args.repeats):
    for i, p in enumerate(prompts):
      for name, dec in decs.items():  # alternate: every variant sees the same load
        r = dec.generate([p], args.max_new_tokens, num_drafts=drafts.get(name), seed=i, **kw)
        best[name][i] = min(best[name][i], r.seconds)
        runs[name, i] = r
  seconds = {n: sum(b) for n, b in best.items()}
  rows = []
  for name in decs:
    rs = [runs[name, i] for i in range(len(prompts))]
    verify = sum(int(r.verify_steps.sum()) for r in rs)
    new = sum(r.new_tokens for r in rs)
    row = {'variant': name, 'new_tokens': new, 'tokens_per_sec': new / seconds[name],
           'speedup_over_ar': seconds['ar'] / seconds[name]}
    if name != 'ar':
      hist = sum(r.accepted.sum(0) for r in rs)
      st = rs[0].stats()
      row |= {
          'identical_to_ar': None if args.temperature else all(
              np.array_equal(a.tokens[0], b.tokens[0])
              for a, b in zip(rs, [runs['ar', i] for i in range(len(prompts))])),
          'tau': sum(int(r.committed.sum()) for r in rs) / verify,
          'acceptance_per_depth': [float(hist[k:].sum() / verify) for k in range(1, len(hist))],
          'verify_rows_per_iteration': st['verify_rows_per_iteration'],
          'flops_per_iteration': st['flops_per_iteration'],
          'ms_per_iteration': 1e3 * seconds[name] / sum(r.steps for r in rs),
          'speedup_over_chain': seconds['chain'] / seconds[name]}
    rows.append(row)
    print(json.dumps(row), file=sys.stderr)
  report = {
      'workdir': os.path.relpath(os.path.abspath(args.workdir), common.REPO) if args.workdir
                 else None, 'step': step,
      'model': {k: config.model[k] for k in ('d_model', 'n_layers', 'n_heads', 'mlp_dim')}
      | {'mtp_depth': depth},
      'prompts': len(prompts), 'prompt_len': args.prompt_len,
      'max_new_tokens': args.max_new_tokens, 'temperature': args.temperature,
      'compile_seconds': compile_s, 'results': rows}
  print(json.dumps(report, indent=1))
  common.write(run, report)
  return 0


if __name__ == '__main__':
  sys.exit(main())
