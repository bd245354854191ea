"""A program's step time priced op by op: by the TPU compiler's own cost model where it
prints one, and where the step goes.

The TPU compiler attaches to most ops it runs the cycles its scheduler's cost model expects
the op to take (`"estimated_cycles"` in the op's backend config). Here the ops of the
computations that run as code (hlo.py's `executed`: the entry, loop bodies and conditions)
are priced one after another in the order the scheduled module runs them, every loop body
as often as it runs, each by the first rule that applies:

  compiler          the op's estimated cycles over the chip's clock (chips.py); on a GPU
                    the compiler's own time for the op where its backend config fills one
                    in (reification_cost); the deviceless H100 compile leaves it empty
  kernel roofline   a kernel call (Pallas splash attention, grouped matmul, Triton; the
                    compiler prints no cycles for one): kernels.py's FLOPs over the chip's
                    peak or its HBM bytes over the HBM bandwidth, whichever is longer -- the
                    kernel at its roofline, so a lower bound on its time
  ICI               a collective without cycles: the bytes it moves per chip over the
                    chip's ICI bandwidth
  roofline          any other op without cycles (scalar ops, in-place updates, copies; every
                    op of a GPU module without estimates): the larger of
                    its FLOPs over the peak and its HBM bytes over the bandwidth

An asynchronous op (a `*-start` with its `*-done`: a copy between memories, an asynchronous
collective) costs only what the ops scheduled between its start and its done leave
exposed. Where every op is priced by a roofline (GPU), the sum is a lower bound on the
step time; with the compiler's cycles it is the compiler's own estimate of a step that
runs its ops one after another.
"""
from __future__ import annotations

import collections

from mtp_jax.train.aot.hlo import COLLECTIVES, HloStats

KERNEL_KINDS = ('splash_attention', 'triton_attention', 'cudnn_attention', 'grouped_matmul')
TOP_OPS = 15
# the rules, in the order the report lists them
BASES = ('compiler', 'kernel roofline', 'ICI', 'roofline')
# ops that take no time of their own (views, tuples; control flow is priced by its bodies)
_FREE = ('parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'while',
         'conditional', 'call', 'after-all', 'add-dependency', 'partition-id', 'replica-id')


def _time(op, chip) -> tuple:
  """(seconds of one execution, the rule that priced it)."""
  if op.op in _FREE:
    return 0.0, 'roofline'
  clock = chip.clock_hz
  if op.cycles is not None and clock:
    return op.cycles / clock, 'compiler'
  if op.compiler_s is not None:
    return op.compiler_s, 'compiler'
  roofline = max(op.flops / chip.peak_flops, op.hbm_bytes / chip.hbm_bandwidth)
  if op.kind in KERNEL_KINDS or op.kind == 'other' and op.op == 'custom-call':
    return roofline, 'kernel roofline'
  if op.kind in COLLECTIVES:
    if chip.ici_bandwidth:
      return op.ici_bytes / chip.ici_bandwidth, 'ICI'
    return 0.0, 'ICI'
  return roofline, 'roofline'


def price_step(stats: HloStats, chip, top: int = TOP_OPS) -> dict:
  """The step's time by the rules above, per rule and per kind of op, and its costliest
  ops: [{name, ops, kind, basis, runs, time_s, share, cycles, flops, hbm_bytes, source}],
  `ops` alike ops in one row (_alike), `name` the first of them.

  A computation's time is its ops' times in order; a while loop's its condition and body
  times its trip count, a call's its callee's, a conditional's its costliest branch's. An
  asynchronous start whose done is not in its computation (a transfer a loop carries into
  its next iteration) is charged in full."""
  memo = {}
  per_op = {}  # name -> [op, basis, seconds per step]

  def run(name: str) -> tuple:
    """(seconds, {basis: seconds}, {kind: seconds}) of one run of a computation."""
    if name in memo:
      return memo[name]
    memo[name] = (0.0, {}, {})  # a computation reached again while it is priced: nothing
    ops = stats.executed.get(name, [])
    own = [_time(op, chip) for op in ops]
    inner = []
    for op in ops:
      parts = [(run(callee), n) for callee, n in op.calls]
      if op.op == 'conditional' and parts:
        parts = [max(parts, key=lambda p: p[0][0])]
      inner.append(parts)
    position = {op.name: i for i, op in enumerate(ops)}
    done = {i: position[op.done] for i, op in enumerate(ops) if op.done in position}
    whole = [own[i][0] + sum(r[0] * n for r, n in inner[i]) for i in range(len(ops))]
    total, by_basis, by_kind = 0.0, collections.defaultdict(float), collections.defaultdict(float)
    for i, op in enumerate(ops):
      seconds, basis = own[i]
      if i in done:  # exposed: what the ops between its start and its done do not cover
        hidden = sum(whole[k] for k in range(i + 1, done[i]) if k not in done)
        seconds = max(0.0, seconds - hidden)
      total += seconds
      by_basis[basis] += seconds
      by_kind[op.kind] += seconds
      if seconds:
        per_op[op.name] = [op, basis, seconds * op.runs]
      for (t, b, k), n in inner[i]:
        total += t * n
        for key, v in b.items():
          by_basis[key] += v * n
        for key, v in k.items():
          by_kind[key] += v * n
    memo[name] = (total, dict(by_basis), dict(by_kind))
    return memo[name]

  step, basis_s, kind_s = run(stats.entry)
  by_basis = {b: basis_s.get(b, 0.0) for b in BASES}
  with_cycles = without = 0
  for ops in stats.executed.values():
    for op in ops:
      if op.op in _FREE or op.op.endswith('-done') or op.calls:
        continue
      if op.cycles is not None or op.compiler_s is not None:
        with_cycles += 1
      else:
        without += 1
  costly = sorted(_alike(per_op.values()), key=lambda r: -r[3])[:top]
  return {
      'step_s': step,
      'basis': 'compiler' if by_basis['compiler'] > 0 else 'roofline',
      'clock_ghz': chip.clock_hz / 1e9 if chip.clock_hz else None,
      'by_basis': by_basis,
      'by_kind': dict(sorted(((k, v) for k, v in kind_s.items() if v), key=lambda kv: -kv[1])),
      'ops_with_cycles': with_cycles, 'ops_without_cycles': without,
      'top_ops': [{'name': op.name, 'ops': n, 'kind': op.kind, 'basis': basis, 'runs': runs,
                   'time_s': t, 'share': t / step if step else 0.0, 'cycles': op.cycles,
                   'flops': op.flops, 'hbm_bytes': op.hbm_bytes, 'source': op.source}
                  for op, basis, n, t, runs in costly],
  }


def _alike(rows) -> list:
  """[(first op, basis, ops, seconds per step, runs)]: ops of one instruction, JAX source
  and cost per execution as one row. Unrolled layers (model.scan_layers False) repeat each
  layer's ops under new names; the table then reads as the scanned one, each op once with
  its runs summed."""
  out = {}
  for op, basis, t in rows:
    once = round(t / max(op.runs, 1) * 1e12)  # picoseconds of one execution
    key = (op.kind, op.op, basis, op.source, op.flops, op.hbm_bytes, op.cycles, once)
    if key in out:
      row = out[key]
      row[2:] = [row[2] + 1, row[3] + t, row[4] + op.runs]
    else:
      out[key] = [op, basis, 1, t, op.runs]
  return [tuple(r) for r in out.values()]
