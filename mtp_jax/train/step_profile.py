"""Where a compiled step's time goes on XLA:CPU: a `jax.profiler` trace read op by op.

XLA:CPU's thunk executor records one trace event per executed HLO op (its `hlo_op` stat)
on the thread that ran it. `op_times` reads a trace's `.xplane.pb` (jax.profiler.ProfileData)
into each op's self time (nested events subtracted) per thread, and how long each thread
was busy against the step's span; `classify` names each op of the compiled module's HLO
text by kind and region; `breakdown` adds the two up:

  kind    'matmul: <dot form>' (aot.hlo_read.cpu_dot_forms' forms: 'bf16 kernels' is the
          fast bf16 form), 'convert', 'copy / transpose' (copies, transposes, slices,
          concatenations, pads with no arithmetic), 'reduction' (a fusion with a reduce),
          'elementwise' (any other fusion or op), 'collective' (all-reduce and kin),
          'control' (a loop's or call's own time), and 'host gap': the part of the step's
          span in which a device thread ran no op (dispatch, waiting for the other device).
  region  the named scope an op was traced under (REGIONS: the attention core, the loss
          head, the optimizer update), else 'trunk and MTP blocks'.

Op times are summed over the threads that ran them and divided by the cores the process
has, so the kinds of one step add up to its wall time (the host gap is what is left).
"""
from __future__ import annotations

import collections
import glob
import os
import re
import tempfile

import jax
from jax.profiler import ProfileData  # jaxlib's reader of a trace's protobuf

from mtp_jax.runtime import profiling
from mtp_jax.train.aot import hlo_read

# The named scopes (runtime/profiling.py) the model and step trace their parts under; an op
# whose op_name holds one is in that region.
REGIONS = {profiling.ATTENTION_SCOPE: 'attention core', profiling.LOSS_SCOPE: 'loss head',
           profiling.OPTIMIZER_SCOPE: 'optimizer'}
OTHER_REGION = 'trunk and MTP blocks'
HOST_GAP = 'host gap'

_COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all',
                'collective-permute')
_MOVES = {'copy', 'transpose', 'slice', 'concatenate', 'pad', 'dynamic-slice',
          'dynamic-update-slice', 'reverse', 'gather'}
_FREE = {'parameter', 'bitcast', 'reshape', 'broadcast', 'constant', 'tuple',
         'get-tuple-element', 'iota'}
