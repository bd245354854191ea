"""Reading a compiled HLO module's text: its computations and their instructions (an
instruction printed over several lines joined first), array types and their bytes, an
instruction's operands, and the matmul FLOPs of one dot, convolution or cuBLAS gemm call.

XLA:TPU writes batched dots as convolutions whose window, padding and dilation encode the
batch; matmul_flops counts, per output element, the kernel taps that land on a real input
element. cpu_dot_forms sorts an XLA:CPU program's dots by the form its matrix kernels take.
"""
from __future__ import annotations

import collections
import math
import re

import mtp_jax.train.aot.kernels as kernels_lib

BYTES = kernels_lib.BYTES
_COMP = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$')
_INSTR = re.compile(r'^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$')
_ARRAY = re.compile(r'\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8\w*|bf16|f16|f32|f64|c64|'
                    r'c128)\[([\d,]*)\]')
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_LAYOUT = re.compile(r'\[[\d,]*\]\{([\d,]*)')


def arrays(type_text: str) -> list:
  """[(dtype, dims)] of the arrays in an HLO type (a tuple lists several)."""
  return [(d, tuple(int(s) for s in dims.split(',') if s)) for d, dims in _ARRAY.findall(
      type_text.split('{', 1)[0] if not type_text.startswith('(') else type_text)]


def nbytes(dtype: str, dims: tuple) -> int:
  return BYTES.get(dtype, 1) * int(math.prod(dims))


def type_bytes(type_text: str) -> int:
  return sum(nbytes(d, s) for d, s in arrays(type_text))


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


def operands(rest: str) -> list:
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


def matmul_flops(op: str, typ: str, rest: str, shapes: dict) -> float:
  out = arrays(typ)
  if not out:
    return 0.0
  out_elems = math.prod(out[0][1])
  ops = operands(rest)
  if op == 'dot':
    lhs = arrays(shapes.get(ops[0], '')) if ops else []
    m = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', rest)
    if not lhs or not m:
      return 0.0
    dims = lhs[0][1]
    contract = math.prod(dims[int(i)] for i in m.group(1).split(',') if i)
    return 2.0 * out_elems * contract
  # convolution (XLA:TPU writes batched dots as convolutions whose window, padding and
  # dilation encode the batch): per output element, the kernel taps that land on a real
  # input element, times the input features of a group.
  lhs = arrays(shapes.get(ops[0], '')) if ops else []
  rhs = arrays(shapes.get(ops[1], '')) if len(ops) > 1 else []
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


def gemm_flops(typ: str, rest: str, shapes: dict) -> float:
  """A cuBLAS gemm custom call: 2 x output elements x the lhs contracting sizes."""
  out = arrays(typ)
  ops = operands(rest)
  lhs = arrays(shapes.get(ops[0], '')) if ops else []
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
      if op == 'dot':
        out[dot_form(typ, rest, shapes)] += matmul_flops(op, typ, rest, shapes)
  return dict(out)


def dot_form(typ: str, rest: str, shapes: dict) -> str:
  """cpu_dot_forms' key of one dot (its type, its text after the opcode, and the types of
  the names in its computation)."""
  lhs_t, rhs_t = (shapes.get(o, '') for o in operands(rest)[:2])
  (lt, ld), (rt, _), (ot, _) = arrays(lhs_t)[0], arrays(rhs_t)[0], arrays(typ)[0]
  contract = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', rest).group(1)
  layout = _LAYOUT.search(lhs_t)
  minor = int(layout.group(1).split(',')[0]) if layout and layout.group(1) else len(ld) - 1
  row_major = contract == str(minor)
  if (lt, rt, ot) == ('bf16', 'bf16', 'f32') and row_major:
    return 'bf16 kernels'
  return f'{lt} x {rt} -> {ot}' + ('' if row_major else ' (lhs transposed)')
