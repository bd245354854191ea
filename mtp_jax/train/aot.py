"""Ahead-of-time compiles of the real train step, eval step and decode loop for a TPU slice.

With libtpu installed, `jax.experimental.topologies` describes a TPU slice on a machine
that has none: its devices are compile-only, but a program compiled for them is the
program the slice would run, with the slice's memory limits. `compile_report` lowers and
compiles `steps.train_step`, `steps.eval_step` and the decoder's while loop with the
config's mesh and sharding rules and reads, per chip:

  memory    parameter, optimizer and batch bytes (from the shardings), the compiled
            program's argument / output / temporary bytes, their total against the chip's
            HBM; a program that does not fit fails with the shortfall and the largest
            allocations (the TPU compiler's own list).
  FLOPs     matmul FLOPs counted in the compiled HLO, every loop body times its trip count
            (XLA's cost_analysis counts a while body once, so a scanned model reads low),
            beside flops.py's model count.
  traffic   all-gather / reduce-scatter / all-reduce / all-to-all / collective-permute ops
            of the compiled HLO with their executions per step and bytes.
  estimate  a roofline step time: the largest of compute (HLO FLOPs over the chip's peak),
            HBM (cost_analysis bytes over the HBM bandwidth) and ICI (collective bytes over
            the chip's ICI bandwidth) -- a lower bound, not a measurement -- and the MFU it
            implies for flops.py's count.

The model picks some kernels by backend while it is traced (attention core, MoE dispatch,
decode cache layout); here the process runs on CPU, so tracing pretends to be the target
platform for as long as the programs are built (`traced_for`).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import topologies

from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import config_lib
from mtp_jax.data import tokenizers
from mtp_jax.decode import decoder as decoder_lib
from mtp_jax.decode.sampling import Sampling
from mtp_jax.errors import RequestError
from mtp_jax.model import state as state_lib
from mtp_jax.model.mtp import MTPModel, ModelArgs
from mtp_jax.runtime import chips as chips_lib
from mtp_jax.runtime import sharding
from mtp_jax.train import flops as flops_lib
from mtp_jax.train import steps

GIB = 2 ** 30
PROGRAMS = ('train', 'eval', 'decode')
COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all',
               'collective-permute')


class DoesNotFit(Exception):
  """A program needs more HBM per chip than the chip has (exit code 1: a failed check)."""
  exit_code = 1


# -- topologies --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Topology:
  """A Cloud TPU accelerator type (v5p-64) as a chip grid, or a GPU target."""
  name: str  # as given: v5p-64, v5litepod-16, ...
  chip: chips_lib.Chip
  shape: tuple  # chips along each ICI axis
  num_slices: int = 1

  @property
  def chips(self) -> int:
    return math.prod(self.shape) * self.num_slices


def _grid(chips: int, dims: int) -> tuple | None:
  """The standard slice shape of `chips` chips: 2x2(x1) doubled one axis at a time
  (3-D: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ...; 2-D: 2x2, 2x4, 4x4, 4x8, ...)."""
  if chips == 1 and dims == 2:
    return (1, 1)
  shape = [2, 2, 1] if dims == 3 else [2, 2]
  while math.prod(shape) < chips:
    low = min(shape)
    i = max(j for j, s in enumerate(shape) if s == low)
    shape[i] *= 2
  return tuple(shape) if math.prod(shape) == chips else None


def parse_topology(name: str, num_slices: int = 1) -> Topology:
  """v4-N / v5p-N (N TensorCores, 2 per chip), v5e-N / v5litepod-N / v6e-N (N chips);
  h100-N / h200-N: N GPUs of one host (1 to 8)."""
  g = re.fullmatch(r'(h100|h200)-(\d+)', name.strip().lower())
  if g:
    n = int(g.group(2))
    if not 1 <= n <= 8 or num_slices != 1:
      raise RequestError(f'--topology {name!r}: a GPU target is 1 to 8 GPUs of one host '
                         '(and --num_slices 1)')
    return Topology(name, chips_lib.chip(g.group(1)), (n,), 1)
  m = re.fullmatch(r'(v4|v5p|v5e|v5litepod|v6e)-(\d+)', name.strip().lower())
  if not m:
    raise RequestError(f'--topology {name!r}: expected a Cloud TPU accelerator type such as '
                       'v4-8, v5p-64, v5e-16 (v5litepod-16) or v6e-256')
  if not isinstance(num_slices, int) or num_slices < 1:
    raise RequestError(f'--num_slices must be a positive integer, got {num_slices!r}')
  chip = chips_lib.chip(m.group(1))
  n = int(m.group(2))
  dims = 3 if chip.name in ('v4', 'v5p') else 2
  chips = n // chip.cores if n % chip.cores == 0 else 0
  shape = _grid(chips, dims) if chips else None
  if shape is None or (dims == 2 and chips > 256):
    sizes = ('8, 16, 32, 64, 128, ... (TensorCores, 2 per chip)' if dims == 3
             else '1, 4, 8, 16, 32, 64, 128, 256 (chips)')
    raise RequestError(f'--topology {name!r}: {m.group(1)} slices come in sizes {sizes}')
  return Topology(name, chip, shape, num_slices)


def topology_devices(topo: Topology) -> list:
  """The compile-only devices of the slice (libtpu, no TPU needed; for a GPU target the
  CUDA plugin, no GPU needed)."""
  if topo.chip.platform == 'gpu':
    try:
      desc = topologies.get_topology_desc(
          platform='cuda', target_config=chips_lib.gpu_target_config(topo.chip),
          topology=f'1x1x{topo.shape[0]}')
    except Exception as e:  # pylint: disable=broad-except
      raise RequestError(
          f'cannot describe GPU target {topo.name} (the CUDA plugin is needed: pip install '
          f'jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__}): '
          f'{" ".join(str(e).split())[:300]}') from e
    return list(desc.devices)
  # libtpu takes a machine-wide lock file when it loads; compile-only use touches no chip,
  # so several compiling processes (or a TPU job beside this one) may share the machine.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  dims = len(topo.shape)
  shape3 = topo.shape + (1,) * (3 - dims)
  # Wraparound links: 3-D slices whose every side is a multiple of 4; the full 16x16 2-D pod.
  torus = (all(s % 4 == 0 for s in topo.shape) if dims == 3 else topo.shape == (16, 16))
  host = tuple(min(s, b) for s, b in zip(shape3, (2, 2, 1)))
  try:
    desc = topologies.get_topology_desc(
        platform='tpu', topology_name=f'{topo.chip.name}:' + 'x'.join(map(str, topo.shape)),
        chip_config_name='megacore' if topo.chip.cores == 2 else 'default',
        chips_per_host_bounds=host, num_slices=topo.num_slices,
        wrap=(torus,) * 2 + ((torus,) if dims == 3 else (False,)))
  except Exception as e:  # pylint: disable=broad-except
    raise RequestError(f'cannot describe TPU topology {topo.name} (is libtpu installed? '
                       f'pip install libtpu): {" ".join(str(e).split())[:300]}') from e
  return list(desc.devices)


@contextlib.contextmanager
def traced_for(platform: str):
  """Makes jax.default_backend() name `platform` while programs for it are built."""
  real = jax.default_backend
  jax.default_backend = lambda: platform
  try:
    yield
  finally:
    jax.default_backend = real


@contextlib.contextmanager
def _no_jax_cache():
  """JAX's persistent cache off: it writes compile-only executables it cannot read back."""
  was = jax.config.jax_enable_compilation_cache
  jax.config.update('jax_enable_compilation_cache', False)
  try:
    yield
  finally:
    jax.config.update('jax_enable_compilation_cache', was)