_CONTROL = {'while', 'conditional', 'call'}
_CALLS = re.compile(r'(?:calls|to_apply|body|condition)=%?([\w.\-]+)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def trace_run(run, directory: str | None = None) -> str:
  """Runs `run()` (one step, waited for) inside a jax.profiler trace; the .xplane.pb path."""
  directory = directory or tempfile.mkdtemp(prefix='step_profile_')
  jax.profiler.start_trace(directory)
  try:
    run()
  finally:
    jax.profiler.stop_trace()
  found = sorted(glob.glob(os.path.join(directory, '**', '*.xplane.pb'), recursive=True))
  if not found:
    raise RuntimeError(f'jax.profiler wrote no .xplane.pb under {directory}')
  return found[-1]


def op_times(xplane_path: str) -> dict:
  """{'ops': {op name: self ns summed over threads}, 'busy_ns', 'span_ns', 'threads'}.

  An op's self time is its event's duration less the events nested inside it on the same
  thread (a loop's body ops inside the loop); busy: the threads' top-level op time summed;
  span: the first op's start to the last op's end over all threads."""
  data = ProfileData.from_file(xplane_path)
  self_ns, busy, threads, first, last = collections.Counter(), 0.0, 0, float('inf'), 0.0
  for plane in data.planes:
    for line in plane.lines:
      events = []
      for e in line.events:
        stats = dict(e.stats)
        if 'hlo_op' in stats:
          events.append((e.start_ns, e.duration_ns, str(stats['hlo_op'])))
      if not events:
        continue
      threads += 1
      events.sort(key=lambda x: (x[0], -x[1]))
      stack = []
      for start, dur, name in events:
        while stack and stack[-1][0] + stack[-1][1] <= start:
          stack.pop()
        if stack:
          self_ns[stack[-1][2]] -= dur
        else:
          busy += dur
        self_ns[name] += dur
        stack.append((start, dur, name))
      first = min(first, events[0][0])
      last = max(last, max(s + d for s, d, _ in events))
  return {'ops': dict(self_ns), 'busy_ns': busy, 'span_ns': max(last - first, 0.0),
          'threads': threads}


def classify(hlo_text: str) -> dict:
  """{op name: (kind, region)} for every instruction of a compiled module's HLO text."""
  comps, _, _ = hlo_read.read_computations(hlo_text)
  contents = {}  # computation -> (ops it holds, transitively through calls; first dot form)

  def content(comp: str, seen=()):
    if comp in contents:
      return contents[comp]
    ops, form = set(), None
    body = comps.get(comp, [])
    shapes = {name: typ for name, typ, *_ in body}
    for _, typ, op, rest, _ in body:
      ops.add(op)
      if op == 'dot' and form is None:
        form = hlo_read.dot_form(typ, rest, shapes)
      for callee in _CALLS.findall(rest):
        if callee not in seen and callee in comps:
          sub_ops, sub_form = content(callee, seen + (comp,))
          ops |= sub_ops
          form = form or sub_form
    contents[comp] = (ops, form)
    return contents[comp]

  out = {}
  for body in comps.values():
    shapes = {name: typ for name, typ, *_ in body}
    for name, typ, op, rest, _ in body:
      m = _OP_NAME.search(rest)
      op_name = m.group(1) if m else ''
      region = next((r for s, r in REGIONS.items() if s in op_name), OTHER_REGION)
      if op == 'dot':
        kind = 'matmul: ' + hlo_read.dot_form(typ, rest, shapes)
      elif re.sub(r'-(start|done)$', '', op) in _COLLECTIVES:
        kind = 'collective'
      elif op in _CONTROL:
        kind = 'control'
      elif op == 'fusion' or op == 'custom-call':
        callees = [c for c in _CALLS.findall(rest) if c in comps]
        ops, form = set(), None
        for c in callees:
          sub_ops, sub_form = content(c)
          ops |= sub_ops
          form = form or sub_form
        kind = _kind_of(ops, form)
      else:
        kind = _kind_of({op}, None)
      out[name] = (kind, region)
  return out


def _kind_of(ops: set, form) -> str:
  if form is not None:
    return 'matmul: ' + form
  work = ops - _FREE
  if 'reduce' in work or 'reduce-window' in work:
    return 'reduction'
  if not work:
    return 'copy / transpose'
  if work <= _MOVES | {'convert'}:
    return 'convert' if 'convert' in work else 'copy / transpose'
  if work & set(_COLLECTIVES):
    return 'collective'
  return 'elementwise'


def cores() -> int:
  """The CPU cores this process may run on."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def breakdown(xplane_path: str, hlo_text: str, steps: int = 1, ncores: int | None = None) -> dict:
  """Seconds per step of a traced run of `steps` steps: {'by_kind': {kind: s}, 'by_region':
  {region: {'matmul': s, 'other': s}}, 'step_s', 'matmul_share', 'top_ops': [(op, kind,
  region, s), ...], 'threads', 'cores'}.

  Op times are summed over the threads that ran them and divided by the cores (`ncores`,
  default this process's): what each kind costs of the step's wall time when the cores
  are shared out. 'host gap' is the rest of the span: cores with no op running."""
  kinds = classify(hlo_text)
  t = op_times(xplane_path)
  if not t['threads']:
    raise RuntimeError(f'no HLO op events in {xplane_path}')
  ncores = ncores or cores()
  scale = 1.0 / (1e9 * steps * ncores)
  by_kind, by_region, per_op = (collections.Counter(), collections.defaultdict(
      collections.Counter), collections.Counter())
  for op, ns in t['ops'].items():
    kind, region = kinds.get(op, ('elementwise', OTHER_REGION))
    s = ns * scale
    by_kind[kind] += s
    by_region[region]['matmul' if kind.startswith('matmul') else 'other'] += s
    per_op[op] += s
  span = t['span_ns'] / 1e9 / steps
  by_kind[HOST_GAP] = max(span - t['busy_ns'] * scale, 0.0)
  matmul = sum(v for k, v in by_kind.items() if k.startswith('matmul'))
  top = [(op, *kinds.get(op, ('?', '?')), s) for op, s in per_op.most_common(12)]
  return {'step_s': span, 'by_kind': dict(by_kind.most_common()),
          'by_region': {r: dict(v) for r, v in by_region.items()},
          'matmul_share': matmul / span if span else 0.0, 'top_ops': top,
          'threads': t['threads'], 'cores': ncores}


def format_breakdown(b: dict) -> str:
  """A few lines: each kind's seconds and share of the step."""
  lines = [f'step {b["step_s"] * 1e3:.0f} ms, {b["threads"]} threads on {b["cores"]} cores; '
           f'matmul share {b["matmul_share"]:.2f}']
  for k, v in b['by_kind'].items():
    lines.append(f'  {k:<40s} {v * 1e3:8.1f} ms  {v / b["step_s"]:6.1%}')
  for r, v in b['by_region'].items():
    lines.append(f'  [{r}] matmul {v.get("matmul", 0) * 1e3:.1f} ms, '
                 f'other {v.get("other", 0) * 1e3:.1f} ms')
  return '\n'.join(lines)
