"""AR vs self-speculative decoding speed, in one run, on held-out standard-library code.

  python benchmarks/decode_speed.py --workdir runs/decode768_soft2 --batch_sizes 1 \
      --temperatures 0,0.7,1 --drafts 1,2,3,5 --num_prompts 8 --prompt_len 64 \
      --max_new_tokens 128 --repeats 2

Restores the latest checkpoint of a trained model (e.g. configs/decode_768.py), takes
prompts from validation-split files (never trained on), and decodes them greedily (or
at each of --temperatures, by sampling) with plain AR and with speculative decoding,
alternating the two per prompt so load from other processes hits both alike. Prints
one JSON object: per batch size, temperature and number of drafts, tokens/s of both,
the speedup, tau, per-depth acceptance, the speedup tau alone would predict, and the
cost of one verify iteration relative to one AR step (speedup = tau / cost ratio, up
to prefill). --cost_probe times random models of other sizes; --smoke decodes with a
tiny random model and random prompts instead of a checkpoint.
"""
import json
import os
import sys
import time

import jax  # noqa: E402
import numpy as np  # noqa: E402

import common  # benchmarks/common.py

NAME = 'decode_speed'


def parse(argv):
  p = common.parser(NAME, __doc__)
  p.add_argument('--workdir', default='', help='training workdir of the model (required)')
  p.add_argument('--num_prompts', type=int, default=8,
                 help='validation prompts (each batch size decodes all of them)')
  p.add_argument('--prompt_len', type=int, default=128, help='prompt tokens')
  p.add_argument('--max_new_tokens', type=int, default=128)
  p.add_argument('--batch_sizes', default='1,8')
  p.add_argument('--drafts', default='',
                 help='numbers of drafts to try (default: the depth; more than the depth: '
                      'the last MTP module recursively)')
  p.add_argument('--draft_thresholds', default='0',
                 help='comma-separated confidence thresholds of the adaptive draft length '
                      '(0: every draft; each > 0 is one more speculative variant)')
  p.add_argument('--repeats', type=int, default=3, help='timed runs per prompt; the fastest counts')
  p.add_argument('--temperatures', default='0',
                 help='comma-separated; 0: greedy (spec output must equal AR), > 0: sampling '
                      '(speculative sampling rule; outputs differ from AR draw by draw)')
  p.add_argument('--weight_dtypes', default='float32',
                 help='comma-separated decode weight dtypes (float32, bfloat16), interleaved; '
                      'each speculative run is compared with AR on the same weights')
  p.add_argument('--cost_probe', default='',
                 help='d_model:n_layers,... random-init models of other sizes: time one AR step '
                      'and one verify iteration (shapes are static, so the cost of an iteration '
                      'does not depend on the weights) and predict the speedup at the measured tau')
  p.add_argument('--probe_drafts', default='3', help='numbers of drafts the cost probe times')
  p.add_argument('--peer_shape', action='store_true',
                 help='also time AR decoding of a random model of the peer-comparison shape '
                      '(4 layers, d 256, V 4096, batch 1, 16 + 128 tokens), greedy and T = 1')
  args = p.parse_args(argv)
  if args.smoke:
    args.num_prompts, args.prompt_len, args.max_new_tokens, args.repeats = 1, 8, 8, 1
    args.batch_sizes, args.drafts = '1', '1'
    args.cost_probe = '32:1'
    args.probe_drafts = '1'
  elif not args.workdir:
    p.error('--workdir is required (the training workdir of the model to decode)')
  return args


def smoke_config():
  """A tiny config of the trained models' kind (M 2 sequential MTP)."""
  import train_throughput  # pylint: disable=import-outside-toplevel
  c = train_throughput.shrink(train_throughput.load_config('stdlib_mtp'))
  c.model.mtp.depth = 2
  return c


