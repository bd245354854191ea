"""What one T > 0 sampling step costs apart from the model, and cheaper equivalent forms.

  python benchmarks/sampling_cost.py
  python benchmarks/sampling_cost.py --out benchmarks/results/sampling_cost.json

Each form below is one sampling step `(logits [B, V], keys [B], step) -> tokens [B]`, run
`--steps` times in a `lax.fori_loop` (a different logits row per step) and timed
interleaved with the others in one process; `argmax` is the loop + greedy floor.

  current      sampling.accept(num_drafts=0) with both top-k / top-p switches compiled in
               (Sampling's defaults: use_top_k / use_top_p on, the values off); its bonus
               draw is inverse-CDF, so `static` (Gumbel) draws other tokens than `current`
  static       top-k / top-p left out at trace time (static flags), categorical on x / T
  one_fold     static, with one fold_in per row per step instead of three
  inv_cdf      one uniform per row (instead of V Gumbels), cumsum of softmax(x / T), count
  shared_key   gumbel-max with one key per step for the whole [B, V] block: cheapest RNG,
               but a row's draws then depend on the batch it is in (not batch-independent)
  rbg_*        one_fold / inv_cdf with jax.random's 'rbg' key implementation
and, with top-k = 40 and top-p = 0.9 switched on, `current_topk_topp` (the same code) vs
`static_topk_topp` (lax.top_k for the k-th value, one sort for top-p, only when on).

Checks (printed, in the JSON): `static` draws equal `current`'s; every form's draws fit
the exact distribution (chi-square over --check_draws draws of a fixed row);
`static_topk_topp`'s log-probabilities equal `adjusted_logprobs`'.
"""
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

import common  # benchmarks/common.py

NAME = 'sampling_cost'


from mtp_jax.decode import decoder as DECODE  # noqa: E402
from mtp_jax.decode import sampling as SAMPLING  # noqa: E402

row_keys = SAMPLING.row_keys


# -- the forms ------------------------------------------------------------------------------
def current(prog, logits_BxV, keys_B, step, sampling):
  keys = row_keys(keys_B, step + 1)  # _iteration
  b = logits_BxV.shape[0]
  _, cand = SAMPLING.accept(False, logits_BxV[:, None], jnp.zeros((b, 0), jnp.int32),
                            jnp.zeros((b, 0, logits_BxV.shape[-1])), sampling,
                            row_keys(keys, 0))
  return cand[:, 0]


def static(prog, logits_BxV, keys_B, step, sampling):
  keys = row_keys(row_keys(row_keys(keys_B, step + 1), 0), 3)  # the same keys as current
  x = logits_BxV.astype(jnp.float32) / sampling.temperature
  return jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)


def one_fold(prog, logits_BxV, keys_B, step, sampling):
  x = logits_BxV.astype(jnp.float32) / sampling.temperature
  return jax.vmap(jax.random.categorical)(row_keys(keys_B, step), x).astype(jnp.int32)


def inv_cdf(prog, logits_BxV, keys_B, step, sampling):
  x = logits_BxV.astype(jnp.float32) / sampling.temperature
  cdf = jnp.cumsum(jax.nn.softmax(x, -1), -1)
  u = jax.vmap(jax.random.uniform)(row_keys(keys_B, step)) * cdf[:, -1]
  return jnp.minimum(jnp.sum(cdf <= u[:, None], -1), x.shape[-1] - 1).astype(jnp.int32)


def shared_key(prog, logits_BxV, keys_B, step, sampling):
  x = logits_BxV.astype(jnp.float32) / sampling.temperature
  return jax.random.categorical(jax.random.fold_in(keys_B[0], step), x).astype(jnp.int32)


def argmax(prog, logits_BxV, keys_B, step, sampling):
  return jnp.argmax(logits_BxV, -1).astype(jnp.int32)