# -- per-chip bytes of sharded arrays ----------------------------------------------------
def shard_bytes(x) -> int:
  shape = x.sharding.shard_shape(x.shape) if getattr(x, 'sharding', None) else x.shape
  return int(math.prod(shape)) * jnp.dtype(x.dtype).itemsize


def _path(path) -> str:
  parts = []
  for k in path:
    key = getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k)))
    parts.append(str(key))
  return '.'.join(parts)


def spec_text(sh) -> str:
  spec = getattr(sh, 'spec', None)
  return 'replicated' if spec is None or all(a is None for a in spec) else str(tuple(spec))


# -- the compiled HLO: computations, loop trip counts, matmul FLOPs, collectives ----------
_COMP = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$')
_INSTR = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$')
_ARRAY = re.compile(r'\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8\w*|bf16|f16|f32|f64|c64|'
                    r'c128)\[([\d,]*)\]')
_BYTES = {'pred': 1, 's4': 1, 's8': 1, 's16': 2, 's32': 4, 's64': 8, 'u4': 1, 'u8': 1,
          'u16': 2, 'u32': 4, 'u64': 8, 'bf16': 2, 'f16': 2, 'f32': 4, 'f64': 8, 'c64': 8,
          'c128': 16}
_CALLS = re.compile(r'\b(calls|to_apply|body|condition|true_computation|false_computation)='
                    r'%([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')


