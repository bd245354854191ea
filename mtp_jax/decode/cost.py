"""The time of one decode iteration on the running backend, as a function of its windows.

An iteration of a chain of A drafts or of a tree (tree.py) is, in the compiled program,
  verify    one main-model pass over R window rows per batch row (R = A + 1, or the tree's
            nodes + 1) and their logits;
  depth k   one MTP block pass over a window of W_k rows (chain: A + k; tree: A + 1 + the
            nodes above depth k) and that head's logits over P_k rows (chain: 1; tree:
            the parents of depth k's nodes);
  the rest  acceptance, cache moves, bookkeeping.
`IterationCost` holds the first two as tables by rows (each measured alone, inside a
compiled loop of its own so that dispatch is left out) and the rest as three fitted
constants: per drafting iteration and per drafting depth (from the measured steps of the
chains of 1 and of the model's drafts) and per tree iteration (from a small tree), each
the measured program's time less what the tables predict for it. Plain decoding's step
is its whole program's, measured (a one-row pass timed alone misleads on some CPUs: the
one-row product runs another kernel). A table is read at
the smallest measured row count at or above the one asked for: on a CPU few-row products
past 4 rows run padded to 8 (decode_ops.ROW_MULTIPLE), and the grid's points past 8 sit
where that padding steps.

`calibrate` measures it for a Decoder and a program shape (batch, prompt and length
buckets, greedy or sampled), cached on disk per model shape, backend and host beside the
CPU peak (runtime/peak.py's cache directory), so a host calibrates once. For a TPU or GPU
target without the device, train/aot/decode_cost.py fills the same tables from the
compiler's price of the same passes.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import time

import jax
import numpy as np

import mtp_jax.decode.tree as tree_lib
from mtp_jax.model import decode_ops
from mtp_jax.runtime import machine
from mtp_jax.runtime import peak as peak_lib

ROW_GRID = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 40, 48, 56, 64)
CACHE_FILE = 'decode_cost.json'
FORM = 'form 2'  # the cached tables' form: a change here calibrates anew
# A pass's time: the difference between loops of MIN_TRIPS and of more trips (spanning about
# SPAN seconds, at most MAX_TRIPS), over the extra trips.
MIN_TRIPS, MAX_TRIPS, SPAN = 2, 400, 0.03


def grid(max_rows: int) -> tuple:
  """The row counts measured to cover windows of up to max_rows rows."""
  out = [r for r in ROW_GRID if r < max_rows]
  return tuple(out) + (min(r for r in ROW_GRID + (max_rows,) if r >= max_rows),)


def _lookup(table: dict, rows: int) -> float:
  keys = sorted(int(k) for k in table)
  at = next((k for k in keys if k >= rows), None)
  if at is not None:
    return float(table[str(at)] if str(at) in table else table[at])
  a, b = keys[-2:] if len(keys) > 1 else (keys[-1], keys[-1])
  ta, tb = (float(table[str(k)] if str(k) in table else table[k]) for k in (a, b))
  return tb + (rows - b) * (tb - ta) / max(b - a, 1)  # past the grid: linear


@dataclasses.dataclass
class IterationCost:
  """Seconds of the passes of one iteration (module docstring), at one batch size."""
  verify: dict  # rows -> main pass + logits over that many rows per batch row
  block: dict  # rows -> one MTP block pass over a window of that many rows
  logits: dict  # rows -> one head's logits over that many rows per batch row
  ar: float | None = None  # plain decoding's step, its whole program measured
  base: float = 0.0  # per drafting iteration, outside the passes
  per_depth: float = 0.0  # per drafting depth, outside the passes
  tree_extra: float = 0.0  # per tree iteration: the tree's acceptance and cache moves
  batch: int = 1
  source: str = ''  # 'measured: <cpu>' or 'compiler: <target>'
  fitted_from: dict = dataclasses.field(default_factory=dict)  # the programs' measured times

  def parts(self, tree: tree_lib.Tree | None = None, num_drafts: int = 0) -> dict:
    """The iteration's windows: verify rows, [(block rows, logit rows)] per depth."""
    if tree is None:
      a = num_drafts
      return {'verify_rows': a + 1, 'depths': [(a + k, 1) for k in range(1, a + 1)]}
    a = tree.depth
    depths = []
    for k in range(1, a + 1):
      parents = {int(tree.parents[i]) for i in range(1, tree.size + 1) if tree.depths[i] == k}
      depths.append((a + 1 + tree.below(k), len(parents)))
    return {'verify_rows': tree.size + 1, 'depths': depths}

  def seconds(self, tree: tree_lib.Tree | None = None, num_drafts: int = 0, *,
              overheads: bool = True) -> float:
    """Predicted seconds of one iteration of a tree, or of a chain of num_drafts."""
    if tree is None and not num_drafts and overheads and self.ar is not None:
      return self.ar
    p = self.parts(tree, num_drafts)
    t = _lookup(self.verify, p['verify_rows'])
    t += sum(_lookup(self.block, w) + _lookup(self.logits, r) for w, r in p['depths'])
    if overheads:
      t += self.base + self.per_depth * len(p['depths']) + (self.tree_extra if tree else 0.0)
    return max(t, 1e-9)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> IterationCost:
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in fields})


