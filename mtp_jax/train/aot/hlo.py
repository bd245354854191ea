"""The compiled HLO of one program: its computations, loop trip counts, FLOPs, HBM bytes,
collectives and kernel calls, per chip per run.

XLA's cost_analysis counts a while body once, so a scanned layer stack reads about
n_layers too low in FLOPs and bytes alike, and it sees nothing inside a kernel call. Here
every computation is weighted by how often it runs (loop bodies by their trip counts),
matmul FLOPs are counted from the dots and convolutions, kernel calls from their shapes
(kernels.py), and HBM bytes from each executed op's operands and results:

  fusion                 the bytes its body reads of each operand (a slice of a stacked
                         array reads the slice) and writes (an in-place update writes the
                         update)
  slice, gather          the bytes they select, read and written
  dynamic-update-slice,  the update, read and written (in place)
  scatter
  kernel call            kernels.py's count
  anything else          operands read once, results written once

An instruction may print over several lines (a Pallas call's backend config and kernel
metadata); the reader joins them before it reads the instruction.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
import sys

import mtp_jax.train.aot.kernels as kernels_lib

COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'ragged-all-to-all',
               'collective-permute')
BYTES = kernels_lib.BYTES
_COMP = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$')
_INSTR = re.compile(r'^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$')
_ARRAY = re.compile(r'\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8\w*|bf16|f16|f32|f64|c64|'
                    r'c128)\[([\d,]*)\]')
_CALLS = re.compile(r'\b(calls|to_apply|body|condition|true_computation|false_computation)='
                    r'%([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# ops that move no bytes of their own (views, tuples, control flow whose bodies are counted)
_NO_BYTES = {'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'while',
             'conditional', 'call', 'after-all', 'add-dependency', 'partition-id', 'replica-id',
             'opt-barrier', 'async-start', 'async-update', 'async-done', 'domain'}
_SLICING = {'dynamic-slice', 'slice', 'gather'}


def _arrays(type_text: str) -> list:
  """[(dtype, dims)] of the arrays in an HLO type (a tuple lists several)."""
  return [(d, tuple(int(s) for s in dims.split(',') if s)) for d, dims in _ARRAY.findall(
      type_text.split('{', 1)[0] if not type_text.startswith('(') else type_text)]


def _nbytes(dtype: str, dims: tuple) -> int:
  return BYTES.get(dtype, 1) * int(math.prod(dims))


def _type_bytes(type_text: str) -> int:
  return sum(_nbytes(d, s) for d, s in _arrays(type_text))


@dataclasses.dataclass
class HloStats:
  matmul_flops: float = 0.0  # dots, convolutions and kernel calls, loop bodies x trip counts
  kernel_flops: float = 0.0  # the kernel calls' part of matmul_flops (kernels.py)
  hbm_bytes: float = 0.0  # bytes read and written by the executed ops, x trip counts
  hbm_bytes_once: float = 0.0  # the same with every computation once (as cost_analysis)
  collectives: dict = dataclasses.field(default_factory=dict)  # op -> {count, bytes, ici_bytes}
  unknown_trip_counts: int = 0  # while loops whose trip count could not be read (counted once)
  kernel_calls: float = 0.0  # executions of compiled kernels (Mosaic, Triton, cuDNN)
  kernels: dict = dataclasses.field(default_factory=dict)  # kind -> {calls, flops, hbm_bytes,
  # by_name: {name: calls}, causal_assumed: calls whose kept blocks were not read}


def _open(text: str) -> bool:
  """Whether an instruction's text continues on the next line: a string or a bracket of
  it is still open."""
  if '"' not in text and text.count('{') == text.count('}') and (
      text.count('(') == text.count(')')):
    return False
  bare = _STRING.sub('', text)
  if '"' in bare:
    return True
  return (bare.count('{') - bare.count('}') > 0 or bare.count('(') - bare.count(')') > 0
          or bare.count('[') - bare.count(']') > 0)


def read_computations(text: str) -> tuple:
  """({computation: [(name, type, op, rest, is_root)]}, [names in order], entry name)."""
  comps, order, entry, cur, pending = {}, [], None, None, None

  def add(instr: str):
    mi = _INSTR.match(instr)
    if mi:
      root, name, typ, op, rest = mi.groups()
      comps[cur].append((name, typ, op, rest, bool(root)))

  for line in text.splitlines():
    if pending is not None:
      pending += ' ' + line
      if not _open(pending):
        add(pending)
        pending = None
      continue
    if cur is None:
      m = _COMP.match(line)
      if m:
        cur = m.group(2)
        comps[cur] = []
        order.append(cur)
        if m.group(1):
          entry = cur
      continue
    if line.startswith('}'):
      cur = None
      continue
    if _open(line):
      pending = line
      continue
    add(line)
  return comps, order, entry


def _group_size(rest: str, num_devices: int) -> int:
  """Devices in one replica group of a collective (the HLO spells groups three ways)."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*?\{([^}]*)\}", rest)
  if m:  # mesh['axis_0'=16,'axis_1'=2] {'axis_0'}: the named axes' sizes multiplied
    sizes = {a: int(n) for a, n in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
    return math.prod(sizes.get(a, 1) for a in re.findall(r"'(\w+)'", m.group(2)))
  m = re.search(r'replica_groups=\[(\d+),(\d+)\]', rest)
  if m:  # iota groups [G, N]<=[...]
    return int(m.group(2))
  m = re.search(r'replica_groups=\{\{([\d,]*)\}', rest)
  if m:  # explicit {{0,1,..},..}
    return len([s for s in m.group(1).split(',') if s])
  m = re.search(r'source_target_pairs=', rest)
  return 2 if m else num_devices



def analyze_hlo(text: str, num_devices: int) -> HloStats:
  """FLOPs, HBM bytes, collectives and kernel calls of a compiled (per-device) HLO module."""
  comps, order, entry = read_computations(text)
  root = entry or (order[-1] if order else '')
  shapes = {name: typ for body in comps.values() for name, typ, *_ in body}
  consts = {}
  for body in comps.values():
    for name, typ, op, rest, _ in body:
      if op == 'constant' and typ[:1] in 'su' and '...' not in rest:
        consts[name] = [int(v) for v in re.findall(r'-?\d+', rest.split(')', 1)[0])]
  for _ in range(3):  # a constant reaches a kernel through copies into another memory
    for body in comps.values():
      for name, _, op, rest, _ in body:
        if op in ('copy', 'copy-start', 'copy-done', 'bitcast') and name not in consts:
          source = _operands(rest)
          if source and source[0] in consts:
            consts[name] = consts[source[0]]

  def trip_count(cond: str) -> int | None:
    found = [int(m.group(1)) for _, typ, op, rest, _ in comps.get(cond, ())
             if op == 'constant' and typ.startswith('s32[]')
             for m in [re.match(r'(-?\d+)\)', rest)] if m]
    return found[0] if len(found) == 1 and found[0] > 0 else None

  calls = collections.defaultdict(list)  # computation -> [(callee, factor)]
  control = collections.defaultdict(list)  # the same, through control flow only (no fusion
  # bodies or reducers): the computations whose ops move bytes themselves
  stats = HloStats()
  for name, body in comps.items():
    for _, _, op, rest, _ in body:
      if op == 'while':
        cond = re.search(r'condition=%([\w.\-]+)', rest)
        loop = re.search(r'body=%([\w.\-]+)', rest)
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)  # the GPU compiler's
        n = int(known.group(1)) if known else (trip_count(cond.group(1)) if cond else None)
        if n is None:
          stats.unknown_trip_counts += 1
        for target in (cond, loop):
          if target:
            calls[name].append((target.group(1), n or 1))
            control[name].append((target.group(1), n or 1))
        continue
      flow = op in ('call', 'conditional', 'async-start')
      for _, callee in _CALLS.findall(rest):
        calls[name].append((callee, 1))
        if flow:
          control[name].append((callee, 1))
      for group in _BRANCHES.findall(rest):
        for callee in re.findall(r'%([\w.\-]+)', group):
          calls[name].append((callee, 1))
          control[name].append((callee, 1))
  mult = _multiplicities(calls, root)
  runs = _multiplicities(control, root)
  fused = {}  # fusion body -> ([bytes read per parameter or None], bytes written or None)

  for name, body in comps.items():
    k = mult.get(name, 0.0)
    if not k:
      continue
    k_bytes = runs.get(name, 0.0)
    for _, typ, op, rest, _ in body:
      moved = 0.0
      if k_bytes and op not in _NO_BYTES and not op.endswith('-done'):
        moved = _op_bytes(op, typ, rest, shapes, comps, fused)
      if op in ('convolution', 'dot'):
        stats.matmul_flops += k * _matmul_flops(op, typ, rest, shapes)
      elif op == 'custom-call' and ('$gemm' in rest or '$matmul' in rest):  # cuBLAS on GPU
        stats.matmul_flops += k * _gemm_flops(typ, rest, shapes)
      elif op == 'custom-call' and ('tpu_custom_call' in rest or '__cudnn$fmha' in rest
                                    or 'triton' in (_TARGET.search(rest) or [''])[0]):
        call = _kernel(typ, rest, shapes, consts)
        stats.kernel_calls += k
        stats.matmul_flops += k * call.flops
        stats.kernel_flops += k * call.flops
        kind = stats.kernels.setdefault(call.kind, {'calls': 0.0, 'flops': 0.0, 'hbm_bytes': 0.0,
                                                    'by_name': {}, 'causal_assumed': 0.0})
        kind['calls'] += k
        kind['flops'] += k * call.flops
        kind['hbm_bytes'] += k * call.hbm_bytes
        kind['by_name'][call.name] = kind['by_name'].get(call.name, 0.0) + k
        kind['causal_assumed'] += k if call.causal_assumed else 0.0
        if k_bytes:
          moved = call.hbm_bytes
      if k_bytes:
        stats.hbm_bytes += k_bytes * moved
        stats.hbm_bytes_once += moved
      base = op[:-len('-start')] if op.endswith('-start') else op
      if base not in COLLECTIVES or op.endswith('-done'):
        continue
      arrays = _arrays(typ)
      if not arrays:
        continue
      size = max(_nbytes(d, s) for d, s in arrays)  # a -start tuple holds (operand, result)
      n = max(_group_size(rest, num_devices), 1)
      frac = (n - 1) / n
      ici = {'all-gather': size * frac, 'reduce-scatter': size * (n - 1),
             'all-reduce': 2 * size * frac, 'all-to-all': size * frac,
             'ragged-all-to-all': size * frac, 'collective-permute': size}[base]
      entry_stats = stats.collectives.setdefault(base, {'count': 0.0, 'bytes': 0.0,
                                                        'ici_bytes': 0.0, 'by_group': {}})
      entry_stats['count'] += k
      entry_stats['bytes'] += k * size
      entry_stats['ici_bytes'] += k * ici
      group = entry_stats['by_group'].setdefault(str(n), {'count': 0.0, 'bytes': 0.0})
      group['count'] += k
      group['bytes'] += k * size
  return stats


