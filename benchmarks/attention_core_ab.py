"""The blocked attention core alone, fwd + bwd under the train step's remat policy, A/B in
one process (round robin): this version against the one before issue 14's second pass.

  python benchmarks/attention_core_ab.py --heads 8 --rounds 8
  python benchmarks/attention_core_ab.py --heads 2 --variants before64,now64,now128,gqa_before64,gqa_now64

B 16, T 256, d 256 = heads x head width, packed rows with segment ids (train_throughput's
synthetic batch); the loss is sum(out * g) for a fixed random g, under jax.checkpoint with
model.remat_policy('block'), gradients of q, k and v. saved* is the custom-VJP core
(saved_core=True, what model.remat = block runs without GQA). The gqa_* variants use every
second KV head (N / 2 KV heads). Prints each variant's largest
absolute difference to the first variant of the same kind (values and gradients).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_throughput as tt  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


from mtp_jax.model import attention as attn_lib
from mtp_jax.model import mtp as model


def variants():
  out = {}
  for blk in (16, 32, 64, 128):
    out[f'before{blk}'] = lambda q, k, v, m, blk=blk: tt.blocked_attention_before(q, k, v, m, blk)
    out[f'now{blk}'] = lambda q, k, v, m, blk=blk: attn_lib.blocked_causal_attention(q, k, v, m, blk)
    out[f'saved{blk}'] = lambda q, k, v, m, blk=blk: attn_lib.blocked_causal_attention(q, k, v, m, blk, saved_core=True)
  out['gqa_before64'] = lambda q, k, v, m: tt.blocked_attention_before(q, k[:, :, ::2], v[:, :, ::2], m, 64)
  out['gqa_now64'] = lambda q, k, v, m: attn_lib.blocked_causal_attention(q, k[:, :, ::2], v[:, :, ::2], m, 64)
  out['xla_library'] = lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m)
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--heads', type=int, default=8)
  ap.add_argument('--rounds', type=int, default=8)
  ap.add_argument('--variants', default='before64,now64,now32,now128')
  a = ap.parse_args()
  b, t, n = 16, 256, a.heads
  h = 256 // n
  rng = np.random.default_rng(0)
  q, k, v, g = (jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32) for _ in range(4))
  mask = attn_lib.attention_mask(jnp.asarray(tt.synthetic_batch(b, t, 1024)['segment_ids']))
  policy = model.remat_policy('block')
  all_variants = variants()
  fns, refs = {}, {}
  for name in a.variants.split(','):
    f = all_variants[name]
    loss = lambda q, k, v, f=f: jnp.sum(jax.checkpoint(lambda *x: f(*x, mask), policy=policy)(q, k, v) * g)
    fns[name] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    out = jax.block_until_ready(fns[name](q, k, v))
    kind = name.startswith('gqa')
    ref = refs.setdefault(kind, out)
    err = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
    print(f'{name}: max abs difference to the first {"gqa " if kind else ""}variant {err:.3g}', flush=True)
  times = {name: [] for name in fns}
  load0 = os.getloadavg()
  for _ in range(a.rounds):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(q, k, v))
      times[name].append(time.perf_counter() - t0)
  base = next(iter(fns))
  print(f'heads {n} x {h}, load {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}')
  for name in fns:
    ratio = statistics.median(x / y for x, y in zip(times[name], times[base]))
    print(f'{name:14s} median {statistics.median(times[name]) * 1e3:7.1f} ms  best '
          f'{min(times[name]) * 1e3:7.1f} ms  time / {base} {ratio:.3f}')


if __name__ == '__main__':
  main()