# -- the passes, each in a compiled loop of its own -------------------------------------------
def _timed(fn, args, rounds: int, span: float = SPAN) -> float:
  """Seconds of one trip of fn's loop: the difference of the best times at two trip
  counts over the extra trips, the larger count chosen so that they take about `span`."""
  jax.block_until_ready(fn(*args, np.int32(1)))  # compiles, warms
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args, np.int32(MIN_TRIPS)))
  rough = (time.perf_counter() - t0) / MIN_TRIPS  # an upper bound: dispatch included
  many = int(min(MAX_TRIPS, max(2 * MIN_TRIPS, span / max(rough, 1e-7))))
  best = {}
  for _ in range(rounds):
    for r in (MIN_TRIPS, many):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args, np.int32(r)))
      best[r] = min(best.get(r, np.inf), time.perf_counter() - t0)
  return max((best[many] - best[MIN_TRIPS]) / (many - MIN_TRIPS), 1e-7)


def measure_passes(decoder, prog, max_rows: int, max_window: int, rounds: int = 3,
                   log=lambda s: None) -> dict:
  """{'verify', 'block', 'logits'}: seconds by rows, measured on this backend."""
  verify, block, logits, caches = decoder.pass_functions(prog)
  out = {}
  with decode_ops.tall_attention(decoder.tall_attention):
    for name, make, top in (('verify', verify, max_rows), ('block', block, max_window),
                            ('logits', logits, max_rows)):
      out[name] = {}
      for rows in grid(top):
        out[name][str(rows)] = _timed(jax.jit(make(rows)), (decoder._leaves, caches), rounds)  # pylint: disable=protected-access
      log(f'{name}: ' + ' '.join(f'{r}:{1e3 * t:.2f}' for r, t in out[name].items()) + ' ms')
  return out