def main(argv=None) -> int:
  args = parse(argv)
  from mtp_jax import (
    checkpoint,  # pylint: disable=import-outside-toplevel
    train_state,  # pylint: disable=import-outside-toplevel
  )
  from mtp_jax.data import tokenizers  # pylint: disable=import-outside-toplevel
  from mtp_jax.decode import Decoder  # pylint: disable=import-outside-toplevel
  from mtp_jax.train import evaluation  # pylint: disable=import-outside-toplevel

  run = common.start(args, NAME, argv)
  if args.smoke:
    config, step = smoke_config(), 0
  else:
    config, step = checkpoint.load_workdir(args.workdir)
  depth = int(config.model.mtp.depth)
  wdts = args.weight_dtypes.split(',')
  if args.batch_sizes:  # '': cost probes of random models only, no checkpoint read
    model = (random_model(config, config.model.d_model, config.model.n_layers) if args.smoke
             else train_state.restore_model(config, args.workdir, step))
    decs = {w: Decoder(model, weight_dtype=w) for w in wdts}
  tokenizer = None if args.smoke else tokenizers.get_tokenizer(config.data)
  drafts = [int(d) for d in args.drafts.split(',')] if args.drafts else [depth]
  report = {
      'workdir': os.path.relpath(os.path.abspath(args.workdir), common.REPO) if args.workdir
                 else None, 'step': step,
      'model': {k: config.model[k] for k in ('d_model', 'n_layers', 'n_heads', 'mlp_dim')}
      | {'mtp_depth': depth, 'mtp_kind': config.model.mtp.kind},
      'prompt_len': args.prompt_len, 'max_new_tokens': args.max_new_tokens,
      'temperatures': [float(t) for t in args.temperatures.split(',')], 'results': []}
  for batch, temp in [(int(b), float(t)) for t in args.temperatures.split(',')
                      for b in args.batch_sizes.split(',') if b]:  # '': probes only
    n = -(-args.num_prompts // batch) * batch  # whole batches
    if args.smoke:
      rng = np.random.default_rng(0)
      prompts = rng.integers(1, config.model.vocab_size, (n, args.prompt_len)).tolist()
    else:
      prompts = evaluation.validation_prompts(config, tokenizer, n, args.prompt_len)
    batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    kw = dict(eos_id=None, pad_to=(args.prompt_len, args.max_new_tokens))
    thresholds = [float(t) for t in args.draft_thresholds.split(',')]
    for nd in drafts:
      # variants (drafts, draft_threshold): AR, then speculative at each threshold
      variants = [(0, 0.0)] + [(nd, t) for t in thresholds]
      t0 = time.perf_counter()
      for w in wdts:
        for n, t in variants:
          decs[w].compile(decs[w].program(batch, args.prompt_len, args.max_new_tokens,
                                          num_drafts=n, temperature=temp, draft_threshold=t))
      compile_s = time.perf_counter() - t0
      best = {(w, v): [np.inf] * len(batches) for w in wdts for v in variants}
      runs = {}
      for _ in range(args.repeats):
        for i, b in enumerate(batches):
          for w in wdts:  # alternate: every variant sees the same background load
            for v in variants:
              r = decs[w].generate(b, args.max_new_tokens, num_drafts=v[0], temperature=temp,
                                   seed=i, draft_threshold=v[1], **kw)
              best[w, v][i] = min(best[w, v][i], r.seconds)
              runs[(w, v, i)] = r
      for w in wdts:
        for v in variants[1:]:
          report['results'].append(_row(args, batches, runs, best, w, v, temp, batch,
                                        compile_s) | _vs_f32(best, w, v))
          print(json.dumps(report['results'][-1]), file=sys.stderr)
  if args.cost_probe:
    taus = {r['num_drafts']: r['mean_accepted_length'] for r in report['results']
            if r['batch_size'] == 1 and r['temperature'] == 0 and r['weight_dtype'] == wdts[0]
            and r['draft_threshold'] == 0}
    report['cost_probe'] = cost_probe(config, args, taus, wdts)
  if args.peer_shape:
    report['peer_shape'] = peer_shape(config, args)
  print(json.dumps(report, indent=1))
  common.write(run, report)
  return 0


def _vs_f32(best, w, v) -> dict:
  ar = (0, 0.0)
  if w == 'float32' or ('float32', ar) not in best:
    return {}
  return {'speedup_vs_float32_ar': sum(best['float32', ar]) / sum(best[w, v]),
          'ar_speedup_vs_float32_ar': sum(best['float32', ar]) / sum(best[w, ar])}


def _row(args, batches, runs, best, w, v, temp, batch, compile_s) -> dict:
  nd, threshold = v
  ar = [runs[(w, (0, 0.0), i)] for i in range(len(batches))]
  sp = [runs[(w, v, i)] for i in range(len(batches))]
  identical = None if temp > 0 else all(  # sampling: same distribution, other draws
      np.array_equal(a, s) for x, y in zip(ar, sp) for a, s in zip(x.tokens, y.tokens))
  new = sum(r.new_tokens for r in sp)
  ar_s, sp_s = sum(best[w, (0, 0.0)]), sum(best[w, v])
  ar_steps = sum(r.steps for r in ar)
  sp_steps = sum(r.steps for r in sp)
  verify = sum(int(r.verify_steps.sum()) for r in sp)
  committed = sum(int(r.committed.sum()) for r in sp)
  hist = sum(r.accepted.sum(0) for r in sp)
  tau = committed / verify
  at_least = [float(hist[k:].sum() / verify) for k in range(1, nd + 1)]
  rows = sum(int(r.verify_rows.sum()) for r in sp)
  return {
      'weight_dtype': w, 'batch_size': batch, 'temperature': temp, 'num_drafts': nd,
      'draft_threshold': threshold, 'verify_rows_per_iteration': rows / verify,
      'prompts': sum(len(b) for b in batches), 'identical': identical, 'new_tokens': new,
      'ar_tokens_per_sec': new / ar_s, 'spec_tokens_per_sec': new / sp_s,
      'speedup': ar_s / sp_s,
      'mean_accepted_length': tau,
      'acceptance_per_depth': at_least,
      'conditional_acceptance': [a / b for a, b in zip(at_least, [1.0] + at_least[:-1])],
      # Main-model passes: AR one per token; spec one prefill + one per iteration.
      'speedup_predicted_by_tau': tau,
      'speedup_predicted_by_loop_iterations': ar_steps / sp_steps,
      'ar_ms_per_iteration': 1e3 * ar_s / ar_steps,
      'spec_ms_per_iteration': 1e3 * sp_s / sp_steps,
      'iteration_cost_ratio': (sp_s / sp_steps) / (ar_s / ar_steps),
      'compile_seconds': compile_s,
  }


def random_model(config, d, layers, vocab=None, heads=None):
  """A random-init MTPModel of config's kind: 128-wide heads, MLP 3d, or heads =
  (n_heads, head_dim) and MLP 3d (the peer shape)."""
  import copy

  from flax import nnx

  from mtp_jax.data import tokenizers
  from mtp_jax.model import ModelArgs, MTPModel
  c = copy.deepcopy(config)
  c.model.d_model, c.model.n_layers, c.model.mlp_dim = d, layers, 3 * d
  n, hd = heads or (max(1, d // 128), 128)
  c.model.n_heads = c.model.n_kv_heads = n
  c.model.head_dim = hd
  if vocab:
    c.model.vocab_size = vocab
  return MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(c)), rngs=nnx.Rngs(0))


def _random_decoders(config, d, layers, wdts, vocab=None, heads=None):
  """Decoders (one per weight dtype) of random_model(config, d, layers, vocab, heads)."""
  from mtp_jax.decode import Decoder
  model = random_model(config, d, layers, vocab, heads)
  return {w: Decoder(model, weight_dtype=w) for w in wdts}


def cost_probe(config, args, taus: dict, wdts) -> list:
  """ms per AR step and per speculative iteration for random models of other sizes."""
  out = []
  probe = [int(x) for x in args.probe_drafts.split(',')]
  for item in args.cost_probe.split(','):
    d, layers = (int(x) for x in item.split(':'))
    decs = _random_decoders(config, d, layers, wdts)
    prompt = [[7] * args.prompt_len]
    row = {'d_model': d, 'n_layers': layers, 'mtp_depth': config.model.mtp.depth,
           'params_M': sum(x.size for x in jax.tree.leaves(decs[wdts[0]].params)) / 1e6,
           'load_average_at_start': common.load_average()[0]}
    # Two lengths, one program: the difference is loop iterations only (no prefill).
    # Random weights accept ~no draft, which does not matter: shapes are static.
    t, steps = {}, {}
    for _ in range(max(args.repeats, 3)):
      for w in wdts:
        for n in [0] + probe:
          for m in ((4, 8) if args.smoke else (16, 48)):
            r = decs[w].generate(prompt, m, num_drafts=n, eos_id=None,
                                 pad_to=(args.prompt_len, 8 if args.smoke else 64))
            t[w, n, m] = min(t.get((w, n, m), np.inf), r.seconds)
            steps[w, n, m] = r.steps
    for w in wdts:
      lo, hi = (4, 8) if args.smoke else (16, 48)
      best = {n: (t[w, n, hi] - t[w, n, lo]) / (steps[w, n, hi] - steps[w, n, lo])
              for n in [0] + probe}
      row[w] = {'ar_ms_per_step': 1e3 * best[0]}
      if w != 'float32' and 'float32' in wdts:
        f32 = (t['float32', 0, hi] - t['float32', 0, lo]) / (steps['float32', 0, hi]
                                                             - steps['float32', 0, lo])
        row[w]['ar_step_over_float32_ar_step'] = best[0] / f32
      for n in probe:
        ratio = best[n] / best[0]
        row[w][f'drafts_{n}'] = {
            'spec_ms_per_iteration': 1e3 * best[n], 'iteration_cost_ratio': ratio,
            'speedup_at_measured_tau': taus[n] / ratio if n in taus else None}
    print(json.dumps(row), file=sys.stderr)
    out.append(row)
  return out


def peer_shape(config, args) -> dict:
  """AR tokens/s of the peer comparison's shape: 4 layers, d 256, V 4096, batch 1, 16 + 128."""
  dec = _random_decoders(config, 256, 4, ['float32'], vocab=4096, heads=(4, 64))['float32']
  prompt = [[7] * 16]
  best = {}
  for _ in range(max(args.repeats, 5)):
    for temp in (0.0, 1.0):
      r = dec.generate(prompt, 128, num_drafts=0, temperature=temp, eos_id=None)
      best[temp] = min(best.get(temp, np.inf), r.seconds)
  out = {'greedy_ar_tokens_per_sec': 128 / best[0.0], 't1_ar_tokens_per_sec': 128 / best[1.0],
         't1_over_greedy': best[0.0] / best[1.0],
         'load_average': common.load_average()[0]}
  print(json.dumps(out), file=sys.stderr)
  return out


if __name__ == '__main__':
  sys.exit(main())
