"""MLA decode: W_vb absorbed into o_proj vs the two steps (W_vb, then o_proj), interleaved.

  python benchmarks/mla_decode_forms.py
  python benchmarks/mla_decode_forms.py --out benchmarks/results/mla_decode_forms.json

MLAttention.prepare_decode picks the output form by size (the absorbed [d, n kvr] matrix
when kvr d <= dv (kvr + d), else vb_t + o_t): a decode step reads every weight once. This
times one MLAttention.decode call (batch 1, 1 and 4 new tokens, a 512-slot latent cache,
random weights) with each form, interleaved, for dsv3_mini's widths and for DeepSeek-V3's
ratios at d 1024 (kv_lora_rank 4 x v_head_dim, as 512 / 128). Medians over --reps calls.
"""
import json
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import common  # benchmarks/common.py
from mtp_jax.model import (
  ModelArgs,  # noqa: E402
  mla,  # noqa: E402
)

NAME = 'mla_decode_forms'

SHAPES = {  # d, heads, kv_lora_rank, qk_nope, qk_rope, v_head_dim, q_lora_rank
    'dsv3_mini': (128, 4, 32, 32, 16, 32, 96),
    'dsv3_ratios_d1024': (1024, 8, 256, 64, 32, 64, 384),
}
SLOTS, POSITION = 512, 300


def time_forms(shape, rows, reps):
  d, n, kvr, dn, dr, dv, qr = shape
  args = ModelArgs(vocab_size=64, d_model=d, n_heads=n, q_lora_rank=qr, kv_lora_rank=kvr,
                   qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=dv)
  with nnx.use_eager_sharding(False):
    base = mla.MLAttention(args, nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (1, rows, d))
  pos = POSITION + jnp.arange(rows)[None]
  mask = (jnp.arange(SLOTS)[None, None] <= pos[:, :, None])[:, None]
  cache = (jax.random.normal(jax.random.key(1), (1, SLOTS, kvr + dr)),)
  index = jnp.array([POSITION], jnp.int32)
  fns = {}
  for absorb in (True, False):
    module = nnx.merge(*nnx.split(base))
    module.prepare_decode(absorb)
    graphdef, state = nnx.split(module)
    fn = jax.jit(lambda st, x, c, g=graphdef: nnx.merge(g, st).decode(x, pos, mask, c, index)[0])
    fn(state, x, cache).block_until_ready()
    fns['absorbed' if absorb else 'two_step'] = (fn, state)
  times = {k: [] for k in fns}
  for _ in range(reps):
    for k, (fn, state) in fns.items():
      t0 = time.perf_counter()
      fn(state, x, cache).block_until_ready()
      times[k].append(time.perf_counter() - t0)
  us = {k: float(np.median(v) * 1e6) for k, v in times.items()}
  return {'rows': rows, 'absorbed_us': us['absorbed'], 'two_step_us': us['two_step'],
          'absorbed_over_two_step': us['absorbed'] / us['two_step'],
          'weights_absorbed': n * kvr * d, 'weights_two_step': n * dv * (kvr + d),
          'chosen': 'absorbed' if kvr * d <= dv * (kvr + d) else 'two_step'}


def parse(argv):
  p = common.parser(NAME, __doc__)
  p.add_argument('--reps', type=int, default=300, help='timed calls of each form')
  a = p.parse_args(argv)
  if a.reps < 1:
    p.error('--reps must be >= 1')
  if a.smoke:
    a.reps = 2
  return a


def main(argv=None) -> int:
  a = parse(argv)
  run = common.start(a, NAME, argv)
  rows_out = []
  for name, shape in SHAPES.items():
    if a.smoke and name != 'dsv3_mini':
      continue
    for rows in ((1,) if a.smoke else (1, 4)):
      r = dict(shape=name, **time_forms(shape, rows, a.reps))
      rows_out.append(r)
      print(json.dumps(r), file=sys.stderr, flush=True)
  common.write(run, {'slots': SLOTS, 'results': rows_out})
  return 0


if __name__ == '__main__':
  sys.exit(main())
