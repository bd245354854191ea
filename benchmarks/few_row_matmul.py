"""Few-row matmul formulations on XLA:CPU: which to use per (rows, weight shape, backend flag).

  flock /tmp/mtp_bench.lock python benchmarks/few_row_matmul.py --out benchmarks/few_row_matmul.json

A decode step multiplies M = batch x window rows (1 for an AR step at batch 1, D + 1 = 4
for a D = 3 verify, 16 for batch 8 x 2) by every weight of the model, so it is bound by
reading the weights, and the formulation XLA:CPU lowers the product to decides how close
it gets to that bound. For the decoder's weight shapes at d 256 / 512 / 768 / 1024 this
times, interleaved per (shape, M) in one process:

  xW       jnp.dot(x, W), W stored I x O (the layout of the model's kernels)
  xWt      lax.dot_general contracting the last dims of x and W_t, W_t stored O x I
  Wt_x     lax.dot_general contracting W_t's axis 1 with x's axis 1: the tall-skinny
           [O, M] product W_t x^T (a GEMV at M = 1), then transposed to [M, O]
  Wt_x_bar Wt_x with the [O, M] product behind lax.optimization_barrier before the
           transpose (else XLA:CPU may lay the dot's output out as [M, O]: a GEMM again)
  Wt_x_bar_pad8  M > 4 and not a multiple of 8, float32: Wt_x_bar over x padded with zero
           rows to the next multiple of 8, the padding's columns dropped (decode_ops.decode_dot)
  Wx       M = 1 only: jnp.dot(W_t, x[0]), the matrix-vector form of the tied head
  rows_xW  M in {2, 4}, float32: one 1-row jnp.dot(x[i:i+1], W) per row, concatenated
           (the decoder's per-row split before the transposed layout)
  pad2_xWt, pad2_Wt_x   M = 1, bfloat16 only: the row padded to 2 rows, row 0 kept

each with float32 weights and with bfloat16 weights (x cast to bf16, f32 accumulation via
preferred_element_type). Every product reads one of `copies` distinct weight copies in
turn (at most --max_copies = 8, enough for --cycle_mb where a weight allows), so the
weights come from beyond the L2 (1 MiB per core) and, where 8 copies exceed the 32 MiB L3
(each JSON row has cycled_MB: the d 768 MLP weights, d 1024 qkv / MLP), from memory, as in
a decode step of a model larger than the L3. Smaller shapes are read from the L3, as
in a model that fits there (d 256 / L 4: 13 MB); their ratios need not carry over to
memory-bound sizes. (More copies are unrolled dots, slow to compile; a lax.scan over
stacked copies measured 2x slower, as it copies each slice first.) With --flags both
each XLA flag setting runs in its own subprocess (XLA_FLAGS is read once
per process; the no_ynn_dot run covers --flag_dims only): `default` and `no_ynn_dot`, which keeps XLA:CPU's YNNPACK fusion to elementwise
ops (--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_ELTWISE), so dots go to
XLA's own (Eigen) kernels. Times are medians over --reps interleaved calls; the JSON holds
us per product, weight GB/s, and each variant's time over the best of its (shape, M, flag).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

FLAGS = {
    'default': '',
    'no_ynn_dot': '--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_ELTWISE',
}
MLP_DIM = {256: 768, 512: 1536, 768: 2048, 1024: 2816}  # 768: stdlib_mtp; 2048: decode_768


def shapes(d: int) -> dict:
  """name -> (I, O) of the weights a decode step multiplies by at width d.

  qkv and gate_up are the fused products of the decode layout (layers.prepare_decode)."""
  f = MLP_DIM.get(d, 8 * d // 3)
  out = {'qkv': (d, 3 * d), 'o': (d, d), 'gate_up': (d, 2 * f), 'down': (f, d),
         'eh_proj': (2 * d, d), 'head_v256': (d, 256)}
  if d == 256:  # the peer comparison's shape: 4 layers, d 256, V 4096
    out['head_v4096'] = (d, 4096)
  return out


def variants(m: int, sname: str) -> list:
  out = [(v, dt) for v in ('xW', 'xWt', 'Wt_x') for dt in ('float32', 'bfloat16')]
  out += [('Wt_x_bar', 'float32')]
  if m > 4 and m % 8:
    out += [('Wt_x_bar_pad8', 'float32')]
  if m == 1:
    out += [('Wx', 'float32'), ('pad2_xWt', 'bfloat16'), ('pad2_Wt_x', 'bfloat16')]
  elif m <= 4 and not sname.startswith('head'):
    out += [('rows_xW', 'float32')]
  return out


def product(jnp, lax, name, x_MxI, w_IxO, wt_OxI):
  f32 = jnp.float32
  dot_t = lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ())),  # noqa: E731
                                       preferred_element_type=f32)
  m = x_MxI.shape[0]
  if name == 'xW':
    return jnp.dot(x_MxI, w_IxO, preferred_element_type=f32)
  if name == 'xWt':
    return dot_t(x_MxI, wt_OxI)
  if name == 'Wt_x':
    return dot_t(wt_OxI, x_MxI).T
  if name == 'Wt_x_bar':
    return lax.optimization_barrier(dot_t(wt_OxI, x_MxI)).T
  if name == 'Wt_x_bar_pad8':
    xp = jnp.pad(x_MxI, ((0, -m % 8), (0, 0)))
    return lax.optimization_barrier(dot_t(wt_OxI, xp))[:, :m].T
  if name == 'Wx':
    return jnp.dot(wt_OxI, x_MxI[0], preferred_element_type=f32)[None]
  if name == 'pad2_xWt':
    return dot_t(jnp.concatenate([x_MxI, x_MxI], 0), wt_OxI)[:1]
  if name == 'pad2_Wt_x':
    return dot_t(wt_OxI, jnp.concatenate([x_MxI, x_MxI], 0))[:, :1].T
  if name == 'rows_xW':
    return jnp.concatenate(
        [jnp.dot(x_MxI[i:i + 1], w_IxO, preferred_element_type=f32) for i in range(m)], 0)
  raise ValueError(name)


def child(args) -> dict:
  import jax  # deferred: XLA_FLAGS must be set before JAX starts (the parent sets it per flag)
  import jax.numpy as jnp
  import numpy as np
  from jax import lax

  out = {'flag': args.flag, 'xla_flags': os.environ.get('XLA_FLAGS', ''),
         'load_start': os.getloadavg(), 'rows': []}
  key = jax.random.key(0)
  for d in [int(v) for v in args.dims.split(',')]:
    for sname, (i_dim, o_dim) in shapes(d).items():
      nbytes = i_dim * o_dim * 4
      copies = int(min(args.max_copies, max(2, -(-args.cycle_mb * 2**20 // nbytes))))
      ws = {}
      key, sub = jax.random.split(key)
      w32 = jax.random.normal(sub, (copies, i_dim, o_dim), jnp.float32) * 0.02
      for dt in ('float32', 'bfloat16'):  # the same weights, rounded for bf16
        w = w32.astype(dt)
        ws[dt] = ([w[c] for c in range(copies)], [w[c].T.copy() for c in range(copies)])
        jax.block_until_ready(ws[dt])
      del w32, w
      for m in [int(v) for v in args.rows.split(',')]:
        key, sub = jax.random.split(key)
        x = jax.random.normal(sub, (m, i_dim), jnp.float32)
        fns = {}
        for name, dt in variants(m, sname):
          def f(x_MxI, wl, wtl, name=name, dt=dt):
            xc = x_MxI.astype(dt)
            acc = jnp.zeros((m, o_dim), jnp.float32)
            for w_IxO, wt_OxI in zip(wl, wtl):  # distinct copies: each product reads memory
              acc = acc + product(jnp, lax, name, xc, w_IxO, wt_OxI)
            return acc
          fn = jax.jit(f)
          ref = fn(x, *ws[dt])  # compile + warm
          fns[(name, dt)] = (fn, ref)
        # every formulation must compute the same product (bf16 within its rounding)
        want = np.asarray(fns[('xW', 'float32')][1])
        for (name, dt), (_, ref) in fns.items():
          tol = 1e-4 if dt == 'float32' else 3e-2
          err = float(np.max(np.abs(np.asarray(ref) - want)) / (np.max(np.abs(want)) + 1e-30))
          if err > tol:
            raise AssertionError(f'{name}/{dt} d {d} {sname} M {m}: relative error {err}')
        times = {k: [] for k in fns}
        for _ in range(args.reps):  # interleaved: background load hits every variant alike
          for k, (fn, _) in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x, *ws[k[1]]))
            times[k].append(time.perf_counter() - t0)
        for (name, dt), ts in times.items():
          us = float(np.median(ts)) / copies * 1e6
          wbytes = i_dim * o_dim * jnp.dtype(dt).itemsize
          out['rows'].append(dict(d=d, shape=sname, I=i_dim, O=o_dim, M=m, variant=name,
                                  dtype=dt, flag=args.flag, copies=copies,
                                  cycled_MB=round(copies * wbytes / 2**20, 1),
                                  us=round(us, 2), weight_GBps=round(wbytes / us / 1e3, 1)))
        print(f'{args.flag} d {d} {sname:10s} M {m:2d}: ' + ' '.join(
            f'{n}/{dt[:2]} {float(np.median(ts)) / copies * 1e6:.0f}'
            for (n, dt), ts in times.items()), flush=True)
      del ws
  out['load_end'] = os.getloadavg()
  return out


def summarise(rows: list) -> list:
  """Per (d, shape, M): each (flag, variant, dtype) time over the best f32 1-row product."""
  table = []
  groups = {}
  for r in rows:
    groups.setdefault((r['d'], r['shape']), []).append(r)
  for (d, sname), rs in groups.items():
    one_row = min(r['us'] for r in rs if r['M'] == 1 and r['dtype'] == 'float32')
    for m in sorted({r['M'] for r in rs}):
      at_m = sorted((r for r in rs if r['M'] == m), key=lambda r: r['us'])
      best = at_m[0]
      best_f32 = min((r for r in at_m if r['dtype'] == 'float32'), key=lambda r: r['us'])
      table.append(dict(
          d=d, shape=sname, M=m,
          best=f"{best['flag']}/{best['variant']}/{best['dtype']}",
          best_over_f32_1row=round(best['us'] / one_row, 2),
          best_f32=f"{best_f32['flag']}/{best_f32['variant']}",
          best_f32_over_f32_1row=round(best_f32['us'] / one_row, 2),
          ratios={f"{r['flag']}/{r['variant']}/{r['dtype']}": round(r['us'] / best['us'], 2)
                  for r in at_m}))
  return table


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--dims', default='256,512,768,1024')
  p.add_argument('--flag_dims', default='256,768', help='--dims of the no_ynn_dot run')
  p.add_argument('--rows', default='1,2,4,8')
  p.add_argument('--reps', type=int, default=5)
  p.add_argument('--cycle_mb', type=int, default=96, help='weight bytes cycled (L3: 32 MiB)')
  p.add_argument('--max_copies', type=int, default=8, help='cap on copies (compile time)')
  p.add_argument('--flags', default='default', choices=['both'] + list(FLAGS))
  p.add_argument('--out', default='')
  p.add_argument('--merge', action='store_true',
                 help='add the rows to those already in --out (other dims / rows), replacing '
                      'rows of the same (d, shape, M, variant, dtype, flag)')
  p.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  p.add_argument('--flag', default='default', help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    with open(args.out, 'w') as f:
      json.dump(child(args), f)
    return
  flags = list(FLAGS) if args.flags == 'both' else [args.flags]
  report = {'machine': f'{platform.machine()} {os.cpu_count()} CPUs',
            'command': ' '.join(['python'] + sys.argv), 'runs': [], 'rows': []}
  for flag in flags:  # one process per XLA flag setting
    with tempfile.NamedTemporaryFile(suffix='.json', delete=False) as tmp:
      path = tmp.name
    env = dict(os.environ, XLA_FLAGS=(os.environ.get('XLA_FLAGS', '') + ' ' + FLAGS[flag]).strip())
    cmd = [sys.executable, os.path.abspath(__file__), '--child', '--flag', flag, '--out', path,
           '--dims', args.dims if flag == 'default' else args.flag_dims, '--rows', args.rows, '--reps', str(args.reps),
           '--cycle_mb', str(args.cycle_mb), '--max_copies', str(args.max_copies)]
    subprocess.run(cmd, env=env, check=True)
    with open(path) as f:
      res = json.load(f)
    os.unlink(path)
    report['rows'] += res.pop('rows')
    report['runs'].append(res)
  import jax  # deferred: only for the version string, after the children ran
  report['jax'] = jax.__version__
  if args.merge and args.out and os.path.exists(args.out):
    with open(args.out) as f:
      old = json.load(f)
    key = lambda r: (r['d'], r['shape'], r['M'], r['variant'], r['dtype'], r['flag'])  # noqa: E731
    new_keys = {key(r) for r in report['rows']}
    report['rows'] = [r for r in old['rows'] if key(r) not in new_keys] + report['rows']
    report['runs'] = old['runs'] + report['runs']
    report['command'] = old['command'] + ' ; ' + report['command']
  report['summary'] = summarise(report['rows'])
  text = json.dumps(report, indent=1)
  if args.out:
    with open(args.out, 'w') as f:
      f.write(text + '\n')
  for s in report['summary']:
    print(f"d {s['d']:4d} {s['shape']:10s} M {s['M']:2d}: best {s['best']} "
          f"{s['best_over_f32_1row']}x f32 1-row; best f32 {s['best_f32']} "
          f"{s['best_f32_over_f32_1row']}x")


if __name__ == '__main__':
  main()
