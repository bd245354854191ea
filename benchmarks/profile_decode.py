"""Where a decode iteration's time goes: thunk times of the compiled AR and D-draft programs.

  python benchmarks/profile_decode.py --shape 768:12 --out /tmp/profile_decode.json

For a random model of that size (decode_speed._random_decoders: 128-wide heads, MLP 3d),
batch 1, greedy, float32, prompt bucket --prompt_len and --max_new_tokens: each program
runs a prefill-only call (max_new 1) and a --new-token call under jax.profiler; the thunk
durations (XLA:CPU records one event per executed thunk) are summed per (phase, piece) by
the source frames of the HLO instruction (profile_step.hlo_metadata) and the prefill-only
sums are subtracted, over the loop-step difference: thunk ms per loop iteration. Phase:
verify (decode._verify), mtp (decode._mtp_pass), loop (the rest of the iteration); piece:
the innermost mtp_jax function that names one (products, attention dots, softmax, rope,
cache writes, norms, head, ...). Also the number of thunks executed per iteration: on
this CPU each costs a few µs of executor time whatever it does. Thunks may overlap on the
cores, so these are summed thunk times, not wall time; the profiler inflates small ones.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_speed  # noqa: E402
import decode_split  # noqa: E402
import profile_step  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mtp_jax.decode import decoder as decode  # noqa: E402

PIECES = [  # (piece, regex over one frame), innermost frame first, first match wins
    ('attn dots (scores, probs.v)', r'_few_query_dot'),
    ('products (decode_dot)', r'decode_dot'),
    ('cache write', r'_write_heads_major'),
    ('rope', r'apply_rope|rope_inv_freq'),
    ('softmax', r'softmax'),
    ('rmsnorm', r'normalization\.py'),
    ('attn other (mask, reshapes)', r'Attention\.decode'),
    ('mlp other (silu*up)', r'MLP\.decode'),
    ('residual', r'Block\.decode'),
    ('combine (concat, norms)', r'combine'),
    ('head / logits', r'decode_logits'),
    ('embed', r'decode_embed'),
    ('window / mask build', r'_window'),
    ('sampling / accept', r'sampling\.py'),
]
PHASES = [('prefill', r'_prefill'), ('verify', r'_verify'), ('mtp', r'_mtp_pass'),
          ('loop', r'_iteration|body|cond')]


def _phase(desc):
  frames = desc.split(' @ ', 1)[-1]
  for name, pattern in PHASES:  # outermost phase that appears anywhere
    if re.search(pattern, frames):
      return name
  return 'other'


def profile(dec, prog, ab, new, rounds, hlo_dir=''):
  example = dec._inputs(prog, [[0]] * prog.batch, 1, 1, 0.0, 0, 1.0, 0)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)),
                          example)
  with decode_split._patched(ab):
    fn = jax.jit(functools.partial(decode._decode, prog, dec.graphdef, dec._treedef))
    compiled = fn.lower(*abstract).compile()
  text = compiled.as_text()
  if hlo_dir:
    with open(os.path.join(hlo_dir, f'd{prog.num_drafts}.hlo.txt'), 'w') as f:
      f.write(text)
  meta = profile_step.hlo_metadata(text, max_frames=40)
  # XLA:CPU's 1-row dots (the AR step's GEMVs and its 1-query attention) come out of its
  # dot rewrites without metadata: attribute them by result rank (2-D: a weight product,
  # 3-D: the attention's batched dot over KV heads) to the step's main pass.
  shapes = dict(re.findall(r'^\s*(?:ROOT\s+)?%?(dot[\w.\-]*) = \w+\[([\d,]*)\]', text, re.M))
  for op, shape in shapes.items():
    if not meta.get(op, ' @ ').split(' @ ', 1)[1]:
      piece = 'decode_dot' if shape.count(',') == 1 else '_few_query_dot'
      meta[op] = f'{op} @ layers.py:{piece} < decode.py:_verify'
  prompt = [[7] * prog.prompt_len]
  sums = {}
  for m in (1, new):
    inputs = dec._inputs(prog, prompt, m, None, 0.0, 0, 1.0, 0)
    for _ in range(2):
      jax.block_until_ready(compiled(*inputs))
    results, thunks = profile_step.thunk_events(
        lambda: jax.block_until_ready(compiled(*inputs)), rounds)
    acc = collections.Counter()
    for op, ms in thunks:
      desc = meta.get(op, '')
      key = (_phase(desc), profile_step.categorize(desc, PIECES))
      acc[key] += ms / rounds
      acc[key + ('#',)] += 1 / rounds
      acc[('ops', op, desc[:200])] += ms / rounds
    sums[m] = (acc, int(results[-1].step))
  (a1, s1), (a2, s2) = sums[1], sums[new]
  steps = s2 - s1
  per = {k: (a2[k] - a1.get(k, 0.0)) / steps for k in a2 if k[0] != 'ops'}
  ops = sorted(((a2[k] - a1.get(k, 0.0)) / steps, k[1], k[2]) for k in a2 if k[0] == 'ops')[::-1]
  return per, ops


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--config', default='configs/decode_768.py', help='config source (vocab, norms)')
  p.add_argument('--shape', default='768:12')
  p.add_argument('--prompt_len', type=int, default=128)
  p.add_argument('--max_new_tokens', type=int, default=128)
  p.add_argument('--new', type=int, default=33, help='tokens of the timed run')
  p.add_argument('--rounds', type=int, default=2)
  p.add_argument('--drafts', type=int, default=3)
  p.add_argument('--ab', default='', help="decode_split's MODULE.ATTR=VALUE[;...] while tracing")
  p.add_argument('--hlo_dir', default='', help='also write each program\'s optimized HLO there')
  p.add_argument('--out', default='')
  a = p.parse_args()
  import importlib.util
  spec = importlib.util.spec_from_file_location('decode_config', a.config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  d, n_layers = (int(x) for x in a.shape.split(':'))
  dec = decode_speed._random_decoders(config, d, n_layers, ['float32'])['float32']
  out = {'shape': a.shape, 'ab': a.ab, 'load_start': os.getloadavg(), 'programs': {}}
  for name, nd in (('ar', 0), (f'd{a.drafts}', a.drafts)):
    prog = dec.program(1, a.prompt_len, a.max_new_tokens, num_drafts=nd)
    per, ops = profile(dec, prog, a.ab, a.new, a.rounds, a.hlo_dir)
    total = sum(v for k, v in per.items() if len(k) == 2)
    count = sum(v for k, v in per.items() if len(k) == 3)
    rows = sorted(((k, v, per.get(k + ('#',), 0.0)) for k, v in per.items() if len(k) == 2),
                  key=lambda r: -r[1])
    out['programs'][name] = {
        'thunk_ms_per_iteration': total, 'thunks_per_iteration': count,
        'by_phase_piece_ms': {f'{k[0]} | {k[1]}': round(v, 4) for k, v, _ in rows},
        'thunks_by_phase_piece': {f'{k[0]} | {k[1]}': round(c, 1) for k, _, c in rows},
        'top_ops': [{'ms': round(v, 4), 'op': o, 'src': s} for v, o, s in ops[:300]]}
    print(f'{name}: {total:.2f} thunk ms / iteration, {count:.0f} thunks')
    for k, v, c in rows:
      print(f'  {k[0]:8s} {k[1]:32s} {v:7.3f} ms {c:6.0f} thunks')
  out['load_end'] = os.getloadavg()
  if a.out:
    with open(a.out, 'w') as f:
      json.dump(out, f, indent=1)


if __name__ == '__main__':
  main()
