"""FLOPs and HBM bytes of the compiled kernel calls whose insides the HLO does not show.

XLA's cost analysis sees a custom call as an opaque op: no FLOPs, and its operands and
results as its only traffic. The kernels the model calls are counted here from their
shapes, per call:

  splash attention   the Pallas TPU kernel (Mosaic `tpu_custom_call` named
                     splash_{mha,mqa}_*{fwd,dq,dkv}): every (query block, key block) pair its
                     block mask keeps costs the block's matmuls: forward QKᵀ and PV; dq
                     recomputes QKᵀ and forms dP and dQ; dkv recomputes QKᵀ and dP and forms
                     dK and dV (and dQ too in the fused backward, whose extra result holds
                     dQ's partial sums per key block). The block mask is an operand of the
                     call, read where it is a constant; where it reaches the call through a
                     loop (a scanned layer's call) its shape gives the block grid and the
                     kept pairs are a causal mask's (the lower triangle of blocks, diagonal
                     blocks whole), counted in `causal_assumed`.
  Triton attention   the Pallas GPU flash kernel (`__gpu$xla.gpu.triton` calls of
                     mha_forward / mha_backward; the backward forms dK, dV in one loop and
                     dQ in another), its blocks read from the call's grid.
  cuDNN attention    `__cudnn$fmha*` (forward, and Backward), causal when its mask type says.
  grouped matmul     the Pallas TPU megablox kernels (gmm: [m, k] rows by their group's
                     [k, n]; tgmm: the per-group [k, n] weight gradient): 2 m k n each,
                     m the rows the kernel computes. Its grid runs over the tiles of the
                     rows its groups hold, not over the whole buffer: where the caller
                     says how many rows a call receives on average (`grouped_rows`: an
                     expert-parallel exchange's receive buffer is sized for the worst case
                     or the capacity factor), m = min(buffer rows, grouped_rows + one
                     128-row tile per group), and only those rows are read and written.

HBM bytes: the call's operands and results once; a TPU flash kernel also reads blocks
again from HBM (its VMEM holds only the blocks in flight): a forward or dq pass the
key/value blocks once per kept pair, a dkv pass the query-side blocks once per kept pair.
On a GPU one head's blocks (a few MiB) stay in the L2 cache between the passes over them,
so a GPU kernel's HBM bytes are its operands and results. The Triton and cuDNN calls do
not print their causal flag or key block; the causal mask is taken from the cuDNN mask
type, and the Triton kernel (which the model calls causal only) is counted causal with
square blocks.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

ATTENTION_KINDS = ('splash_attention', 'triton_attention', 'cudnn_attention')

_SPLASH = re.compile(r'\b(splash_\w*?_(fwd|dq|dkv))')
_GMM = re.compile(r'\b(t?gmm)\b')
_XPROF = re.compile(r'"xprof_metadata":"(\{.*?\})"', re.S)
_BODY = re.compile(r'"body":"[^"]*"')
_FLOAT = ('bf16', 'f16', 'f32', 'f64') + tuple(f'f8{s}' for s in ('e4m3fn', 'e5m2', 'e4m3',
                                                                   'e4m3fnuz', 'e5m2fnuz'))
_TRITON = re.compile(r'\b(mha_forward|mha_backward|mha_preprocess_backward)\b')
_GRID = re.compile(r'\bgrid_([xyz])"?\s*[=:]\s*"?(\d+)')


@dataclasses.dataclass(frozen=True)
class KernelCall:
  kind: str  # one of ATTENTION_KINDS, 'grouped_matmul', or 'other'
  name: str  # e.g. splash_mqa_fwd, gmm, mha_backward
  flops: float
  hbm_bytes: float
  causal_assumed: bool = False  # the kept blocks were not read from the call


# bytes per element of the HLO's array types
BYTES = {'pred': 1, 's4': 1, 's8': 1, 's16': 2, 's32': 4, 's64': 8, 'u4': 1, 'u8': 1,
         'u16': 2, 'u32': 4, 'u64': 8, 'bf16': 2, 'f16': 2, 'f32': 4, 'f64': 8, 'c64': 8,
         'c128': 16}


def _size(dtype: str) -> int:
  return BYTES.get(dtype, 1)


def causal_kept_fraction(t_q: int, t_kv: int, block_q: int, block_kv: int) -> float:
  """The fraction of (query block, key block) pairs a causal mask keeps (any pair holding
  one query position at or after one key position), queries and keys aligned at 0."""
  nq, nkv = max(1, -(-t_q // block_q)), max(1, -(-t_kv // block_kv))
  kept = sum(min(nkv, ((i + 1) * block_q - 1) // block_kv + 1) for i in range(nq))
  return kept / (nq * nkv)


# matmul widths per kept (query, key) pair, as (multiple of D_qk, multiple of D_v); each
# is 2 D FLOPs per pair
_PASSES = {'fwd': (1, 1), 'dq': (2, 1), 'dkv': (2, 2), 'dkv_fused': (3, 2),
           'triton_bwd': (4, 3), 'cudnn_bwd': (3, 2)}


def attention_pass_flops(pass_name: str, pairs: float, d_qk: int, d_v: int) -> float:
  """FLOPs of one attention kernel pass over `pairs` (query, key) position pairs."""
  a, b = _PASSES[pass_name]
  return 2.0 * pairs * (a * d_qk + b * d_v)


def kernel_call(target: str, text: str, outputs: list, operands: list,
                constants: dict, grouped_rows: int = 0) -> KernelCall:
  """The FLOPs and bytes of one custom call.

  target: its custom_call_target; text: the rest of its instruction; outputs: [(dtype,
  dims)] of its result arrays; operands: [(name, [(dtype, dims)])] in order; constants:
  instruction name -> its integer values, where the HLO prints them; grouped_rows: the
  rows a grouped-matmul call computes on average (0: its whole buffer)."""
  text = _BODY.sub('', text)
  io = sum(_bytes(a) for a in outputs) + sum(_bytes(a) for _, arrs in operands for a in arrs)
  floats = [arrs[0] for _, arrs in operands if len(arrs) == 1 and arrs[0][0] in _FLOAT]
  if target == 'tpu_custom_call':
    m = _SPLASH.search(text)
    if m and len(floats) >= 3:
      return _splash(m.group(1), m.group(2), text, floats, operands, constants, io, outputs)
    m = _GMM.search(text)
    if m and len(floats) >= 2:
      return _gmm(m.group(1), outputs, floats, io, grouped_rows)
    return KernelCall('other', _name(text), 0.0, io)
  if target.startswith('__cudnn$fmha') and len(floats) >= 3:
    return _cudnn(target, text, floats, io)
  if 'triton' in target:
    m = _TRITON.search(text)
    if m and m.group(1) == 'mha_preprocess_backward':  # the dO . O sums: no matmul
      return KernelCall('triton_attention', m.group(1), 0.0, io)
    if m and len(floats) >= 3:
      return _triton(m.group(1), text, floats, io)
  return KernelCall('other', _name(text) or target, 0.0, io)


def _bytes(arr) -> int:
  return _size(arr[0]) * int(math.prod(arr[1]))


def _name(text: str) -> str:
  m = re.search(r'op_name="([^"]*)"', text)
  return m.group(1).rsplit('/', 2)[-2] if m and '/' in m.group(1) else ''


def _splash(name, pass_name, text, floats, operands, constants, io, outputs) -> KernelCall:
  meta = {}
  m = _XPROF.search(text)
  if m:
    try:
      meta = json.loads(m.group(1).replace('\\"', '"'))
    except ValueError:
      meta = {}
  (_, q), (_, k), (_, v) = floats[:3]
  # layouts: 1 puts the head dimension last (the kernel's default), 2 the sequence
  t_q, d_qk = (q[-2], q[-1]) if meta.get('q_layout', 1) == 1 else (q[-1], q[-2])
  t_kv, _ = (k[-2], k[-1]) if meta.get('k_layout', 1) == 1 else (k[-1], k[-2])
  d_v = v[-1] if meta.get('v_layout', 1) == 1 else v[-2]
  heads = math.prod(q[:-2])
  # the block mask: the second integer [heads, q blocks, kv blocks] operand (after the
  # data-next table)
  masks = [(nm, arrs[0]) for nm, arrs in operands[:3]
           if len(arrs) == 1 and arrs[0][0][0] in 'su' and len(arrs[0][1]) == 3]
  frac, assumed = None, False
  if len(masks) >= 2:
    nm, (_, dims) = masks[1]
    values = constants.get(nm)
    if values is not None and len(values) == math.prod(dims):
      frac = sum(1 for x in values if x) / len(values)
    elif dims[1] and dims[2]:
      a, b = (dims[1], dims[2]) if pass_name != 'dkv' else (dims[2], dims[1])
      frac, assumed = causal_kept_fraction(t_q, t_kv, max(1, t_q // a),
                                           max(1, t_kv // b)), True
  if frac is None:
    suffix = {'fwd': '', 'dq': '_dq', 'dkv': '_dkv'}[pass_name]
    frac, assumed = causal_kept_fraction(t_q, t_kv, meta.get(f'block_q{suffix}', 512),
                                         meta.get(f'block_kv{suffix}', 512)), True
  # the fused backward (dQ formed in the dkv pass) returns dQ's partial sums, one per key
  # block: q's dims with the key-block count before the heads
  fused = pass_name == 'dkv' and (meta.get('use_fused_bwd_kernel', False) or any(
      len(dims) == len(q) + 1 and tuple(dims[-3:]) == tuple(q[-3:]) for _, dims in outputs))
  pairs = heads * t_q * t_kv * frac
  flops = attention_pass_flops('dkv_fused' if fused else pass_name, pairs, d_qk, d_v)
  size = _size(floats[0][0])
  if pass_name == 'dkv':  # query-side blocks (q, dO) read once per kept pair
    nkv = max(1, t_kv // meta.get('block_kv_dkv', min(512, t_kv)))
    extra = heads * frac * nkv * t_q * (d_qk + d_v) * size - heads * t_q * (d_qk + d_v) * size
  else:  # key/value blocks read once per kept pair
    block = meta.get('block_q' + ('_dq' if pass_name == 'dq' else ''), min(512, t_q))
    nq = max(1, t_q // block)
    kv = _bytes(floats[1]) + _bytes(floats[2])
    extra = heads * frac * nq * t_kv * (d_qk + d_v) * size - kv
  return KernelCall('splash_attention', re.sub(r'_(segmented|residuals|no_residuals)', '',
                                               name), flops, io + max(0.0, extra), assumed)


_GROUP_TILE = 128  # rows of a grouped-matmul tile: a group's last tile is computed whole


def _gmm(name, outputs, floats, io, grouped_rows: int = 0) -> KernelCall:
  out = max((a for a in outputs if a[0] in _FLOAT), key=lambda a: math.prod(a[1]),
            default=None)
  if out is None:
    return KernelCall('grouped_matmul', name, 0.0, io)
  (lt, lhs), (rt, rhs) = floats[:2]
  if name == 'gmm':  # [m, k] x [groups, k, n] -> [m, n]
    m, groups, row_arrays = lhs[0], rhs[0], ((lt, lhs), out)
    flops_per_row = 2.0 * lhs[-1] * out[1][-1]
  else:  # tgmm: [m, k] (or [k, m]) x [m, n] -> [groups, k, n]
    m = rhs[0]
    k = lhs[1] if lhs[0] == m else lhs[0]
    groups, row_arrays = out[1][0], ((lt, lhs), (rt, rhs))
    flops_per_row = 2.0 * k * rhs[-1]
  rows = min(m, grouped_rows + groups * _GROUP_TILE) if grouped_rows else m
  unread = sum(_bytes(a) for a in row_arrays) * (1 - rows / m)  # rows past its groups
  return KernelCall('grouped_matmul', name, flops_per_row * rows, io - unread)


def _cudnn(target, text, floats, io) -> KernelCall:
  (_, q), (_, k), (_, v) = floats[:3]  # [B, T, N, H]
  t_q, t_kv, d_qk, d_v = q[1], k[1], q[-1], v[-1]
  heads = math.prod(q) // (t_q * d_qk)
  causal = bool(re.search(r'"mask_type":"\w*CAUSAL', text))
  frac = causal_kept_fraction(t_q, t_kv, 128, 128) if causal else 1.0
  backward = 'Backward' in target
  pairs = heads * t_q * t_kv * frac
  flops = attention_pass_flops('cudnn_bwd' if backward else 'fwd', pairs, d_qk, d_v)
  return KernelCall('cudnn_attention', 'fmha_backward' if backward else 'fmha', flops, io,
                    False)


def _triton(name, text, floats, io) -> KernelCall:
  (_, q), (_, k), (_, v) = floats[:3]  # [B, T, N, H] (v: [B, T, N, Hv])
  t_q, t_kv, d_qk, d_v = q[1], k[1], q[-1], v[-1]
  heads = math.prod(q) // (t_q * d_qk)
  grid = {axis: int(n) for axis, n in _GRID.findall(text)}
  # the forward's grid runs over query blocks first, the backward's over key blocks last
  blocks = grid.get('x' if name == 'mha_forward' else 'z', 0)
  block = max(1, t_q // blocks) if blocks else 128
  frac = causal_kept_fraction(t_q, t_kv, block, block)
  pairs = heads * t_q * t_kv * frac
  if name == 'mha_forward':
    return KernelCall('triton_attention', name, attention_pass_flops('fwd', pairs, d_qk, d_v),
                      io, True)
  if name == 'mha_backward':
    return KernelCall('triton_attention', name,
                      attention_pass_flops('triton_bwd', pairs, d_qk, d_v), io, True)
  return KernelCall('triton_attention', name, 0.0, io, False)
