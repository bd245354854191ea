"""The attention core alone, forward + backward under the train step's remat policy, A/B in
one process (round robin).

  python benchmarks/attention_core.py --heads 8 --rounds 8
  python benchmarks/attention_core.py --heads 2 --variants xla,blocked64,blocked128,saved64

Batch 16, T 256, d 256 = heads x head width, packed rows with segment ids
(train_throughput.synthetic_batch); the loss is sum(out * g) for a fixed random g, under
jax.checkpoint with model.remat_policy('block'), gradients of q, k and v. Variants:
  xla          jax.nn.dot_product_attention (model.attention_core = xla)
  blockedN     attention.blocked_causal_attention with query blocks of N
               (model.attention_core = blocked, model.attention_block = N)
  savedN       the same with saved_core=True: the custom-VJP core that model.remat = block
               runs without GQA
  gqa_blocked64  blocked64 with every second KV head (N / 2 KV heads)
Prints each variant's largest absolute difference to the first variant (values and
gradients; the GQA variant against itself) and writes the medians and ratios.
"""
from __future__ import annotations

import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # benchmarks/common.py
from mtp_jax.model import attention as attn_lib  # noqa: E402
from mtp_jax.model import blocks as blocks_lib  # noqa: E402

NAME = 'attention_core'


def variants() -> dict:
  out = {'xla': lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m)}
  for blk in (16, 32, 64, 128):
    out[f'blocked{blk}'] = (
        lambda q, k, v, m, blk=blk: attn_lib.blocked_causal_attention(q, k, v, m, blk))
    out[f'saved{blk}'] = (lambda q, k, v, m, blk=blk: attn_lib.blocked_causal_attention(
        q, k, v, m, blk, saved_core=True))
  out['gqa_blocked64'] = (lambda q, k, v, m: attn_lib.blocked_causal_attention(
      q, k[:, :, ::2], v[:, :, ::2], m, 64))
  return out


VARIANTS = variants()


def parse(argv):
  p = common.parser(NAME, __doc__)
  p.add_argument('--heads', type=int, default=8, help='heads; head width = 256 / heads')
  p.add_argument('--rounds', type=int, default=8)
  p.add_argument('--variants', default='xla,blocked64,saved64,blocked32,blocked128',
                 help=f'comma-separated, of {", ".join(VARIANTS)}')
  a = p.parse_args(argv)
  a.variants = common.names_flag(p, a.variants, VARIANTS, '--variants')
  if a.heads < 1 or 256 % a.heads or a.rounds < 1:
    p.error('--heads must divide 256 and --rounds be >= 1')
  a.batch, a.seq = (2, 32) if a.smoke else (16, 256)
  if a.smoke:
    a.rounds, a.heads = 1, 2
  return a


def main(argv=None) -> int:
  a = parse(argv)
  import train_throughput as tt  # pylint: disable=import-outside-toplevel
  run = common.start(a, NAME, argv)
  b, t, n = a.batch, a.seq, a.heads
  h = (32 if a.smoke else 256) // n
  rng = np.random.default_rng(0)
  q, k, v, g = (jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32) for _ in range(4))
  mask = attn_lib.attention_mask(jnp.asarray(tt.synthetic_batch(b, t, 1024)['segment_ids']))
  policy = blocks_lib.remat_policy('block')
  fns, refs, errors = {}, {}, {}
  for name in a.variants:
    f = VARIANTS[name]
    loss = lambda q, k, v, f=f: jnp.sum(  # noqa: E731
        jax.checkpoint(lambda *x: f(*x, mask), policy=policy)(q, k, v) * g)
    fns[name] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    out = jax.block_until_ready(fns[name](q, k, v))
    ref = refs.setdefault(name.startswith('gqa'), out)
    errors[name] = max(float(jnp.max(jnp.abs(x - y)))
                       for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
  times = {name: [] for name in fns}
  for _ in range(a.rounds):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(q, k, v))
      times[name].append(time.perf_counter() - t0)
  base = a.variants[0]
  rows = {}
  for name in fns:
    rows[name] = {'median_ms': 1e3 * common.median(times[name]),
                  'best_ms': 1e3 * min(times[name]),
                  f'time_ratio_vs_{base}_median': common.median(
                      [x / y for x, y in zip(times[name], times[base])]),
                  'max_abs_diff_vs_first': errors[name]}
    print(f'{name:14s} {rows[name]}', file=sys.stderr)
  common.write(run, {'batch': b, 'seq_len': t, 'heads': n, 'head_dim': h, 'rounds': a.rounds,
                     'variants': rows})
  return 0


if __name__ == '__main__':
  sys.exit(main())