def _multiplicities(calls: dict, root: str) -> dict:
  """Runs of each computation per run of `root` through the call edges (callee, factor)."""
  mult = collections.defaultdict(float)
  mult[root] = 1.0
  # callers precede callees in a topological order; HLO text prints callees first
  for name in _topological(calls, root):
    for callee, factor in calls.get(name, ()):
      mult[callee] += mult[name] * factor
  return mult


def _kernel(typ: str, rest: str, shapes: dict, consts: dict) -> kernels_lib.KernelCall:
  target = _TARGET.search(rest)
  operands = [(o, _arrays(shapes.get(o, ''))) for o in _operands(rest)]
  return kernels_lib.kernel_call(target.group(1) if target else '', rest, _arrays(typ),
                                 operands, consts)


def _op_bytes(op: str, typ: str, rest: str, shapes: dict, comps: dict, fused: dict) -> float:
  """HBM bytes one execution of a top-level op reads and writes."""
  out = _type_bytes(typ)
  ops = _operands(rest)
  if op in _SLICING:
    return 2.0 * out + sum(_type_bytes(shapes.get(o, '')) for o in ops[1:] if op == 'gather')
  if op in ('dynamic-update-slice', 'scatter'):
    update = _type_bytes(shapes.get(ops[-1] if op == 'scatter' else ops[1], '')) if (
        len(ops) > 1) else out
    return 2.0 * update
  if op.endswith('-start'):  # (operand, result, ...) tuples: each array once
    arrays = _arrays(typ)
    return float(sum(_nbytes(d, s) for d, s in arrays[:2])) if arrays else 0.0
  if op == 'fusion':
    callee = re.search(r'calls=%([\w.\-]+)', rest)
    if callee and callee.group(1) in comps:
      if callee.group(1) not in fused:
        fused[callee.group(1)] = _fusion_use(comps[callee.group(1)], shapes)
      reads, written = fused[callee.group(1)]
      total = 0.0
      for i, o in enumerate(ops):
        full = _type_bytes(shapes.get(o, ''))
        total += full if i >= len(reads) or reads[i] is None else min(full, reads[i])
      return total + (out if written is None else written)
  return float(out + sum(_type_bytes(shapes.get(o, '')) for o in ops))