def _arrays(type_text: str) -> list:
  """[(dtype, dims)] of the arrays in an HLO type (a tuple lists several)."""
  return [(d, tuple(int(s) for s in dims.split(',') if s)) for d, dims in _ARRAY.findall(
      type_text.split('{', 1)[0] if not type_text.startswith('(') else type_text)]


def _nbytes(dtype: str, dims: tuple) -> int:
  return _BYTES.get(dtype, 1) * int(math.prod(dims))


@dataclasses.dataclass
class HloStats:
  matmul_flops: float = 0.0  # per chip per run, loop bodies times their trip counts
  collectives: dict = dataclasses.field(default_factory=dict)  # op -> {count, bytes, ici_bytes}
  unknown_trip_counts: int = 0  # while loops whose trip count could not be read (counted once)
  kernel_calls: float = 0.0  # executions of compiled kernels (Mosaic, cuDNN) whose FLOPs the
  # HLO does not show: matmul_flops leaves them out


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
  """Matmul FLOPs and collectives of a compiled (per-device) HLO module."""
  comps, order, entry, cur = {}, [], None, None
  for line in text.splitlines():
    m = _COMP.match(line)
    if m:
      cur = m.group(2)
      comps[cur] = []
      order.append(cur)
      if m.group(1):
        entry = cur
      continue
    if cur is None:
      continue
    if line.startswith('}'):
      cur = None
      continue
    mi = _INSTR.match(line)
    if mi:
      comps[cur].append(mi.groups())
  shapes = {name: typ for body in comps.values() for name, typ, _, _ in body}

  def trip_count(cond: str) -> int | None:
    consts = [int(m.group(1)) for _, typ, op, rest in comps.get(cond, ())
              if op == 'constant' and typ.startswith('s32[]')
              for m in [re.match(r'(-?\d+)\)', rest)] if m]
    return consts[0] if len(consts) == 1 and consts[0] > 0 else None

  calls = collections.defaultdict(list)  # computation -> [(callee, factor)]
  stats = HloStats()
  for name, body in comps.items():
    for _, _, op, rest in body:
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
        continue
      for _, callee in _CALLS.findall(rest):
        calls[name].append((callee, 1))
      for group in _BRANCHES.findall(rest):
        for callee in re.findall(r'%([\w.\-]+)', group):
          calls[name].append((callee, 1))
  mult = collections.defaultdict(float)
  mult[entry or (order[-1] if order else '')] = 1.0
  # callers precede callees in a topological order; HLO text prints callees first
  for name in _topological(calls, entry or (order[-1] if order else '')):
    for callee, factor in calls.get(name, ()):
      mult[callee] += mult[name] * factor

  for name, body in comps.items():
    k = mult.get(name, 0.0)
    if not k:
      continue
    for _, typ, op, rest in body:
      if op in ('convolution', 'dot'):
        stats.matmul_flops += k * _matmul_flops(op, typ, rest, shapes)
        continue
      if op == 'custom-call' and ('$gemm' in rest or '$matmul' in rest):  # cuBLAS on GPU
        stats.matmul_flops += k * _gemm_flops(typ, rest, shapes)
        continue
      if op == 'custom-call' and ('tpu_custom_call' in rest or '__cudnn$' in rest):
        stats.kernel_calls += k
        continue
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
             'collective-permute': size}[base]
      entry_stats = stats.collectives.setdefault(base, {'count': 0.0, 'bytes': 0.0,
                                                        'ici_bytes': 0.0, 'by_group': {}})
      entry_stats['count'] += k
      entry_stats['bytes'] += k * size
      entry_stats['ici_bytes'] += k * ici
      group = entry_stats['by_group'].setdefault(str(n), {'count': 0.0, 'bytes': 0.0})
      group['count'] += k
      group['bytes'] += k * size
  return stats


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