def _program_step(decoder, *, batch, prompt_len, max_new, temperature, rounds, **kw):
  """Seconds per loop iteration of a whole compiled program: the difference between the
  best times of a short and a full-length request (one program) over their iterations."""
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, decoder.args.vocab_size, (batch, prompt_len)).tolist()
  short, long = max(2, max_new // 4), max_new
  best, steps = {}, {}
  spent, t0 = 0.0, time.perf_counter()
  for i in range(4 * rounds + 2):
    for n in (short, long):
      r = decoder.generate(prompts, n, temperature=temperature, eos_id=None,
                           pad_to=(prompt_len, max_new), **kw)
      if i:  # the first call of each length warms up
        best[n], steps[n] = min(best.get(n, np.inf), r.seconds), r.steps
    spent = time.perf_counter() - t0
    if i >= rounds and spent > SPAN * 10:
      break
  return (best[long] - best[short]) / max(steps[long] - steps[short], 1)


def fit_overheads(cost: IterationCost, decoder, batch, prompt_len, max_new, temperature,
                  depth: int, rounds: int = 2) -> IterationCost:
  """Fills ar, base, per_depth and tree_extra from whole programs (module docstring)."""
  plain = decoder.with_tree(None)
  step = functools.partial(_program_step, batch=batch, prompt_len=prompt_len, max_new=max_new,
                           temperature=temperature, rounds=rounds)
  ar = step(plain, num_drafts=0)
  one = step(plain, num_drafts=1)
  chain = step(plain, num_drafts=depth) if depth > 1 else one
  small = tree_lib.parse_tree((2,) + (1,) * (depth - 1))
  tree = step(decoder.with_tree(small))
  cost.ar = ar
  left = [t - cost.seconds(None, a, overheads=False) for t, a in ((one, 1), (chain, depth))]
  cost.per_depth = (left[1] - left[0]) / (depth - 1) if depth > 1 else 0.0
  cost.base = left[0] - cost.per_depth
  cost.tree_extra = tree - cost.seconds(small, overheads=False) - cost.base - (
      cost.per_depth * depth)
  cost.fitted_from = {'ar_s': ar, 'chain_1_s': one, f'chain_{depth}_s': chain,
                      f'tree_{small}_s': tree}
  return cost


# -- the cache on disk ------------------------------------------------------------------------
def model_key(args) -> str:
  """A short digest of the model's shape (its ModelArgs, weights excluded)."""
  text = repr(sorted((f.name, repr(getattr(args, f.name))) for f in dataclasses.fields(args)))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_key(decoder, prog, max_rows: int) -> str:
  dev = jax.local_devices()[0]
  where = machine.cpu_model() if dev.platform == 'cpu' else dev.device_kind
  return ' | '.join([
      model_key(decoder.args), dev.platform, where, f'{machine.usable_cores()} cores',
      f'batch {prog.batch}', f'prompt {prog.prompt_len}', f'new {prog.max_new}',
      'greedy' if prog.greedy else 'sampled', prog.weights, prog.layout,
      f'rows {max_rows}', f'jax {jax.__version__}', FORM])


def cache_file() -> str:
  return os.path.join(peak_lib.cache_dir(), CACHE_FILE)


def _read() -> dict:
  try:
    with open(cache_file()) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def _write(key: str, cost: IterationCost) -> None:
  data = _read()
  data[key] = cost.to_json() | {'date': datetime.datetime.now().isoformat(timespec='seconds'),
                                'load_average': [round(x, 2) for x in os.getloadavg()]}
  os.makedirs(os.path.dirname(cache_file()), exist_ok=True)
  tmp = f'{cache_file()}.{os.getpid()}.tmp'
  with open(tmp, 'w') as f:
    json.dump(data, f, indent=1)
  os.replace(tmp, cache_file())  # atomic: concurrent runs never read half a file


def max_depth(args) -> int:
  """The deepest shape the picker tries by default: the model's drafting depths, plus one
  recursive draft where sequential modules allow it."""
  drafting = args.drafting_depths()
  limit = args.mtp_head().max_drafts(drafting)
  return drafting if drafting < args.mtp_depth else min(limit, drafting + 1)


def calibrate(decoder, batch: int, prompt_len: int, max_new: int, *, temperature: float = 0.0,
              max_rows: int = 16, depth: int | None = None, refresh: bool = False,
              log=lambda s: None) -> IterationCost:
  """This backend's IterationCost for the decoder's model at this program shape: read from
  the cache, or measured (a few seconds on a small model, a few minutes at d 768 on 2 CPU
  cores) and cached. max_rows: the most verify rows a shape may have; depth: the deepest
  drafting depth a shape may use (default: the model's drafting depths + 1)."""
  depth = depth or max_depth(decoder.args)
  prog = decoder.with_tree(None).program(batch, prompt_len, max_new,
                                                  num_drafts=depth, temperature=temperature)
  key = cache_key(decoder, prog, max_rows) + f' | depth {depth}'
  cached = None if refresh else _read().get(key)
  if cached is not None:
    return IterationCost.from_json(cached)
  t0 = time.perf_counter()
  dev = jax.local_devices()[0]
  tables = measure_passes(decoder, prog, max_rows, max_rows + depth + 1, log=log)
  cost = IterationCost(**tables, batch=batch, source='measured: ' + (
      machine.cpu_model() if dev.platform == 'cpu' else dev.device_kind))
  cost = fit_overheads(cost, decoder, batch, prompt_len, max_new, temperature,
                       decoder.args.drafting_depths())
  log(f'calibrated in {time.perf_counter() - t0:.0f} s: base {1e3 * cost.base:.2f} ms, '
      f'per depth {1e3 * cost.per_depth:.2f} ms, tree {1e3 * cost.tree_extra:.2f} ms')
  _write(key, cost)
  return cost