def _fusion_use(body: list, shapes: dict) -> tuple:
  """Per parameter of a fusion body, the bytes it reads (None: all of it), and the bytes
  the body writes (None: its whole result)."""
  users = collections.defaultdict(list)
  params, root = {}, None
  for name, typ, op, rest, is_root in body:
    if op == 'parameter':
      m = re.match(r'(\d+)\)', rest)
      if m:
        params[int(m.group(1))] = name
    for i, o in enumerate(_operands(rest) if op != 'parameter' else ()):
      users[o].append((name, typ, op, i, rest))
    if is_root:
      root = (name, typ, op, rest)

  def read(name: str, depth: int = 0):
    total = 0.0
    for user, typ, op, i, _ in users.get(name, ()):
      if op == 'bitcast' and depth < 8:
        part = read(user, depth + 1)
        if part is None:
          return None
        total += part
      elif op in _SLICING and i == 0:
        total += _type_bytes(typ)
      elif op == 'dynamic-update-slice' and i == 0:
        continue  # the buffer updated in place: only the update moves
      else:
        return None
    return total

  reads = [read(params[i]) if i in params else None for i in range(max(params, default=-1) + 1)]
  written = None
  if root is not None:
    elements = ([root] if root[2] != 'tuple' else
                [next(((n, t, o, r) for n, t, o, r, _ in body if n == e), None)
                 for e in _operands(root[3])])
    if all(e is not None for e in elements) and any(e[2] == 'dynamic-update-slice'
                                                   for e in elements):
      written = 0.0
      for _, t, o, r in elements:
        if o == 'dynamic-update-slice':
          update = _operands(r)[1]
          written += _type_bytes(next((tt for nn, tt, *_ in body if nn == update), ''))
        else:
          written += _type_bytes(t)
  return reads, written


