"""Where the end-to-end time of speculative decoding goes: AR step, probe, real loop, parts.

  python benchmarks/decode_split.py --workdir runs/decode768_mtp --prompt_len 128 \
      --max_new_tokens 128 --out benchmarks/decode_split.json

For one model (a trained workdir, or with --random its config's shape with random weights),
batch 1, greedy, one weight dtype, one compiled shape (prompt bucket, max_new bucket: every
program below has the same cache length as the end-to-end run), interleaved per repeat:

  ar        the AR program: prefill alone (max_new_tokens 1: the loop never runs), the
            whole decode of --max_new_tokens, and ms per loop step (whole minus prefill,
            over its steps);
  spec      the same for the D-draft program on the same prompts: the real loop's ms per
            iteration, its prefill, tau;
  probe     the cost probe's measure on random weights (they accept ~no draft: one
            token a step): ms per iteration as the difference of a --probe_new-token run
            and a prefill-only run of one program over their step difference, the
            median over rounds (each round runs every program once, so load hits all
            alike), for AR and for D drafts;
  parts     the same difference for variants of the D-draft iteration with one part
            replaced by a stub of the same shapes: `no_mtp` (the MTP chain returns the
            candidates as drafts, caches untouched), `no_verify` (the verify pass returns
            embeddings as h^0 and zero logits, main caches untouched), `neither`
            (acceptance, token writes, loop carry only). verify = full - no_verify,
            MTP chain = full - no_mtp, bookkeeping = neither.

Every figure is also given in AR steps (ms over the AR program's ms per step). --ab
MODULE.ATTR=VALUE compiles the AR and D-draft programs once more with an mtp_jax setting
changed while tracing (e.g. decode_ops.ATTN_TALL=False, the attention core before the
few-query rule) and times them in the same rounds: an A/B inside one process. Prints one
JSON object (and writes it to --out).
"""
import argparse
import contextlib
import functools
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import decode_speed  # noqa: E402  (this directory: its random cost-probe models)


def parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--workdir', required=True, help='training workdir (config and checkpoint)')
  p.add_argument('--random', action='store_true',
                 help='end to end on random weights of the workdir config\'s shape too '
                      '(no checkpoint read)')
  p.add_argument('--shape', default='',
                 help='d_model:n_layers: random weights of that size instead (128-wide heads, '
                      'MLP 3d, as decode_speed.py --cost_probe); implies --random')
  p.add_argument('--num_prompts', type=int, default=2)
  p.add_argument('--prompt_len', type=int, default=128)
  p.add_argument('--max_new_tokens', type=int, default=128)
  p.add_argument('--drafts', type=int, default=3)
  p.add_argument('--weight_dtype', default='float32')
  p.add_argument('--repeats', type=int, default=3, help='rounds')
  p.add_argument('--probe_new', type=int, default=64, help='tokens of a probe run')
  p.add_argument('--parts', default='full,no_mtp,no_verify,neither')
  p.add_argument('--ab', default='',
                 help='MODULE.ATTR=VALUE[;...] of mtp_jax (e.g. decode_ops.ROW_MULTIPLE=1): also '
                      'compile the AR and D-draft programs with these set while tracing and '
                      'time their probe iteration interleaved with the rest (an A/B in one process)')
  p.add_argument('--compile_only', action='store_true',
                 help='compile and exit (fills a persistent cache, JAX_COMPILATION_CACHE_DIR, '
                      'so a timed run right after spends its time timing)')
  p.add_argument('--out', default='')
  return p.parse_args(argv)


@contextlib.contextmanager
def _patched(spec):
  """mtp_jax module attributes set to other values while tracing (--ab)."""
  import importlib
  saved = []
  for item in filter(None, spec.split(';')):
    name, value = item.split('=')
    mod, attr = name.rsplit('.', 1)
    module = importlib.import_module(f'mtp_jax.{mod}')
    saved.append((module, attr, getattr(module, attr)))
    setattr(module, attr, type(saved[-1][2])(eval(value)))
  try:
    yield
  finally:
    for module, attr, old in saved:
      setattr(module, attr, old)


@contextlib.contextmanager
def _stubbed(part):
  """decode's verify pass and / or MTP chain replaced by same-shape stubs while tracing."""
  from mtp_jax.decode import decoder as decode
  saved = decode._verify, decode._mtp_pass

  def fake_verify(prog, model, st, start_B):
    x = decode.take_rows(st.tokens, start_B)
    tokens = jnp.concatenate([x[:, None], st.drafts], 1)
    h0 = model.decode_embed(tokens)  # varies per iteration, costs a gather
    b, w, _ = h0.shape
    logits = jnp.zeros((b, w, model.args.vocab_size), jnp.float32) + h0[..., :1]
    return (h0, logits, st.main_cache), w

  def fake_mtp(prog, model, h0, start, u, a, hidden, caches, sampling, keys):
    b, dn = u.shape[0], prog.num_drafts
    return (u[:, :dn].astype(jnp.int32), jnp.zeros((b, dn, 0)), jnp.ones((b, dn)), hidden,
            caches)

  if part in ('no_verify', 'neither'):
    decode._verify = fake_verify
  if part in ('no_mtp', 'neither'):
    decode._mtp_pass = fake_mtp
  try:
    yield
  finally:
    decode._verify, decode._mtp_pass = saved