def static_topk_topp_logprobs(x_BxV, temperature, top_k: int, top_p: float):
  """adjusted_logprobs with top_k / top_p as static Python values: only what is on runs."""
  x = x_BxV.astype(jnp.float32) / temperature
  neg = jnp.array(-jnp.inf, x.dtype)
  if top_k > 0:
    kth = jax.lax.top_k(x, top_k)[0][..., -1:]  # no full sort
    x = jnp.where(x < kth, neg, x)
  if top_p < 1.0:
    probs = jax.nn.softmax(x, -1)
    desc = -jnp.sort(-probs, -1)  # one sort (the current code sorts twice)
    before = jnp.cumsum(desc, -1) - desc
    kept = jnp.sum(before < top_p, -1, keepdims=True)
    x = jnp.where(probs < jnp.take_along_axis(desc, kept - 1, -1), neg, x)
  return jax.nn.log_softmax(x, -1)


def static_topk_topp(prog, logits_BxV, keys_B, step, sampling, top_k=40, top_p=0.9):
  logp = static_topk_topp_logprobs(logits_BxV, sampling.temperature, top_k, top_p)
  return jax.vmap(jax.random.categorical)(row_keys(keys_B, step), logp).astype(jnp.int32)


FORMS = {'argmax': argmax, 'current': current, 'static': static, 'one_fold': one_fold,
         'inv_cdf': inv_cdf, 'shared_key': shared_key,
         'rbg_one_fold': one_fold, 'rbg_inv_cdf': inv_cdf,
         'current_topk_topp': current, 'static_topk_topp': static_topk_topp}


def sampling_for(form, temperature=1.0):
  on = form.endswith('topk_topp')
  return SAMPLING.Sampling(temperature=jnp.float32(temperature),
                         top_k=jnp.int32(40 if on else 0), top_p=jnp.float32(0.9 if on else 1.0),
                         draft_argmax=False)


def keys_for(form, batch, seed=0):
  impl = 'rbg' if form.startswith('rbg_') else None
  base = jax.random.key(seed, impl=impl)
  return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(batch))  # as decode_program


def loop_fn(prog, form, steps):
  fn = FORMS[form]

  @jax.jit
  def run(logit_sets, keys_B, sampling):  # logit_sets [n, B, V]: step i reads set i mod n
    def body(i, acc_B):
      logits = logit_sets[i % logit_sets.shape[0]] + 1e-9 * acc_B[:, None]  # a carry dep
      return acc_B + fn(prog, logits, keys_B, i, sampling)
    return jax.lax.fori_loop(0, steps, body, jnp.zeros(keys_B.shape, jnp.int32))
  return run


# -- checks ---------------------------------------------------------------------------------
def draws(prog, form, logits_1xV, n, sampling):
  """n draws of row 0 (steps 0..n-1), vectorised over the step."""
  fn = FORMS[form]
  keys = keys_for(form, logits_1xV.shape[0])
  return np.asarray(jax.jit(jax.vmap(lambda i: fn(prog, logits_1xV, keys, i, sampling)[0]))(
      jnp.arange(n)))


def chi_square_p(tokens, probs):
  probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
  expected = probs * len(tokens)
  counts = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
  big = expected >= 5  # pool the rare bins into one (added to the last big bin if still rare)
  obs, exp = counts[big], expected[big]
  rest_obs, rest_exp = counts[~big].sum(), expected[~big].sum()
  if rest_exp >= 5:
    obs, exp = np.append(obs, rest_obs), np.append(exp, rest_exp)
  else:
    obs[-1] += rest_obs
    exp[-1] += rest_exp
  exp = exp / exp.sum() * obs.sum()
  return float(stats.chisquare(obs, exp).pvalue)