# -- the programs ------------------------------------------------------------------------
def _memory(compiled) -> dict:
  ma = compiled.memory_analysis()
  out = {k: int(getattr(ma, f'{k}_size_in_bytes', 0) or 0)
         for k in ('argument', 'output', 'alias', 'temp', 'generated_code')}
  out['total'] = (out['argument'] + out['output'] - out['alias'] + out['temp']
                  + out['generated_code'])
  return out


def _cost(compiled) -> dict:
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else (ca or {})
  return {'flops': float(ca.get('flops', 0.0)),
          'bytes_accessed': float(ca.get('bytes accessed', 0.0))}


_OOM_USED = re.compile(r'Used ([\d.]+[KMGT]?) of ([\d.]+[KMGT]?) hbm', re.I)
_OOM_BY = re.compile(r'Exceeded hbm capacity by ([\d.]+[KMGT]?)', re.I)


_UNITS = {'': 1, 'K': 2 ** 10, 'M': 2 ** 20, 'G': 2 ** 30, 'T': 2 ** 40}


def _gib(text: str) -> float:
  m = re.fullmatch(r'([\d.]+)([KMGT]?)i?B?', text.strip())
  return float(m.group(1)) * _UNITS[m.group(2)] / GIB if m else float('nan')


def _shortfall_line(program: str, topo: Topology, text: str, hint: str = '') -> str:
  """One line from the TPU compiler's out-of-memory error (its two spellings)."""
  need = have = None
  m = re.search(r'required for ([\w ]+?) \(([\d.]+[KMGT]?)\) exceeds available HBM '
                r'\(([\d.]+[KMGT]?)\)', text)
  what = 'memory'
  if m:
    what, need, have = m.group(1), _gib(m.group(2)), _gib(m.group(3))
  m = re.search(r'Used ([\d.]+[KMGT]?) of ([\d.]+[KMGT]?) hbm', text, re.I)
  if m:
    need, have = _gib(m.group(1)), _gib(m.group(2))
  sizes = re.findall(r'Size: ([\d.]+[KMGT]?)', text)
  shapes = re.findall(r'Shape: (\S+)', text)
  largest = ', '.join(f'{_gib(a):.2f} GiB {b.split("{")[0]}' for a, b in zip(sizes[:3], shapes[:3]))
  head = (f'{program} step needs {need:.2f} GiB per chip for {what}, a {topo.chip.name} chip '
          f'has {have:.2f} GiB (short by {need - have:.2f} GiB)' if need is not None
          else f'{program} step does not fit a {topo.chip.name} chip: '
          + ' '.join(text.split())[:200])
  tail = f'; largest allocations: {largest}' if largest else (f'; {hint}' if hint else '')
  return f'does not fit {topo.name}: {head}{tail}'


def _compile(lowered, program: str, topo: Topology, hint: str = ''):
  try:
    return lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    text = str(e)
    if 'RESOURCE_EXHAUSTED' in text or 'Ran out of memory' in text:
      raise DoesNotFit(_shortfall_line(program, topo, text, hint)) from e
    raise


def _target_config(config, platform: str):
  """The config as the target resolves it: vocab from the tokenizer, backend-dependent
  'auto' choices left to the model (traced under traced_for)."""
  config = config.copy_and_resolve_references()
  tokenizers.resolve_vocab_size(config)
  return config


def _batch_structs(config, mesh, batch_size=None):
  with sharding.use_mesh(mesh, sharding.rules_of(config)):
    bsh = sharding.batch_sharding(mesh)
  b, t = batch_size or config.data.batch_size, config.data.seq_len
  batch = {k: jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=bsh)
           for k in ('tokens', 'segment_ids', 'positions')}
  return batch, {k: bsh for k in batch}


def _state_summary(abstract_state, shardings) -> dict:
  params = optimizer = 0
  leaves = []
  for (path, x), sh in zip(jax.tree_util.tree_leaves_with_path(abstract_state),
                           jax.tree.leaves(shardings)):
    name = _path(path)
    nbytes = shard_bytes(x)
    if name.startswith('0.'):
      params += nbytes
      leaves.append((name[2:], tuple(x.shape), str(x.dtype), spec_text(sh), nbytes,
                     int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize))
    else:
      optimizer += nbytes
  leaves.sort(key=lambda r: -r[5])
  replicated = [r for r in leaves if r[3] == 'replicated' and r[5] >= 2 ** 20]
  return {'param_bytes': params, 'optimizer_bytes': optimizer,
          'params': {r[0]: {'shape': r[1], 'dtype': r[2], 'spec': r[3], 'bytes_per_chip': r[4]}
                     for r in leaves},
          'largest_params': [r[0] for r in leaves[:5]],
          'replicated_params': [r[0] for r in replicated]}


