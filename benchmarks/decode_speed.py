"""AR vs self-speculative decoding speed, in one run, on held-out standard-library code.

  python benchmarks/decode_speed.py --workdir /work/runs/stdlib_mtp_decode

Restores the latest checkpoint of a model trained with configs/stdlib_mtp.py, takes
prompts from validation-split files (never trained on), and decodes them greedily
with plain AR and with speculative decoding, alternating the two per prompt so load
from other processes hits both alike. Prints one JSON object: per batch size and
number of drafts, tokens/s of both, the speedup, tau, per-depth acceptance, the
speedup tau alone would predict, and the cost of one verify iteration relative to
one AR step (speedup = tau / cost ratio, up to prefill).
"""
import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--workdir', required=True, help='training workdir of configs/stdlib_mtp.py')
  p.add_argument('--num_prompts', type=int, default=8, help='validation prompts per batch size')
  p.add_argument('--prompt_len', type=int, default=128, help='prompt tokens')
  p.add_argument('--max_new_tokens', type=int, default=128)
  p.add_argument('--batch_sizes', default='1,8')
  p.add_argument('--drafts', default='', help='numbers of drafts to try (default: the depth)')
  p.add_argument('--repeats', type=int, default=3, help='timed runs per prompt; the fastest counts')
  return p.parse_args(argv)


def validation_prompts(config, tokenizer, n: int, length: int) -> list[list[int]]:
  """n prompts of `length` tokens from different validation files, starting at a line."""
  from mtp_jax.data import corpus
  docs = [text for _, text in corpus.split_documents(
      'validation', corpus_dir=config.data.corpus_dir,
      validation_percent=config.data.validation_percent)]
  docs = [d for d in docs if len(tokenizer.encode(d)) >= 4 * length]
  step = max(1, len(docs) // n)
  prompts = []
  for doc in docs[::step][:n]:
    lines = doc.splitlines(keepends=True)
    start = sum(len(line) for line in lines[:len(lines) // 3])  # a third in: past the header
    ids = tokenizer.encode(doc[start:])
    prompts.append(ids[:length])
  if len(prompts) < n:
    raise SystemExit(f'only {len(prompts)} validation files are long enough')
  return prompts


def main(argv=None):
  args = parse(argv)
  import jax
  import numpy as np
  from mtp_jax import decode
  from mtp_jax.data import tokenizers

  config, step = decode.load_workdir(args.workdir)
  depth = int(config.model.mtp.depth)
  model = decode.restore_model(config, args.workdir, step)
  dec = decode.Decoder(model)
  tokenizer = tokenizers.get_tokenizer(config.data)
  drafts = [int(d) for d in args.drafts.split(',')] if args.drafts else [depth]
  report = {
      'workdir': os.path.abspath(args.workdir), 'step': step,
      'model': {k: config.model[k] for k in ('d_model', 'n_layers', 'n_heads', 'mlp_dim')}
      | {'mtp_depth': depth, 'mtp_kind': config.model.mtp.kind},
      'machine': f'{platform.machine()} {os.cpu_count()} CPUs, jax {jax.__version__} '
                 f'({jax.devices()[0].platform})',
      'prompt_len': args.prompt_len, 'max_new_tokens': args.max_new_tokens, 'greedy': True,
      'results': []}
  for batch in [int(b) for b in args.batch_sizes.split(',')]:
    prompts = validation_prompts(config, tokenizer, args.num_prompts * batch, args.prompt_len)
    batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    kw = dict(eos_id=None, pad_to=(args.prompt_len, args.max_new_tokens))
    for nd in drafts:
      t0 = time.perf_counter()
      for n in (0, nd):
        dec.compile(dec.program(batch, args.prompt_len, args.max_new_tokens, num_drafts=n))
      compile_s = time.perf_counter() - t0
      best = {0: [np.inf] * len(batches), nd: [np.inf] * len(batches)}
      runs = {}
      for _ in range(args.repeats):
        for i, b in enumerate(batches):
          for n in (0, nd):  # alternate: both see the same background load
            r = dec.generate(b, args.max_new_tokens, num_drafts=n, **kw)
            best[n][i] = min(best[n][i], r.seconds)
            runs[(n, i)] = r
      ar = [runs[(0, i)] for i in range(len(batches))]
      sp = [runs[(nd, i)] for i in range(len(batches))]
      identical = all(np.array_equal(a, s) for x, y in zip(ar, sp)
                      for a, s in zip(x.tokens, y.tokens))
      new = sum(r.new_tokens for r in sp)
      ar_s, sp_s = sum(best[0]), sum(best[nd])
      ar_steps = sum(r.steps for r in ar)
      sp_steps = sum(r.steps for r in sp)
      verify = sum(int(r.verify_steps.sum()) for r in sp)
      committed = sum(int(r.committed.sum()) for r in sp)
      hist = sum(r.accepted.sum(0) for r in sp)
      tau = committed / verify
      at_least = [float(hist[k:].sum() / verify) for k in range(1, nd + 1)]
      report['results'].append({
          'batch_size': batch, 'num_drafts': nd, 'prompts': len(prompts),
          'identical': identical, 'new_tokens': new,
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
      })
      print(json.dumps(report['results'][-1]), file=sys.stderr)
  print(json.dumps(report, indent=1))


if __name__ == '__main__':
  main()