def _compile(dec, prog, part='full', ab=''):
  from mtp_jax.decode import decoder as decode
  example = dec._inputs(prog, [[0]] * prog.batch, 1, 1, 0.0, 0, 1.0, 0)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)),
                          example)
  with _stubbed(part), _patched(ab):
    fn = jax.jit(functools.partial(decode._decode, prog, dec.graphdef, dec._treedef))
    return fn.lower(*abstract).compile()


def _run(dec, fn, prog, prompts, max_new):
  inputs = dec._inputs(prog, prompts, max_new, None, 0.0, 0, 1.0, 0)
  t0 = time.perf_counter()
  st = jax.block_until_ready(fn(*inputs))
  sec = time.perf_counter() - t0
  tokens = [np.asarray(st.tokens)[i, p:n] for i, (p, n) in
            enumerate(zip(np.asarray(st.prompt_len), np.asarray(st.length)))]
  return sec, int(st.step), int(np.asarray(st.committed).sum()), tokens


def main(argv=None):
  args = parse(argv)
  from flax import nnx
  from mtp_jax import checkpoint
  from mtp_jax.decode import decoder as decode
  from mtp_jax.train import evaluation
  from mtp_jax.model import state
  from mtp_jax.data import tokenizers
  from mtp_jax.model.mtp import MTPModel, ModelArgs

  config, step = checkpoint.load_workdir(args.workdir)
  # The probe and the parts run on random weights (they accept ~no draft, so every
  # iteration commits one token and the step counts are fixed); the same compiled
  # programs take either model's parameters.
  if args.shape:  # the cost probe's random model of that size
    d, n_layers = (int(x) for x in args.shape.split(':'))
    rand = decode_speed._random_decoders(config, d, n_layers, [args.weight_dtype])[
        args.weight_dtype]
    args.random = True
  else:
    rand_model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(config)), rngs=nnx.Rngs(0))
    rand = decode.Decoder(rand_model, weight_dtype=args.weight_dtype)
  dec = rand if args.random else decode.Decoder(state.restore_model(config, args.workdir, step),
                                                weight_dtype=args.weight_dtype)
  # The A/B's programs run on a Decoder built with the setting too, so settings read when
  # the decode layout is prepared (MTPModel.for_decoding) apply as well.
  rand_ab = rand
  if args.ab:
    with _patched(args.ab):
      if args.shape:
        rand_ab = decode_speed._random_decoders(config, d, n_layers, [args.weight_dtype])[
            args.weight_dtype]
      else:
        rand_ab = decode.Decoder(rand_model, weight_dtype=args.weight_dtype)
  tokenizer = tokenizers.get_tokenizer(config.data)
  prompts = evaluation.validation_prompts(config, tokenizer, args.num_prompts, args.prompt_len)
  nd, n_new = args.drafts, args.max_new_tokens
  progs = {n: dec.program(1, args.prompt_len, n_new, num_drafts=n) for n in (0, nd)}
  t0 = time.perf_counter()
  fns = {('ar', 'full'): _compile(dec, progs[0])}
  parts = args.parts.split(',')
  for part in parts:
    fns[('spec', part)] = _compile(dec, progs[nd], part)
  if args.ab:
    fns[('ar', 'ab')] = _compile(rand_ab, progs[0], ab=args.ab)
    fns[('spec', 'ab')] = _compile(rand_ab, progs[nd], ab=args.ab)
  compile_s = time.perf_counter() - t0
  if args.compile_only:
    print(json.dumps({'compile_seconds': compile_s}))
    return
  best, info = {}, {}
  per_iter = {}  # (kind, part) -> [ms per iteration of each round]

  def timed(key, kind, part, prompt, m):
    prog = progs[0 if kind == 'ar' else nd]
    d = rand_ab if part == 'ab' else rand if key[0] == 'probe' else dec
    sec, steps, committed, tokens = _run(d, fns[(kind, part)], prog, [prompt], m)
    k = key + (kind, part, m)
    if sec < best.get(k, (np.inf,))[0]:
      best[k] = (sec, steps, committed)
    info[k] = tokens
    return sec, steps

  for (kind, part), fn in fns.items():  # a program's first runs are slower
    for d in ((rand_ab,) if part == 'ab' else (dec, rand)):
      _run(d, fn, progs[0 if kind == 'ar' else nd], prompts[:1], 2)
  ab = ['ab'] if args.ab else []
  probe_keys = [('ar', p) for p in ['full'] + ab] + [('spec', p) for p in parts + ab]
  for _ in range(args.repeats):
    for i, prompt in enumerate(prompts):
      for kind in ('ar', 'spec'):
        for m in (1, n_new):
          timed((i,), kind, 'full', prompt, m)
    # The probe: a prefill-only run and a probe_new-token run of the same program, on
    # random weights (one token a step); a round's ms per iteration is their difference
    # over the steps. Rounds alternate every program, so load hits all alike.
    for kind, part in probe_keys:
      s1, n1 = timed(('probe',), kind, part, prompts[0], 1)
      s2, n2 = timed(('probe',), kind, part, prompts[0], args.probe_new)
      per_iter.setdefault((kind, part), []).append(1e3 * (s2 - s1) / (n2 - n1))

  def diff(kind, part):  # median over rounds
    return float(np.median(per_iter[kind, part]))

  def ratio(kind, part, ref=('ar', 'full')):  # median over rounds of the in-round ratio
    return float(np.median(np.array(per_iter[kind, part]) / np.array(per_iter[ref])))

  ar_step = diff('ar', 'full')  # the unit
  e2e = {}
  for kind in ('ar', 'spec'):
    pre = sum(best[i, kind, 'full', 1][0] for i in range(len(prompts)))
    tot = sum(best[i, kind, 'full', n_new][0] for i in range(len(prompts)))
    steps = sum(best[i, kind, 'full', n_new][1] for i in range(len(prompts)))
    committed = sum(best[i, kind, 'full', n_new][2] for i in range(len(prompts)))
    e2e[kind] = {'prefill_ms': 1e3 * pre / len(prompts), 'total_ms': 1e3 * tot / len(prompts),
                 'loop_iterations': steps / len(prompts),
                 'ms_per_iteration_incl_prefill': 1e3 * tot / steps,
                 'ms_per_iteration_loop_only': 1e3 * (tot - pre) / steps,
                 'tau': (committed / steps) if kind == 'spec' else 1.0}
  identical = all(np.array_equal(info[i, 'ar', 'full', n_new][0],
                                 info[i, 'spec', 'full', n_new][0]) for i in range(len(prompts)))
  probe = {part: diff('spec', part) for part in parts}
  probe_ratio = {part: ratio('spec', part) for part in parts}
  ab = {}
  if args.ab:
    ab = {'ab': args.ab, 'ar_ms': diff('ar', 'ab'), 'spec_ms': diff('spec', 'ab'),
          'ab_ar_over_base_ar': ratio('ar', 'ab'),
          'ab_spec_over_base_spec': ratio('spec', 'ab', ('spec', 'full')),
          'ab_spec_ar_steps (base AR)': ratio('spec', 'ab'),
          'base_spec_ar_steps': probe_ratio.get('full'),
          'rounds_ab_spec_over_base_spec': list(np.array(per_iter['spec', 'ab'])
                                                / np.array(per_iter['spec', 'full']))}
  real_unit = e2e['ar']['ms_per_iteration_loop_only']
  split = {
      'ar_step (probe)': 1.0,
      'ar_step (real loop)': real_unit / ar_step,
      'spec_iteration (probe)': probe_ratio.get('full'),
      'spec_iteration (real loop)': e2e['spec']['ms_per_iteration_loop_only'] / real_unit,
      'prefill ar': e2e['ar']['prefill_ms'] / real_unit,
      'prefill spec': e2e['spec']['prefill_ms'] / real_unit,
  }
  if {'full', 'no_mtp', 'no_verify', 'neither'} <= set(parts):
    r = probe_ratio
    split |= {'verify (full - no_verify)': r['full'] - r['no_verify'],
              'mtp_chain (full - no_mtp)': r['full'] - r['no_mtp'],
              'bookkeeping (neither)': r['neither'],
              'verify alone (no_mtp - neither)': r['no_mtp'] - r['neither'],
              'mtp_chain alone (no_verify - neither)': r['no_verify'] - r['neither']}
  report = {
      'workdir': os.path.abspath(args.workdir), 'step': step, 'random_weights': args.random,
      'weight_dtype': args.weight_dtype, 'drafts': nd,
      'model': {k: getattr(dec.args, k) for k in ('d_model', 'n_layers', 'n_heads', 'mlp_dim')},
      'machine': f'{platform.machine()} {os.cpu_count()} CPUs, jax {jax.__version__}, '
                 f'load average at start {"/".join(f"{x:.1f}" for x in os.getloadavg())}',
      'prompt_len': args.prompt_len, 'max_new_tokens': n_new, 'prompts': len(prompts),
      'cache_len': {'ar': progs[0].cache_len, 'spec': progs[nd].cache_len},
      'compile_seconds': compile_s, 'identical': identical, 'end_to_end': e2e,
      'speedup': e2e['ar']['total_ms'] / e2e['spec']['total_ms'],
      'probe_ms_median': {'ar': ar_step} | probe,
      'probe_rounds_ms': {f'{k}/{p}': v for (k, p), v in per_iter.items()},
      'split_ar_steps': split,
      'ab': ab,
      'load_average_at_end': '/'.join(f'{x:.1f}' for x in os.getloadavg())}
  text = json.dumps(report, indent=1)
  print(text)
  if args.out:
    with open(args.out, 'w') as f:
      f.write(text + '\n')


if __name__ == '__main__':
  main()