_DUMP = {'dir': None}


def _program_report(compiled, lowered_s: float, compile_s: float, num_devices: int,
                    name: str = '') -> dict:
  text = compiled.as_text()
  if _DUMP['dir'] and name:
    os.makedirs(_DUMP['dir'], exist_ok=True)
    with open(os.path.join(_DUMP['dir'], f'{name}.hlo.txt'), 'w', encoding='utf-8') as f:
      f.write(text)
  hlo = analyze_hlo(text, num_devices)
  return {'lower_s': round(lowered_s, 2), 'compile_s': round(compile_s, 2),
          'memory': _memory(compiled), 'cost_analysis': _cost(compiled),
          'hlo_matmul_flops': hlo.matmul_flops, 'collectives': hlo.collectives,
          'kernel_calls': hlo.kernel_calls,
          'unknown_trip_counts': hlo.unknown_trip_counts}


# Compiled results by the lowered program: JAX's persistent compilation cache cannot read a
# compile-only executable back ("PjRtCompiler must be constructed with a Client"), so the
# figures themselves are kept, keyed by everything that decides the compiled program.
_CACHE = {'dir': None}
_ANALYSIS_VERSION = '3'  # bump when the figures read from a compiled program change


def _libtpu_version() -> str:
  try:
    return importlib.metadata.version('libtpu')
  except importlib.metadata.PackageNotFoundError:
    return ''


def _cache_key(lowered_text: str, program: str, topo: Topology) -> str:
  h = hashlib.sha256()
  for part in (lowered_text, program, topo.name, str(topo.num_slices), topo.chip.platform,
               jax.__version__, _libtpu_version(), os.environ.get('XLA_FLAGS', ''),
               os.environ.get('LIBTPU_INIT_ARGS', ''), _ANALYSIS_VERSION):
    h.update(part.encode())
    h.update(b'\0')
  return h.hexdigest()[:40]


def _compiled(fn, args, program: str, topo: Topology, num_devices: int, log,
              hint: str = '') -> dict:
  """Lowers and compiles `fn` (or reads a cached result of the same program) -> its report."""
  t0 = time.perf_counter()
  lowered = fn.lower(*args)
  lower_s = time.perf_counter() - t0
  path = None
  if _CACHE['dir']:
    path = os.path.join(_CACHE['dir'], _cache_key(lowered.as_text(), program, topo) + '.json')
    if os.path.exists(path) and not _DUMP['dir']:
      with open(path, encoding='utf-8') as f:
        rep = json.load(f)
      rep.update(lower_s=round(lower_s, 2), cached=True)
      log(f'{program}: lowered in {lower_s:.1f} s; compile read from the cache (it took '
          f'{rep["compile_s"]:.1f} s)')
      return rep
  t1 = time.perf_counter()
  compiled = _compile(lowered, program, topo, hint)
  compile_s = time.perf_counter() - t1
  log(f'{program}: lowered in {lower_s:.1f} s, compiled in {compile_s:.1f} s')
  rep = _program_report(compiled, lower_s, compile_s, num_devices, program)
  if path:
    os.makedirs(_CACHE['dir'], exist_ok=True)
    tmp = f'{path}.{os.getpid()}.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
      json.dump(rep, f)
    os.replace(tmp, path)
  rep['cached'] = False
  return rep