def _topological(calls: dict, root: str) -> list:
  seen, out = set(), []

  def visit(n):
    if n in seen:
      return
    seen.add(n)
    for callee, _ in calls.get(n, ()):
      visit(callee)
    out.append(n)

  limit = sys.getrecursionlimit()
  sys.setrecursionlimit(max(limit, 100000))
  try:
    visit(root)
  finally:
    sys.setrecursionlimit(limit)
  return out[::-1]


def _operands(rest: str) -> list:
  depth, cur, out = 0, '', []
  for ch in rest:
    if ch == '(':
      depth += 1
    elif ch == ')':
      if depth == 0:
        out.append(cur)
        break
      depth -= 1
    elif ch == ',' and depth == 0:
      out.append(cur)
      cur = ''
      continue
    cur += ch
  return [re.sub(r'^.*%', '', o.strip()) for o in out]


def _matmul_flops(op: str, typ: str, rest: str, shapes: dict) -> float:
  out = _arrays(typ)
  if not out:
    return 0.0
  out_elems = math.prod(out[0][1])
  ops = _operands(rest)
  if op == 'dot':
    lhs = _arrays(shapes.get(ops[0], '')) if ops else []
    m = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', rest)
    if not lhs or not m:
      return 0.0
    dims = lhs[0][1]
    contract = math.prod(dims[int(i)] for i in m.group(1).split(',') if i)
    return 2.0 * out_elems * contract
  # convolution (XLA:TPU writes batched dots as convolutions whose window, padding and
  # dilation encode the batch): per output element, the kernel taps that land on a real
  # input element, times the input features of a group.
  lhs = _arrays(shapes.get(ops[0], '')) if ops else []
  rhs = _arrays(shapes.get(ops[1], '')) if len(ops) > 1 else []
  m = re.search(r'dim_labels=(\w+)_(\w+)->(\w+)', rest)
  if not lhs or not rhs or not m:
    return 0.0
  lhs_l, rhs_l, out_l = m.groups()
  lhs_d, rhs_d, out_d = lhs[0][1], rhs[0][1], out[0][1]
  window = _window(rest)
  taps = 1
  for s in sorted(ch for ch in rhs_l if ch.isdigit()):
    i = int(s)
    size = rhs_d[rhs_l.index(s)]
    w = window[i] if i < len(window) else {}
    taps *= _valid_taps(out_d[out_l.index(s)], lhs_d[lhs_l.index(s)], size, w)
  return 2.0 * out_d[out_l.index('b')] * out_d[out_l.index('f')] * rhs_d[rhs_l.index('i')] * taps


