"""The few-row product forms of a decode step, inside a loop XLA cannot trim.

  python benchmarks/few_row_check.py
  python benchmarks/few_row_check.py --out benchmarks/results/few_row_check.json

The rule these check is mtp_jax.model.decode_ops.decode_dot's: a float32 product of 2-64
rows is the tall-skinny `W_t x^T` behind an optimization barrier (`f32 tall*` below).

Each form multiplies M rows by 8 copies of one decode-layout weight [O, I] (cycled, more
than the caches hold) in a fori_loop whose carry depends on the SUM of every product, so
no part of a product is dead code (an earlier throw-away check that kept one output
column let XLA drop half the work of split products and looked 2x faster). Medians of 7
interleaved calls, in units of the float32 1-row GEMV of the same weight.
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import common  # benchmarks/common.py

C = (((1,), (1,)), ((), ()))
F32, BF16 = jnp.float32, jnp.bfloat16


def bar(y):
  return jax.lax.optimization_barrier(y)


def xwt(w, x):  # x W_t^T: the GEMV at 1 row
  return jax.lax.dot_general(x.astype(w.dtype), w, C, preferred_element_type=F32)


def tall(w, x):  # decode_ops.decode_dot's rule: W_t x^T behind a barrier, then the transpose
  return bar(jax.lax.dot_general(w, x.astype(w.dtype), C, preferred_element_type=F32)).T


def tall_xt(w, x):  # the same with x transposed first
  return bar(jax.lax.dot_general(w, bar(x.T), (((1,), (0,)), ((), ())),
                                 preferred_element_type=F32)).T


def tall_ksplit(w, x):  # contraction split in two halves, partial sums added
  h = w.shape[1] // 2
  return (bar(jax.lax.dot_general(w[:, :h], x[:, :h], C, preferred_element_type=F32))
          + bar(jax.lax.dot_general(w[:, h:], x[:, h:], C, preferred_element_type=F32))).T


def tall_2x2(w, x):  # two 2-row tall products
  return jnp.concatenate([tall(w, x[:2]), tall(w, x[2:])], 0)


def xwt_pad2(w, x):  # decode_dot's bf16 1-row form
  return xwt(w, jnp.concatenate([x, jnp.zeros_like(x)], 0))[:1]


FORMS = {'f32 gemv1': (1, F32, xwt), 'f32 tall1': (1, F32, tall), 'f32 tall2': (2, F32, tall),
         'f32 tall4': (4, F32, tall), 'f32 tall4 xT': (4, F32, tall_xt),
         'f32 tall4 K-split': (4, F32, tall_ksplit), 'f32 tall 2x2 rows': (4, F32, tall_2x2),
         'f32 tall8': (8, F32, tall), 'f32 xWt4': (4, F32, xwt),
         'bf16 xWt1 pad2': (1, BF16, xwt_pad2), 'bf16 tall1': (1, BF16, tall),
         'bf16 xWt4': (4, BF16, xwt), 'bf16 tall4': (4, BF16, tall), 'bf16 tall8': (8, BF16, tall)}


NAME = 'few_row_check'


def parse(argv):
  p = common.parser(NAME, __doc__)
  p.add_argument('--shapes', default='4608x768,2304x768,768x2304', help='O x I of each weight')
  p.add_argument('--copies', type=int, default=8, help='weight copies cycled (beyond the caches)')
  p.add_argument('--reps', type=int, default=7)
  a = p.parse_args(argv)
  try:
    a.shapes = [tuple(int(x) for x in s.split('x')) for s in a.shapes.split(',')]
  except ValueError:
    p.error(f'--shapes must be OxI,OxI,..., got {a.shapes!r}')
  if a.smoke:
    a.shapes, a.copies, a.reps = [(64, 32)], 2, 1
  return a


def main(argv=None) -> int:
  a = parse(argv)
  run = common.start(a, NAME, argv)
  out = {'shapes': {}}
  for o, i in a.shapes:
    shape = f'{o}x{i}'
    ws = {dt: [jnp.asarray(np.random.randn(o, i).astype(np.float32)).astype(dt)
               for _ in range(a.copies)] for dt in (F32, BF16)}
    fns = {}
    for name, (m, dt, f) in FORMS.items():
      def loop(ws, x, f=f):
        def body(_, acc):
          for w in ws:
            acc = acc + jnp.sum(f(w, x + acc)) * 1e-12  # every output element is used
          return acc
        return jax.lax.fori_loop(0, 4, body, x)
      fn = jax.jit(loop)
      x = jnp.ones((m, i))
      jax.block_until_ready(fn(ws[dt], x))
      fns[name] = (fn, x, dt)
    t = {k: [] for k in fns}
    for _ in range(a.reps):
      for k, (fn, x, dt) in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(ws[dt], x))
        t[k].append((time.perf_counter() - t0) / (4 * a.copies) * 1e6)
    base = float(np.median(t['f32 gemv1']))
    out['shapes'][shape] = {'gemv1_us': base,
                            'over_gemv1': {k: float(np.median(v)) / base for k, v in t.items()}}
    print(shape, f'gemv1 {base:.0f} us', ' '.join(
        f'{k}={v:.2f}' for k, v in out['shapes'][shape]['over_gemv1'].items()),
          file=sys.stderr, flush=True)
  common.write(run, out)
  return 0


if __name__ == '__main__':
  sys.exit(main())