def _train_and_eval(config, devices, topo, programs, log) -> dict:
  mesh = sharding.make_mesh(config, devices)
  rules = sharding.rules_of(config)
  out = {'mesh': dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape)))}
  with sharding.use_mesh(mesh, rules):
    abstract = nnx.eval_shape(lambda: state_lib.create_model_and_optimizer(config))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = sharding.state_shardings(abstract_state, mesh)
  abstract_state = ckpt_lib.abstract_like(abstract_state, shardings)
  out.update(_state_summary(abstract_state, shardings))
  hint = 'largest parameters per chip (x3 with the Adam moments): ' + ', '.join(
      f'{p} {out["params"][p]["bytes_per_chip"] / GIB:.2f} GiB' for p in out['largest_params'][:3])
  batch, batch_shardings = _batch_structs(config, mesh)
  out['batch_bytes'] = sum(shard_bytes(x) for x in batch.values())
  rep = sharding.replicated(mesh)
  with sharding.use_mesh(mesh, rules):
    if 'train' in programs:
      # the jit of steps.setup: explicit shardings, the state donated
      fn = jax.jit(functools.partial(steps.train_step, config, graphdef),
                   in_shardings=(shardings, batch_shardings), out_shardings=(shardings, rep),
                   donate_argnums=0)
      out['train'] = _compiled(fn, (abstract_state, batch), 'train', topo, len(devices), log,
                               hint)
    if 'eval' in programs:
      fn = jax.jit(functools.partial(steps.eval_step, config, graphdef),
                   in_shardings=(shardings, batch_shardings, rep), out_shardings=rep)
      vocab = jax.ShapeDtypeStruct((config.model.vocab_size,), jnp.int32, sharding=rep)
      out['eval'] = _compiled(fn, (abstract_state, batch, vocab), 'eval', topo, len(devices),
                              log, hint)
  return out


def _decode(config, device, topo, batch: int, new_tokens: int, log) -> dict:
  """The decoder's program (prefill + while loop) on one chip, as Decoder.compile builds it."""
  layout = 'bskh'  # decode_ops.default_cache_layout() off CPU
  args = ModelArgs.from_config(config)
  weights = 'bfloat16' if config.model.dtype == 'bfloat16' else 'float32'
  abstract = nnx.eval_shape(lambda: MTPModel(args, rngs=nnx.Rngs(0)).for_decoding(layout))
  graphdef, params = nnx.split(abstract)
  if weights != 'float32':
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
                          if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  leaves, treedef = jax.tree.flatten(params)
  prompt = config_lib.decode_prompt_len(config)
  prog = decoder_lib.Program(batch, decoder_lib.bucket(prompt), decoder_lib.bucket(new_tokens),
                             args.mtp_depth, greedy=True, layout=layout, weights=weights)
  one = jax.sharding.SingleDeviceSharding(device)

  def struct(x):
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=one)

  sampling = Sampling(np.float32(1.0), np.int32(0), np.float32(1.0), np.bool_(False),
                      use_top_k=False, use_top_p=False)
  example = ([jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one) for x in leaves],
             np.zeros((batch, prog.prompt_len), np.int32), np.zeros((batch,), np.int32),
             np.zeros((batch,), np.int32), np.int32(1), sampling, np.int32(0), np.float32(0))
  abstract_in = jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else struct(x),
                             example)
  # the function Decoder.compile jits (private to the decoder; no public hook takes abstract
  # weights)
  # pylint: disable-next=protected-access
  fn = jax.jit(functools.partial(decoder_lib._decode, prog, graphdef, treedef))
  rep = _compiled(fn, abstract_in, 'decode', topo, 1, log)
  rep.update({'batch': batch, 'prompt_len': prog.prompt_len, 'max_new': prog.max_new,
              'num_drafts': prog.num_drafts, 'weights': weights,
              'param_bytes': sum(shard_bytes(x) for x in abstract_in[0])})
  return rep


def compile_report(config, topo: Topology, programs=PROGRAMS, decode_batch: int = 1,
                   decode_tokens: int = 64, devices=None, log=lambda s: None,
                   dump_dir: str | None = None, cache_dir: str | None = None) -> dict:
  """Compiles `programs` of `config` for `topo` and returns the per-chip report (a dict).

  dump_dir: also write each compiled program's HLO text there (<program>.hlo.txt; then
  nothing is read from the cache). cache_dir: keep each program's figures there, keyed by
  the lowered program, the topology and the compiler versions; a rerun reads them back."""
  _DUMP['dir'], _CACHE['dir'] = dump_dir, cache_dir
  bad = [p for p in programs if p not in PROGRAMS]
  if bad or not programs:
    raise RequestError(f'programs must be some of {PROGRAMS}, got {tuple(programs)}')
  config = _target_config(config, topo.chip.platform)
  devices = topology_devices(topo) if devices is None else devices
  config_lib.validate(config, len(devices))
  t0 = time.perf_counter()
  with traced_for(topo.chip.platform), _no_jax_cache():
    report = {'topology': topo.name, 'num_slices': topo.num_slices, 'chips': len(devices),
              'device_kind': devices[0].device_kind, 'chip': dataclasses.asdict(topo.chip)}
    if 'train' in programs or 'eval' in programs:
      report.update(_train_and_eval(config, devices, topo, programs, log))
    if 'decode' in programs:
      report['decode'] = _decode(config, devices[0], topo, decode_batch, decode_tokens, log)
  report['compile_s'] = round(time.perf_counter() - t0, 2)
  _add_figures(report, config, topo)
  return report


