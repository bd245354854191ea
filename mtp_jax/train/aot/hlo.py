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
from mtp_jax.train.aot.hlo_read import (
  arrays,
  gemm_flops,
  matmul_flops,
  nbytes,
  operands,
  read_computations,
  type_bytes,
)

BYTES = kernels_lib.BYTES
COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'ragged-all-to-all',
               'collective-permute')
_CALLS = re.compile(r'\b(calls|to_apply|body|condition|true_computation|false_computation)='
                    r'%([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# ops that move no bytes of their own (views, tuples, control flow whose bodies are counted)
_NO_BYTES = {'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'while',
             'conditional', 'call', 'after-all', 'add-dependency', 'partition-id', 'replica-id',
             'opt-barrier', 'async-start', 'async-update', 'async-done', 'domain'}
_SLICING = {'dynamic-slice', 'slice', 'gather'}
# TPU custom calls that only name a buffer or state a fact about indices: no bytes move
_NO_BYTES_TARGETS = {'AllocateBuffer', 'AssumeGatherIndicesInBound'}
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
# the GPU compiler's per-op estimate, where it fills one in (its reification_cost)
_GPU_TIME = re.compile(r'"exec_time_us":"?([\d.eE+\-]+)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MATMUL_OPS = ('convolution', 'dot')
# what a fusion around a collective holds besides it (no work of its own)
_COLLECTIVE_WRAPPING = {'parameter', 'constant', 'bitcast', 'tuple', 'get-tuple-element',
                        'custom-call', 'dynamic-slice', 'partition-id', 'multiply', 'add',
                        'convert', 'copy', 'reshape'}


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
  executed: dict = dataclasses.field(default_factory=dict)  # computation -> [ExecutedOp] in
  # the order the compiled (scheduled) module runs them: the computations run as code (the
  # entry, loop bodies and conditions, called computations), not fusion bodies
  entry: str = ''  # the computation a run of the module starts in
  conditionals: int = 0  # conditionals (FLOPs and bytes count every branch; the priced
  # step its costliest)


@dataclasses.dataclass
class ExecutedOp:
  """One instruction of a computation that runs as code, per execution."""
  name: str
  op: str  # the HLO opcode (fusion, copy, all-gather, custom-call, ...)
  kind: str  # what it does: 'convolution fusion', 'loop fusion', 'reduce-scatter', a kernel's
  # kind (splash_attention), ...
  runs: float  # executions per run of the module
  cycles: int | None  # the TPU compiler's estimated_cycles for one execution, where it prints one
  flops: float  # matmul FLOPs of one execution (dots, convolutions, kernel calls)
  hbm_bytes: float  # HBM bytes one execution reads and writes
  ici_bytes: float = 0.0  # bytes one execution moves over ICI (collectives)
  done: str | None = None  # an asynchronous start: the instruction that waits for it
  source: str = ''  # the JAX operation it came from (its op_name metadata)
  compiler_s: float | None = None  # the GPU compiler's estimate of one execution, in
  # seconds, where its backend config fills one in (reification_cost.exec_time_us)
  calls: tuple = ()  # the computations one execution runs as code: ((callee, times), ...)
  # (a while loop its condition and body, a call its callee, a conditional its branches)


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


def analyze_hlo(text: str, num_devices: int, grouped_rows: int = 0) -> HloStats:
  """FLOPs, HBM bytes, collectives and kernel calls of a compiled (per-device) HLO module.

  grouped_rows: the rows a grouped-matmul call computes on average where its buffer is
  larger (kernels.kernel_call), 0 when unknown."""
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
          source = operands(rest)
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
  runs_code = {}  # instruction -> the computations it runs as code, [(callee, times)]
  for name, body in comps.items():
    for iname, _, op, rest, _ in body:
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
            runs_code.setdefault(iname, []).append((target.group(1), n or 1))
        continue
      flow = op in ('call', 'conditional')  # an async-start's callee is priced as the start
      for _, callee in _CALLS.findall(rest):
        calls[name].append((callee, 1))
        if flow:
          control[name].append((callee, 1))
          runs_code.setdefault(iname, []).append((callee, 1))
      for group in _BRANCHES.findall(rest):
        for callee in re.findall(r'%([\w.\-]+)', group):
          calls[name].append((callee, 1))
          control[name].append((callee, 1))
          runs_code.setdefault(iname, []).append((callee, 1))
  stats.entry = root
  mult = _multiplicities(calls, root)
  runs = _multiplicities(control, root)
  fused = {}  # fusion body -> ([bytes read per parameter or None], bytes written or None)
  collective_of = {}  # fusion body -> _FusedCollective or None

  for name, body in comps.items():
    k = mult.get(name, 0.0)
    if not k:
      continue
    k_bytes = runs.get(name, 0.0)
    executed = stats.executed.setdefault(name, []) if k_bytes else None
    done_of = {}
    if k_bytes:
      # an asynchronous collective fusion's start waits for the done of its channel
      started_on = {}
      for iname, _, op, rest, _ in body:
        if op.endswith('-done'):
          started = operands(rest)
          if started:
            done_of[started[0]] = iname
        fc = _fused_collective(op, rest, comps, collective_of)
        if fc and fc.channel and fc.role == 'start':
          started_on[fc.channel] = iname
        elif fc and fc.channel in started_on and fc.role == 'done':
          done_of[started_on.pop(fc.channel)] = iname
    channels = set()  # collectives counted in this computation, by channel id
    for iname, typ, op, rest, _ in body:
      moved, flops, kind = 0.0, 0.0, op
      target = (_TARGET.search(rest) or [None, ''])[1] if op == 'custom-call' else ''
      if op == 'custom-call':
        kind = f'custom-call {target}'
      fc = _fused_collective(op, rest, comps, collective_of)
      if (k_bytes and op not in _NO_BYTES and not op.endswith('-done')
          and target not in _NO_BYTES_TARGETS and not (fc and fc.role == 'done')):
        moved = _op_bytes(op, typ, rest, shapes, comps, fused)
      if op in ('convolution', 'dot'):
        flops = matmul_flops(op, typ, rest, shapes)
      elif op == 'custom-call' and ('$gemm' in rest or '$matmul' in rest):  # cuBLAS on GPU
        flops, kind = gemm_flops(typ, rest, shapes), 'gemm'
      elif op == 'custom-call' and ('tpu_custom_call' in rest or '__cudnn$fmha' in rest
                                    or 'triton' in target):
        call = _kernel(typ, rest, shapes, consts, grouped_rows)
        stats.kernel_calls += k
        stats.kernel_flops += k * call.flops
        flops, kind = call.flops, call.kind
        entry_k = stats.kernels.setdefault(call.kind, {'calls': 0.0, 'flops': 0.0,
                                                       'hbm_bytes': 0.0, 'by_name': {},
                                                       'causal_assumed': 0.0})
        entry_k['calls'] += k
        entry_k['flops'] += k * call.flops
        entry_k['hbm_bytes'] += k * call.hbm_bytes
        entry_k['by_name'][call.name] = entry_k['by_name'].get(call.name, 0.0) + k
        entry_k['causal_assumed'] += k if call.causal_assumed else 0.0
        if k_bytes:
          moved = call.hbm_bytes
      stats.matmul_flops += k * flops
      if not k_bytes:  # inside a fusion: its bytes, collectives and cost are the fusion's
        continue
      stats.hbm_bytes += k_bytes * moved
      stats.hbm_bytes_once += moved
      if op == 'conditional':
        stats.conditionals += 1
      coll = _collective(op, typ, rest, shapes, fc, num_devices)
      if fc and fc.channel:  # one collective, however many fusions carry a step of it
        coll = None if fc.channel in channels else coll
        channels.add(fc.channel)
      ici = 0.0
      if fc and fc.role != 'start':  # a matmul carrying a collective's steps, or its done
        kind = f'{fc.kind} done' if fc.role == 'done' else _fusion_kind(rest, comps)
      if coll:
        base, full, n, ici = coll
        kind = kind if fc and fc.role == 'step' else base
        entry_c = stats.collectives.setdefault(base, {'count': 0.0, 'bytes': 0.0,
                                                      'ici_bytes': 0.0, 'by_group': {}})
        entry_c['count'] += k_bytes
        entry_c['bytes'] += k_bytes * full
        entry_c['ici_bytes'] += k_bytes * ici
        group = entry_c['by_group'].setdefault(str(n), {'count': 0.0, 'bytes': 0.0})
        group['count'] += k_bytes
        group['bytes'] += k_bytes * full
      elif op == 'fusion' and not fc:
        kind = _fusion_kind(rest, comps)
      cycles = _CYCLES.search(rest)
      source = _OP_NAME.search(rest)
      gpu_time = _GPU_TIME.search(rest)
      executed.append(ExecutedOp(iname, op, kind, k_bytes,
                                 int(cycles.group(1)) if cycles else None, flops, moved, ici,
                                 done_of.get(iname),
                                 source.group(1) if source else '',
                                 float(gpu_time.group(1)) * 1e-6 if gpu_time else None,
                                 tuple(runs_code.get(iname, ()))))
  return stats


def _body_ops(comps: dict, callee: str, depth: int = 0) -> list:
  """(op, type, rest) of a fusion body and the bodies of the fusions nested in it."""
  out = []
  for _, typ, op, rest, _ in comps.get(callee, ()):
    out.append((op, typ, rest))
    inner = re.search(r'calls=%([\w.\-]+)', rest) if op == 'fusion' else None
    if inner and depth < 8:
      out += _body_ops(comps, inner.group(1), depth + 1)
  return out


def _fusion_kind(rest: str, comps: dict) -> str:
  """A fusion by the work in its body: a matmul, a reduction, a gather, ... or elementwise."""
  callee = re.search(r'calls=%([\w.\-]+)', rest)
  ops = {op for op, _, _ in _body_ops(comps, callee.group(1))} if callee else set()
  for names, kind in ((_MATMUL_OPS, 'convolution fusion'), (('reduce', 'reduce-window'),
                                                            'reduce fusion'),
                      (('gather',), 'gather fusion'), (('scatter',), 'scatter fusion'),
                      (('dynamic-update-slice',), 'update-slice fusion')):
    if ops.intersection(names):
      return kind
  return 'loop fusion'


@dataclasses.dataclass
class _FusedCollective:
  """The collective a fusion (or async wrapper) runs, and the fusion's part in it.

  With the TPU's asynchronous collective fusion flags one collective is a chain of fusions
  sharing its channel id: a start (the body's root an AsyncCollectiveStart call), matmul
  fusions that carry its steps beside their own work, and a done (AsyncCollectiveDone).
  The TPU compiler also writes a reduce-scatter as a fusion of an all-reduce and the slice
  each chip keeps."""
  kind: str  # all-gather, reduce-scatter, all-reduce, ...
  typ: str  # the collective instruction's own result type
  rest: str  # ... and the rest of its text (operands, replica groups)
  channel: str  # its channel id ('' where it has none)
  role: str  # 'start', 'done', 'step' (a fusion doing other work too) or 'whole'


def _fused_collective(op: str, rest: str, comps: dict, cache: dict):
  """The _FusedCollective of a fusion or async op whose body runs a collective, else None."""
  if op not in ('fusion', 'async-start'):
    return None
  callee = re.search(r'calls=%([\w.\-]+)', rest)
  if not callee:
    return None
  name = callee.group(1)
  if name not in cache:
    body = _body_ops(comps, name)
    unstarted = lambda o: o[:-len('-start')] if o.endswith('-start') else o  # noqa: E731
    found = next(((unstarted(o), t, r) for o, t, r in body if unstarted(o) in COLLECTIVES),
                 None)
    if found is None:
      cache[name] = None
      return None
    kind, typ, inner = found
    root = next(((o, r) for _, _, o, r, is_root in comps[name] if is_root), ('', ''))
    target = (_TARGET.search(root[1]) or [None, ''])[1] if root[0] == 'custom-call' else ''
    if kind == 'all-reduce' and (root[0] == 'dynamic-slice' or 'scatter' in name.lower()):
      kind = 'reduce-scatter'
    work = {o for o, _, _ in body} - _COLLECTIVE_WRAPPING - set(COLLECTIVES)
    role = ('start' if target == 'AsyncCollectiveStart' else
            'done' if target == 'AsyncCollectiveDone' else
            'step' if work.intersection(_MATMUL_OPS + ('reduce',)) else 'whole')
    channel = re.search(r'channel_id=(\d+)', inner)
    cache[name] = _FusedCollective(kind, typ, inner, channel.group(1) if channel else '', role)
  return cache[name]


def _collective(op: str, typ: str, rest: str, shapes: dict, fc, num_devices: int):
  """(kind, bytes of the whole array, devices in a group, ICI bytes per chip) of a collective
  op or of the collective a fusion runs (fc: _fused_collective's), else None.

  The array's bytes are the larger of what goes in and what comes out (an all-gather's
  result, a reduce-scatter's operand), summed over the arrays a combined collective moves,
  read from the collective instruction itself (a fusion's operands and results also hold
  its other work's); a ragged all-to-all's are its output buffer's."""
  base = op[:-len('-start')] if op.endswith('-start') else op
  if fc is not None:
    base, typ, rest = fc.kind, fc.typ, fc.rest
  elif base not in COLLECTIVES or op.endswith('-done'):
    return None
  if base == 'ragged-all-to-all':  # (input, output buffer, offsets and sizes)
    full = float(max((nbytes(d, s) for d, s in arrays(typ)), default=0))
  else:
    result = float(type_bytes(typ))
    operand = float(sum(type_bytes(shapes.get(o, '')) for o in operands(rest)))
    if op.endswith('-start') and fc is None:  # (operands, results, context): the results
      result = max(0.0, result - operand)
    full = max(result, operand)
  n = max(_group_size(rest, num_devices), 1)
  frac = (n - 1) / n
  ici = {'all-gather': full * frac, 'reduce-scatter': full * frac, 'all-reduce': 2 * full * frac,
         'all-to-all': full * frac, 'ragged-all-to-all': full * frac,
         'collective-permute': full}[base]
  return base, full, n, ici


def _multiplicities(calls: dict, root: str) -> dict:
  """Runs of each computation per run of `root` through the call edges (callee, factor)."""
  mult = collections.defaultdict(float)
  mult[root] = 1.0
  # callers precede callees in a topological order; HLO text prints callees first
  for name in _topological(calls, root):
    for callee, factor in calls.get(name, ()):
      mult[callee] += mult[name] * factor
  return mult


def _kernel(typ: str, rest: str, shapes: dict, consts: dict,
            grouped_rows: int = 0) -> kernels_lib.KernelCall:
  target = _TARGET.search(rest)
  inputs = [(o, arrays(shapes.get(o, ''))) for o in operands(rest)]
  return kernels_lib.kernel_call(target.group(1) if target else '', rest, arrays(typ),
                                 inputs, consts, grouped_rows)


def _op_bytes(op: str, typ: str, rest: str, shapes: dict, comps: dict, fused: dict) -> float:
  """HBM bytes one execution of a top-level op reads and writes."""
  out = type_bytes(typ)
  ops = operands(rest)
  if op in _SLICING:
    return 2.0 * out + sum(type_bytes(shapes.get(o, '')) for o in ops[1:] if op == 'gather')
  if op in ('dynamic-update-slice', 'scatter'):
    update = type_bytes(shapes.get(ops[-1] if op == 'scatter' else ops[1], '')) if (
        len(ops) > 1) else out
    return 2.0 * update
  if op.endswith('-start'):  # (operand, result, ...) tuples: each array once
    parts = arrays(typ)
    return float(sum(nbytes(d, s) for d, s in parts[:2])) if parts else 0.0
  if op == 'fusion':
    callee = re.search(r'calls=%([\w.\-]+)', rest)
    if callee and callee.group(1) in comps:
      reads, written = _fusion_use_of(callee.group(1), comps, shapes, fused)
      total = 0.0
      for i, o in enumerate(ops):
        full = type_bytes(shapes.get(o, ''))
        total += full if i >= len(reads) or reads[i] is None else min(full, reads[i])
      return total + (out if written is None else written)
  return float(out + sum(type_bytes(shapes.get(o, '')) for o in ops))


def _fusion_use_of(callee: str, comps: dict, shapes: dict, fused: dict, depth: int = 0):
  if callee not in fused:
    fused[callee] = _fusion_use(comps[callee], shapes, comps, fused, depth)
  return fused[callee]


def _fusion_use(body: list, shapes: dict, comps: dict, fused: dict, depth: int = 0) -> tuple:
  """Per parameter of a fusion body, the bytes it reads (None: all of it), and the bytes
  the body writes (None: its whole result). A parameter handed to a nested fusion reads
  what that fusion's body reads of it (a slice of a stacked array: the slice)."""
  users = collections.defaultdict(list)
  params, root = {}, None
  for name, typ, op, rest, is_root in body:
    if op == 'parameter':
      m = re.match(r'(\d+)\)', rest)
      if m:
        params[int(m.group(1))] = name
    for i, o in enumerate(operands(rest) if op != 'parameter' else ()):
      users[o].append((name, typ, op, i, rest))
    if is_root:
      root = (name, typ, op, rest)

  def read(name: str, depth: int = 0):
    total = 0.0
    for user, typ, op, i, rest in users.get(name, ()):
      if op == 'bitcast' and depth < 8:
        part = read(user, depth + 1)
        if part is None:
          return None
        total += part
      elif op in _SLICING and i == 0:
        total += type_bytes(typ)
      elif op == 'fusion' and depth < 8:
        inner = re.search(r'calls=%([\w.\-]+)', rest)
        if not inner or inner.group(1) not in comps:
          return None
        part = _fusion_use_of(inner.group(1), comps, shapes, fused, depth + 1)[0]
        if i >= len(part) or part[i] is None:
          return None
        total += part[i]
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
                 for e in operands(root[3])])
    if all(e is not None for e in elements) and any(e[2] == 'dynamic-update-slice'
                                                   for e in elements):
      written = 0.0
      for _, t, o, r in elements:
        if o == 'dynamic-update-slice':
          update = operands(r)[1]
          written += type_bytes(next((tt for nn, tt, *_ in body if nn == update), ''))
        else:
          written += type_bytes(t)
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