def checks(v, n, temperature=1.0, forms=tuple(FORMS)):
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(1, v)) * 2.0, jnp.float32)
  prog = DECODE.Program(batch=1, prompt_len=16, max_new=16, num_drafts=0, greedy=False)
  out = {'V': v, 'draws': n}
  exact = np.asarray(jax.nn.softmax(logits[0] / temperature))
  tok = {f: draws(prog, f, logits, n, sampling_for(f, temperature)) for f in
         ('current', 'static', 'one_fold', 'inv_cdf', 'shared_key', 'rbg_one_fold', 'rbg_inv_cdf')
         if f in forms}
  if 'static' in tok and 'current' in tok:
    out['static_equals_current'] = float(np.mean(tok['static'] == tok['current']))
  out['chi_square_p'] = {f: round(chi_square_p(t, exact), 4) for f, t in tok.items()}
  s = sampling_for('current_topk_topp', temperature)
  want = np.asarray(SAMPLING.adjusted_logprobs(logits, s))
  got = np.asarray(static_topk_topp_logprobs(logits, temperature, 40, 0.9))
  same_support = bool(np.array_equal(np.isfinite(want), np.isfinite(got)))
  fin = np.isfinite(want)
  out['topk_topp_same_support'] = same_support
  out['topk_topp_max_abs_logp_diff'] = float(np.max(np.abs(want[fin] - got[fin])))
  out['topk_topp_kept'] = int(fin.sum())
  if 'current_topk_topp' not in forms:
    return out
  t_cur = draws(prog, 'current_topk_topp', logits, n, s)
  t_new = draws(prog, 'static_topk_topp', logits, n, s)
  p = np.exp(np.where(fin, want, -np.inf))[0]
  out['chi_square_p']['current_topk_topp'] = round(chi_square_p(t_cur, p), 4)
  out['chi_square_p']['static_topk_topp'] = round(chi_square_p(t_new, p), 4)
  return out


def parse(argv):
  p = common.parser(NAME, __doc__)
  p.add_argument('--batches', default='1,8')
  p.add_argument('--vocabs', default='256,4096')
  p.add_argument('--forms', default=','.join(FORMS), help='comma-separated, of FORMS')
  p.add_argument('--steps', type=int, default=256, help='sampling steps per timed call')
  p.add_argument('--reps', type=int, default=9)
  p.add_argument('--check_draws', type=int, default=20000)
  args = p.parse_args(argv)
  args.forms = [f for f in args.forms.split(',') if f]
  if not args.forms or any(f not in FORMS for f in args.forms):
    p.error(f'--forms must name some of {", ".join(FORMS)}, got {args.forms}')
  if args.smoke:
    args.batches, args.vocabs, args.steps, args.reps, args.check_draws = '1', '64', 4, 1, 200
    args.forms = ['argmax', 'current', 'inv_cdf']
  return args


def main(argv=None) -> int:
  args = parse(argv)
  run = common.start(args, NAME, argv)
  report = {'steps_per_call': args.steps, 'forms': args.forms, 'timing': [], 'checks': []}
  for v in [int(x) for x in args.vocabs.split(',')]:
    c = checks(v, args.check_draws, forms=args.forms)
    report['checks'].append(c)
    print(json.dumps(c), file=sys.stderr, flush=True)
  rng = np.random.default_rng(1)
  for b in [int(x) for x in args.batches.split(',')]:
    prog = DECODE.Program(batch=b, prompt_len=16, max_new=16, num_drafts=0, greedy=False)
    for v in [int(x) for x in args.vocabs.split(',')]:
      logits = jnp.asarray(rng.normal(size=(16, b, v)) * 2.0, jnp.float32)
      fns = {}
      for f in args.forms:
        fn, keys, s = loop_fn(prog, f, args.steps), keys_for(f, b), sampling_for(f)
        jax.block_until_ready(fn(logits, keys, s))  # compile
        fns[f] = (fn, keys, s)
      times = {f: [] for f in fns}
      for _ in range(args.reps):
        for f, (fn, keys, s) in fns.items():
          t0 = time.perf_counter()
          jax.block_until_ready(fn(logits, keys, s))
          times[f].append(time.perf_counter() - t0)
      us = {f: float(np.median(t)) / args.steps * 1e6 for f, t in times.items()}
      base = us.get('argmax', 0.0)
      row = {'B': b, 'V': v, 'us_per_step': {f: round(u, 2) for f, u in us.items()},
             'over_argmax_us': {f: round(u - base, 2) for f, u in us.items()}}
      if 'current' in us:
        row['over_current'] = {f: round(u / us['current'], 3) for f, u in us.items()}
      report['timing'].append(row)
      print(json.dumps(row), file=sys.stderr, flush=True)
  common.write(run, report)
  return 0


if __name__ == '__main__':
  sys.exit(main())