# -- figures: FLOPs against flops.py, fit, roofline ---------------------------------------
def _add_figures(report: dict, config, topo: Topology) -> None:
  chip = topo.chip
  chips = report['chips']
  tokens = config.data.batch_size * config.data.seq_len
  per_token = flops_lib.config_flops_per_token(config)
  full = flops_lib.config_flops_per_token(config, causal=False)
  expected = expected_compiled_flops(config)
  report['tokens_per_step'] = tokens
  report['flops_py'] = {'model_train_per_chip': per_token.train * tokens / chips,
                        'noncausal_train_per_chip': full.train * tokens / chips,
                        'expected_compiled_per_chip': expected['expected_train'] * tokens / chips,
                        'forward_per_token': per_token.forward, 'train_per_token': per_token.train}
  for name in ('train', 'eval', 'decode'):
    prog = report.get(name)
    if not prog:
      continue
    mem = prog['memory']
    prog['fits'] = mem['total'] <= chip.hbm_bytes
    prog['hbm_fraction'] = mem['total'] / chip.hbm_bytes
    t_compute = prog['hlo_matmul_flops'] / chip.peak_flops
    t_hbm = prog['cost_analysis']['bytes_accessed'] / chip.hbm_bandwidth
    ici = sum(c['ici_bytes'] for c in prog['collectives'].values())
    t_ici = ici / chip.ici_bandwidth if chip.ici_bandwidth else None
    prog['estimate'] = {'compute_s': t_compute, 'hbm_s': t_hbm, 'ici_s': t_ici,
                        'ici_bytes': ici,
                        'step_s': max(t_compute, t_hbm, t_ici or 0.0)}
  train = report.get('train')
  if train:
    model = report['flops_py']['model_train_per_chip']
    train['flops_ratio_vs_flops_py'] = train['hlo_matmul_flops'] / model
    train['flops_ratio_vs_noncausal'] = (train['hlo_matmul_flops']
                                         / report['flops_py']['noncausal_train_per_chip'])
    train['flops_ratio_vs_expected'] = (train['hlo_matmul_flops']
                                        / report['flops_py']['expected_compiled_per_chip'])
    step = train['estimate']['step_s']
    train['estimate']['mfu'] = model / chip.peak_flops / step if step else None
    train['estimate']['tokens_per_s'] = tokens / step if step else None


def expected_compiled_flops(config) -> dict:
  """Matmul FLOPs per token the compiled train step should hold, from flops.py's parts.

  flops.py counts the model's FLOPs (causal attention, no recomputation). The compiled
  step also does: the masked half of the T x T attention scores (XLA's dense attention
  computes them); under model.remat 'block' the attention scores and values again in the
  backward pass (the policy keeps only weight-matmul outputs); under 'full' the whole
  block forward again; with model.loss_chunk > 0 the vocab projection again (its chunks
  are rematerialised so no [B, T, V] logits are kept).
  """
  args = ModelArgs.from_config(config)
  t = config.data.seq_len
  full = flops_lib.flops_per_token(args, t, causal=False)
  depth = args.mtp_depth
  attention = full.trunk_attention + depth * flops_lib.layer_flops(args, args.n_layers, t,
                                                                   causal=False)[1]
  remat = config.model.remat
  again = {'none': 0.0, 'block': attention,
           'full': full.forward - full.vocab}.get(remat, 0.0)
  if config.model.loss_chunk:
    again += full.vocab
  return {'noncausal_train': full.train, 'recomputed_forward': again,
          'expected_train': full.train + again}


