"""Where the train step's time goes: a jax.profiler trace of the compiled step, per HLO op.

  python benchmarks/profile_step.py --depths 0,3 --steps 3 --out /tmp/profile.json

XLA:CPU's thunk executor records one trace event per executed thunk (fusion, dot, YNN
fusion, copy ...) with its HLO instruction name. Each instruction of the optimized HLO
carries the jax source line it came from (metadata op_name / source_file:line) and
whether it is in the backward pass (op_name contains 'transpose(' = a VJP) or in the
rematerialised forward ('rematted_computation' / 'checkpoint'), so summing the thunks'
durations by source category gives the share of the step each piece of the model takes.
The model is MaxText's CPU peer shape (train_throughput.maxtext_config). Thunks can run
concurrently on the two cores, so the shares are of summed thunk time, not of wall time.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mtp_jax.runtime import host_memory  # noqa: E402  (standard library only)

# scripts/train.py's allocator setting (--host_malloc), before JAX starts a thread
HOST_MALLOC = host_memory.configure(host_memory.mode_from_argv(sys.argv)) if __name__ == "__main__" else None

import train_throughput as tt  # noqa: E402

import jax  # noqa: E402

# (category, regex over the innermost project/library frames of an op), first match wins.
CATEGORIES = [
    ('optimizer (optax)', r'optax/(?!losses/)'),  # optax's cross-entropy is the loss's
    ('keep_finite (state select)', r'keep_finite_update'),
    ('attention core', r'blocked_causal_attention|dot_product_attention'),
    ('rope', r'apply_rope|rope_inv_freq'),
    ('rmsnorm', r'normalization\.py|rms_normalize|_rms_vjp'),
    ('loss: vocab proj + CE', r'vocab_logits|chunk_body|_head_sums|loss\.py'),
    ('MLP projections + SwiGLU', r'layers\.py:MLP\.'),
    ('q/k/v/o projections', r'layers\.py:Attention\.'),
    ('MTP combine (eh_proj, concat)', r'combine'),
    ('mask', r'attention_mask'),
    ('residual adds', r'Block\.__call__|run_blocks|_apply_block'),
    ('embedding / shift', r'embed|shift_left|linear\.py|MTPModel'),
    ('train_step (grad norm, metrics)', r'steps\.py'),
]


def hlo_metadata(hlo_text: str, max_frames: int = 12) -> dict:
  """instruction name -> 'op_name @ innermost frames' (up to max_frames) of the optimized HLO text."""
  tables = {'FileNames': {}, 'FunctionNames': {}, 'FileLocations': {}, 'StackFrames': {}}
  current = None
  out = {}
  for line in hlo_text.splitlines():
    if line.strip() in tables:
      current = tables[line.strip()]
      continue
    if current is not None:
      m = re.match(r'(\d+) (.*)', line)
      if m:
        current[int(m.group(1))] = m.group(2)
        continue
      if line.strip():
        current = None
    m = re.match(r'\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=', line)
    if not m:
      continue
    meta = re.search(r'metadata=\{([^}]*)\}', line)
    md = meta.group(1) if meta else ''
    op = re.search(r'op_name="([^"]*)"', md)
    sf = re.search(r'stack_frame_id=(\d+)', md)
    out[m.group(1)] = ((op.group(1) if op else ''), int(sf.group(1)) if sf else 0)

  def frames(fid):
    names = []
    for _ in range(max_frames):
      fr = tables['StackFrames'].get(fid)
      if not fr:
        break
      loc = int(re.search(r'file_location_id=(\d+)', fr).group(1))
      parent = int(re.search(r'parent_frame_id=(\d+)', fr).group(1))
      l = tables['FileLocations'].get(loc, '')
      fn = tables['FileNames'].get(int(re.search(r'file_name_id=(\d+)', l).group(1)), '').strip('"')
      func = tables['FunctionNames'].get(int(re.search(r'function_name_id=(\d+)', l).group(1)), '').strip('"')
      line_no = re.search(r'line=(\d+)', l).group(1)
      names.append(f'{os.path.basename(fn)}:{func}:{line_no}'
                   if 'site-packages' not in fn else f'{fn.split("site-packages/")[1]}:{func}')
      parent -= 1  # the text prints the parent's id + 1 (0 + 1: a root frame)
      if parent <= 0 or parent == fid:
        break
      fid = parent
    return names

  return {k: f'{op} @ ' + ' < '.join(frames(fid)) for k, (op, fid) in out.items()}


def categorize(desc: str, table=None) -> str:
  """The category of the innermost frame that matches one (the op's own code first);
  table: (name, regex) pairs, CATEGORIES by default."""
  for frame in desc.split(' @ ', 1)[-1].split(' < '):
    for name, pattern in table or CATEGORIES:
      if re.search(pattern, frame):
        return name
  return 'other'


def phase(desc: str) -> str:
  if 'transpose(' in desc:
    return 'bwd'
  if 'checkpoint' in desc or 'remat' in desc:
    return 'fwd (remat region)'
  return 'fwd'


def thunk_events(run, rounds: int, module_prefix: str = '') -> tuple[list, list]:
  """Calls run() `rounds` times under jax.profiler: (its results, [(hlo_op, ms)] of every
  executed thunk of the modules whose name starts with module_prefix). The while / call /
  conditional thunks are left out: each encloses its body's thunks, which are counted."""
  logdir = tempfile.mkdtemp(prefix='mtp_prof_')
  jax.profiler.start_trace(logdir, create_perfetto_trace=True)
  results = [run() for _ in range(rounds)]
  jax.profiler.stop_trace()
  trace = glob.glob(os.path.join(logdir, 'plugins/profile/*/perfetto_trace.json.gz'))[0]
  d = json.load(gzip.open(trace))
  shutil.rmtree(logdir)
  thunks = []
  for e in d['traceEvents'] if isinstance(d, dict) else d:
    args = e.get('args') or {}
    if (e.get('ph') != 'X' or 'hlo_op' not in args
        or not str(args.get('hlo_module', '')).startswith(module_prefix)
        or re.match(r'(while|call|conditional)\b', args['hlo_op'])):
      continue
    thunks.append((args['hlo_op'], e['dur'] / 1e3))
  return results, thunks


def profile(depth: int, steps: int, config: str = 'maxtext', **model) -> dict:
  if config == 'maxtext':
    c = tt.maxtext_config(depth, **model)
  else:  # a configs/<name>.py at its own D unless --depths says otherwise (-1)
    c = tt._with_model(tt.load_config(config), model)
    if depth >= 0:
      c.model.mtp.depth = depth
  step = tt.Step(c)
  meta = hlo_metadata(step.compiled.as_text())
  for _ in range(2):
    step.run()
  results, thunks = thunk_events(step.run, steps, module_prefix='jit_')
  walls = [r[0] for r in results]
  by_cat = collections.Counter()
  by_phase = collections.Counter()
  by_op = collections.Counter()
  kinds = collections.Counter()
  total = 0.0
  for op, ms in thunks:
    desc = meta.get(op, '')
    dur = ms / steps  # ms per step
    cat = categorize(desc)
    by_cat[cat] += dur
    by_phase[(cat, phase(desc))] += dur
    by_op[(op, cat, desc[:160])] += dur
    kinds[re.sub(r'[.\d]+$', '', op)] += dur
    total += dur
  wall = sorted(walls)[len(walls) // 2] * 1e3
  return {
      'depth': depth, 'model': model, 'wall_ms_median': wall, 'thunk_ms_per_step': total,
      'categories_ms': dict(by_cat.most_common()),
      'categories_share': {k: v / total for k, v in by_cat.most_common()},
      'category_phase_ms': {f'{c} | {p}': v for (c, p), v in by_phase.most_common()},
      'op_kinds_ms': dict(kinds.most_common(15)),
      'top_ops': [{'op': o, 'cat': c, 'ms': v, 'src': s} for (o, c, s), v in by_op.most_common(40)],
      'top_ops_per_category': {
          cat: [{'op': o, 'ms': v, 'src': s} for (o, c, s), v in by_op.most_common() if c == cat][:15]
          for cat in by_cat},
  }


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--depths', default='0,3')
  p.add_argument('--steps', type=int, default=3)
  p.add_argument('--out', default='')
  p.add_argument('--config', default='maxtext',
                 help="'maxtext' (the peer shape) or a configs/<name>.py name, e.g. stdlib_mtp "
                      "(--depths -1: its own D)")
  p.add_argument('--cpu_devices', default='1',
                 help="CPU devices the step trains on (data parallel); 'auto' = the trainer's rule")
  p.add_argument('--host_malloc', default='auto', choices=host_memory.MODES,
                 help='read before the imports (HOST_MALLOC above), as scripts/train.py')
  a = p.parse_args()
  n = tt.distributed.resolve_cpu_devices(a.cpu_devices)  # before JAX's backend starts
  if n:
    jax.config.update('jax_num_cpu_devices', n)
  tt.STEP_DEVICES = n or 1
  out = {'jax': jax.__version__, 'config': a.config, 'devices': tt.STEP_DEVICES, 'host_malloc': HOST_MALLOC,
         'load_start': os.getloadavg(), 'runs': []}
  for d in (int(x) for x in a.depths.split(',')):
    t0 = time.time()
    r = profile(d, a.steps, a.config)
    r['seconds'] = time.time() - t0
    out['runs'].append(r)
    print(f"D={d}: wall {r['wall_ms_median']:.0f} ms, thunks {r['thunk_ms_per_step']:.0f} ms/step")
    for k, v in r['categories_ms'].items():
      print(f'  {k:40s} {v:8.1f} ms  {v / r["thunk_ms_per_step"]:.3f}')
    for k, v in r['category_phase_ms'].items():
      print(f'    {k:55s} {v:8.1f}')
    for k, v in r['op_kinds_ms'].items():
      print(f'    kind {k:30s} {v:8.1f}')
    for o in r['top_ops'][:25]:
      print(f"    {o['ms']:7.1f} {o['op']:28s} {o['cat']:25s} {o['src'][:110]}")
  out['load_end'] = os.getloadavg()
  if a.out:
    with open(a.out, 'w') as f:
      json.dump(out, f, indent=1)


if __name__ == '__main__':
  main()