def _gemm_flops(typ: str, rest: str, shapes: dict) -> float:
  """A cuBLAS gemm custom call: 2 x output elements x the lhs contracting sizes."""
  out = _arrays(typ)
  ops = _operands(rest)
  lhs = _arrays(shapes.get(ops[0], '')) if ops else []
  m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
  if not out or not lhs or not m:
    return 0.0
  dims = lhs[0][1]
  contract = math.prod(dims[int(i.strip().strip('"'))] for i in m.group(1).split(',')
                       if i.strip())
  return 2.0 * math.prod(out[0][1]) * contract


def _window(rest: str) -> list:
  """Per spatial dimension {size, stride, pad, lhs_dilate, rhs_dilate} of a window={...}."""
  m = re.search(r'window=\{([^}]*)\}', rest)
  if not m:
    return []
  fields = dict(f.split('=', 1) for f in m.group(1).split() if '=' in f)
  n = len(fields.get('size', '').split('x')) if 'size' in fields else 0
  out = [{} for _ in range(n)]
  for key in ('size', 'stride', 'lhs_dilate', 'rhs_dilate'):
    if key in fields:
      for d, v in zip(out, fields[key].split('x')):
        d[key] = int(v)
  if 'pad' in fields:
    for d, v in zip(out, fields['pad'].split('x')):
      lo, _ = v.split('_')
      d['pad'] = int(lo)
  return out


def _valid_taps(out_size: int, in_size: int, win: int, w: dict) -> int:
  """(output position, kernel tap) pairs of one spatial dimension that read a real input."""
  stride, pad = w.get('stride', 1), w.get('pad', 0)
  ld, rd = w.get('lhs_dilate', 1), w.get('rhs_dilate', 1)
  span = (in_size - 1) * ld + 1
  count = 0
  for o in range(out_size):
    base = o * stride - pad
    if ld == 1 and rd == 1:  # taps k with 0 <= base + k < span
      count += max(0, min(win, span - base) - max(0, -base))
      continue
    count += sum(1 for k in range(win) if 0 <= base + k * rd < span and (base + k * rd) % ld == 0)
  return count




_LAYOUT = re.compile(r'\[[\d,]*\]\{([\d,]*)')


def cpu_dot_forms(text: str) -> dict:
  """Matmul FLOPs of a compiled XLA:CPU program by the form of each dot: {form: FLOPs}.

  'bf16 kernels': bf16 x bf16 -> f32 with the left operand contracted on its minor-most
  (row-major, non-transposed) axis, the one form XLA:CPU runs on its bf16 matrix kernels;
  any other dot is keyed '<lhs> x <rhs> -> <out>' plus ' (lhs transposed)' where that
  holds. Each dot counts once (a loop body once, not per trip).
  """
  comps, _, _ = read_computations(text)
  out = collections.Counter()
  for body in comps.values():
    shapes = {name: typ for name, typ, *_ in body}
    for _, typ, op, rest, _ in body:
      if op != 'dot':
        continue
      flops = _matmul_flops(op, typ, rest, shapes)
      ops = _operands(rest)
      lhs_t, rhs_t = (shapes.get(o, '') for o in ops[:2])
      (lt, ld), (rt, _), (ot, _) = _arrays(lhs_t)[0], _arrays(rhs_t)[0], _arrays(typ)[0]
      contract = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', rest).group(1)
      layout = _LAYOUT.search(lhs_t)
      minor = int(layout.group(1).split(',')[0]) if layout and layout.group(1) else len(ld) - 1
      row_major = contract == str(minor)
      if (lt, rt, ot) == ('bf16', 'bf16', 'f32') and row_major:
        out['bf16 kernels'] += flops
      else:
        out[f'{lt} x {rt} -> {ot}' + ('' if row_major else ' (lhs transposed)')] += flops
  return dict(out)