def check_fits(report: dict, topo: Topology) -> None:
  """DoesNotFit (one line) when a compiled program's per-chip total exceeds the HBM."""
  for name in PROGRAMS:
    prog = report.get(name)
    if prog and not prog['fits']:
      mem = prog['memory']
      largest = report.get('largest_params', [])[:3] if name != 'decode' else []
      tail = ('; largest parameters: ' + ', '.join(
          f'{p} {report["params"][p]["bytes_per_chip"] / GIB:.2f} GiB/chip' for p in largest)
              if largest else '')
      raise DoesNotFit(
          f'does not fit {topo.name}: {name} step needs {mem["total"] / GIB:.2f} GiB per chip '
          f'(arguments {mem["argument"] / GIB:.2f}, temporaries {mem["temp"] / GIB:.2f}), a '
          f'{topo.chip.name} chip has {topo.chip.hbm_bytes / GIB:.2f} GiB (short by '
          f'{(mem["total"] - topo.chip.hbm_bytes) / GIB:.2f} GiB){tail}')


def format_report(report: dict) -> str:
  """The human-readable report: one block per program, per chip."""
  chip = report['chip']
  hbm = chip['hbm_bytes']
  lines = [f'{report["topology"]} ({report["chips"]} chips x {report["num_slices"]} slice(s), '
           f'{report["device_kind"]}, {hbm / GIB:.1f} GiB HBM, '
           f'{chip["bf16_tflops"]:.0f} TFLOP/s bf16 per chip); compiled in '
           f'{report["compile_s"]:.1f} s']
  if 'mesh' in report:
    lines.append(f'mesh {report["mesh"]}; per chip: parameters {report["param_bytes"] / GIB:.3f} '
                 f'GiB, optimizer {report["optimizer_bytes"] / GIB:.3f} GiB, batch '
                 f'{report["batch_bytes"] / 2 ** 20:.2f} MiB')
    for p in report['largest_params'][:3]:
      info = report['params'][p]
      lines.append(f'  {p} {list(info["shape"])} {info["dtype"]}: {info["spec"]}')
    if report['replicated_params']:
      lines.append(f'  replicated (>= 1 MiB): {", ".join(report["replicated_params"][:6])}')
  for name in PROGRAMS:
    prog = report.get(name)
    if not prog:
      continue
    mem, est = prog['memory'], prog['estimate']
    cached = ' (figures from the cache)' if prog.get('cached') else ''
    lines.append(
        f'{name}: compile {prog["compile_s"]:.1f} s{cached}; HBM per chip '
        f'{mem["total"] / GIB:.2f} of '
        f'{hbm / GIB:.1f} GiB ({100 * prog["hbm_fraction"]:.0f} %): arguments '
        f'{mem["argument"] / GIB:.2f}, outputs {mem["output"] / GIB:.2f} (aliased '
        f'{mem["alias"] / GIB:.2f}), temporaries {mem["temp"] / GIB:.2f} GiB')
    kernels = (f', without {prog["kernel_calls"]:.0f} kernel calls whose FLOPs it does not show'
               if prog.get('kernel_calls') else '')
    flop_line = (f'  FLOPs per chip per step {prog["hlo_matmul_flops"]:.4g} (matmuls in the HLO'
                 f'{kernels})')
    if name == 'train':
      flop_line += (f'; flops.py {report["flops_py"]["model_train_per_chip"]:.4g} (ratio '
                    f'{prog["flops_ratio_vs_flops_py"]:.3f}); with the full T x T scores '
                    'and the recomputed forward '
                    f'{report["flops_py"]["expected_compiled_per_chip"]:.4g}'
                    f' (ratio {prog["flops_ratio_vs_expected"]:.3f})')
    lines.append(flop_line)
    coll = prog['collectives']
    lines.append('  collectives per step: ' + (', '.join(
        f'{op} {c["count"]:.0f}x {c["bytes"] / 2 ** 20:.1f} MiB' for op, c in sorted(coll.items()))
        or 'none'))
    ici = 'n/a' if est['ici_s'] is None else f'{est["ici_s"] * 1e3:.2f} ms'
    hbm_t = f'{est["hbm_s"] * 1e3:.2f}' if prog['cost_analysis']['bytes_accessed'] else 'n/a'
    est_line = (f'  roofline estimate: {est["step_s"] * 1e3:.2f} ms per step (compute '
                f'{est["compute_s"] * 1e3:.2f}, HBM {hbm_t}, ICI {ici})')
    if name == 'train' and est.get('mfu'):
      est_line += f', MFU <= {est["mfu"]:.2f}'
    lines.append(est_line)
  return '\n'.join(lines)
