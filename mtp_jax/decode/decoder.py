"""Self-speculative decoding: the MTP modules draft, the main model verifies (docs/design.md §5).

One `jax.jit`-compiled program per static shape runs the prefill and then a
`lax.while_loop` over a `DecodeState`. Plain autoregressive decoding is the same
program with zero drafts, so both decoders share every line of cache code.

Positions are 0-based. Row b holds n committed tokens c_0..c_{n-1} (prompt, then
generated); the last one, x = c_{n-1}, is decided but not yet in the main KV cache.
KV slot s of every cache holds position s - off (off = number of drafts), so MTP
windows may start before position 0; slots at negative positions are masked out.

One iteration (A drafts d_1..d_A, made at the end of the previous one):
  verify  the main model over [x, d_1..d_A] at positions n-1..n-1+A (one pass);
  accept  a leading drafts (greedy: d_j == argmax; sampling: speculative rule) plus the
          bonus token, then cut at EOS / max_new_tokens: n' = n + a + 1 at most;
  MTP     depth k runs ONE block call over positions n-k .. n-1+A (A+k of them): the
          catch-up of the positions that became true, then the free-running draft.
Depth k at position p reads h^{k-1}_p and t_{p+k}. After the pass, depth k's cache is
true (computed from committed tokens and verified hidden states only) for p <= n'-1-k;
its entries n'-k..n'-2 come from the new drafts (d_1..d_{k-1}) exactly as in an
uncached forward of the chain over [committed ; drafts], and the next window, which
starts at n'-k, rewrites them before anything reads them. Stale slots to the right of
a window are never read: a query at position p sees only slots <= p, all of them
either true or written by the same call. `hidden[k-1]` keeps h^k at n'-1-k, the one
input of depth k+1's next window that is not produced in that iteration.
Parallel heads read only h^0, so their window is the verify window.
Leap targets (model.mtp.target_offsets): depth k drafts position n-1+k only if it predicts
t_(i+k+1); the decoder drafts with the leading depths whose offsets are 2, 3, ...
(ModelArgs.drafting_depths) and refuses more drafts; a leap depth is trained, not used.

Here: the host-side `Decoder`; the program, its state and the while loop are in program.py,
tree drafting's windows, acceptance and cache moves in tree.py. The cached
block math is the model's own (layers.Block.decode, MTPModel.decode_trunk /
decode_mtp_step / decode_logits, over the decode weight layout of MTPModel.for_decoding,
with the few-row matmul rule in decode_ops.decode_dot). The sampling
math and the acceptance rule are in sampling.py; prompts from text, decoding a training
workdir and token provenance in generate.py.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mtp_jax
import mtp_jax.decode.acceptance as acceptance_lib
import mtp_jax.decode.cost as cost_lib
import mtp_jax.decode.picker as picker_lib
import mtp_jax.decode.tree as tree_lib
from mtp_jax.decode.program import Program, decode_program, pass_caches, pass_functions
from mtp_jax.decode.sampling import Sampling
from mtp_jax.errors import RequestError
from mtp_jax.model import decode_ops
from mtp_jax.model.heads import MAX_DRAFTS
from mtp_jax.model.mtp import MTPModel

Array = jax.Array
AUTO = 'auto'  # tree / num_drafts: the picker's shape (picker.py)
MIN_BUCKET = 16
WEIGHT_DTYPES = ('float32', 'bfloat16')
_COMPILED = {}  # (graphdef, Program) -> compiled executable, shared by every Decoder


def clear_compiled() -> None:
  """Forgets every compiled program; Decoders compile anew on their next call."""
  _COMPILED.clear()


# -- host side -----------------------------------------------------------------------------------
def bucket(n: int) -> int:
  """Static size for n: the next power of two, at least MIN_BUCKET."""
  return max(MIN_BUCKET, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


@dataclasses.dataclass
class DecodeResult:
  """Generated tokens per row (ending with EOS if it was hit) and loop statistics."""
  tokens: list[np.ndarray]
  num_drafts: int
  steps: int  # loop iterations (the longest row's verify steps)
  verify_steps: np.ndarray  # [B]
  committed: np.ndarray  # [B] tokens committed by verify steps
  accepted: np.ndarray  # [B, A+1] histogram of accepted drafts per verify step
  dropped: np.ndarray  # [B]
  verify_rows: np.ndarray | None = None  # [B] positions verified, summed over iterations
  seconds: float = 0.0  # wall time of the compiled call (compilation excluded)
  history_drafts: np.ndarray | None = None  # record: [iterations, B, A]
  history_length: np.ndarray | None = None  # record: [iterations, B], -1 once done
  tree: tree_lib.Tree | None = None  # the tree drafted (history_drafts then holds its nodes)
  flops_per_iteration: dict | None = None  # tree.flops_per_iteration

  @property
  def new_tokens(self) -> int:
    return int(sum(len(t) for t in self.tokens))

  def stats(self) -> dict:
    """tau = committed / verify steps; acceptance_per_depth[k-1] = P(first k drafts accepted)."""
    steps = int(self.verify_steps.sum())
    hist = self.accepted.sum(0)
    at_least = [int(hist[k:].sum()) for k in range(1, self.num_drafts + 1)]
    return {
        'num_drafts': self.num_drafts,
        'new_tokens': self.new_tokens,
        'verify_steps': steps,
        'committed': int(self.committed.sum()),
        'mean_accepted_length': float(self.committed.sum() / max(steps, 1)),
        'acceptance_per_depth': [c / max(steps, 1) for c in at_least],
        'conditional_acceptance': [c / max(prev, 1) for c, prev in
                                   zip(at_least, [steps] + at_least[:-1])],
        'dropped_at_stop': int(self.dropped.sum()),
        'verify_rows_per_iteration': (float(self.verify_rows.sum() / max(steps, 1))
                                      if self.verify_rows is not None else None),
        'seconds': self.seconds,
        'tokens_per_sec': self.new_tokens / self.seconds if self.seconds else None,
        'tree': None if self.tree is None else str(self.tree),
        'flops_per_iteration': self.flops_per_iteration,
    }


class Decoder:
  """Speculative and autoregressive decoding of one model; compiled programs are cached.

  The model is split once; its parameters are an argument of the compiled program, so
  every Decoder of a model of the same structure shares the same compiled programs.
  """

  def __init__(self, model: MTPModel, *, weight_dtype: str = 'float32',
               cache_layout: str | None = None, tall_attention: bool = True,
               bitwise_thresholds: bool = True, tree=None, acceptance=None,
               max_rows: int | None = None, cost=None):
    """weight_dtype 'bfloat16': the weight matrices (ndim >= 2: projections, embedding)
    stored in bfloat16 for decoding, half the bytes a step reads; products accumulate
    in float32, norms, activations and KV caches stay in the model's dtype.
    cache_layout: decode_ops.CACHE_LAYOUTS (default: decode_ops.default_cache_layout()).
    tall_attention / bitwise_thresholds: the faster forms of the few-query attention
    products on CPU (decode_ops.tall_attention) and of the top-k / top-p thresholds
    (Sampling.bitwise); False compiles the earlier forms, for comparing the two.
    tree: draft a static tree instead of a chain (tree.parse_tree: `3,2,1` or `0;1;0.0`);
    'auto': the shape the picker (picker.py) expects fastest on this backend, chain or
    tree, per program shape; `generate(num_drafts='auto')` picks among chains only.
    Both need `acceptance` (acceptance.Acceptance: the model's measured rates for the
    sampling setting decoded with); the backend's cost model is calibrated on first use
    (cost.calibrate, cached on disk) unless `cost` gives one (cost.IterationCost: e.g. a
    TPU or GPU target's, priced by its compiler). max_rows: the picker's row budget.
    """
    if weight_dtype not in WEIGHT_DTYPES:
      raise RequestError(f'weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}')
    layout = cache_layout or decode_ops.default_cache_layout()
    if layout not in decode_ops.CACHE_LAYOUTS:
      raise RequestError(f'cache_layout must be one of {decode_ops.CACHE_LAYOUTS}, got {layout!r}')
    self.args = model.args
    self.auto = tree == AUTO
    self.tree = None if tree is None or self.auto else tree_lib.check_tree(model.args, tree)
    self.acceptance, self.max_rows = acceptance, max_rows or picker_lib.MAX_ROWS
    self.cost = cost
    self.choices = {}  # (batch, prompt bucket, new bucket, sampling, chains only) -> Choice
    self.weight_dtype, self.layout = weight_dtype, layout
    self.tall_attention, self.bitwise_thresholds = bool(tall_attention), bool(bitwise_thresholds)
    # The decode layout (decode_ops.DecodeWeight): the decode path's matrices transposed and
    # fused once here, on a copy; the caller's model is untouched.
    self.graphdef, params = nnx.split(model.for_decoding(layout))
    if weight_dtype != 'float32':
      wdt = jnp.dtype(weight_dtype)
      params = jax.tree.map(
          lambda x: x.astype(wdt) if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating)
          else x, params)
    # Programs are compiled for the default device, this process's first; a restored or
    # trained state may carry a mesh sharding.
    self.params = jax.device_put(params, jax.local_devices()[0])
    self._leaves, self._treedef = jax.tree.flatten(self.params)
    self._programs = {}  # this Decoder's view of _COMPILED (hashing a graphdef is slow)

  def with_tree(self, tree) -> Decoder:
    """A Decoder over these weights (no copy, no new layout) drafting `tree` (None: the
    chain; 'auto': the picker's shape)."""
    new = object.__new__(type(self))
    new.__dict__.update(self.__dict__)
    new.auto = tree == AUTO
    new.tree = None if tree is None or new.auto else tree_lib.check_tree(self.args, tree)
    new.choices = {} if new.auto != self.auto else self.choices
    return new

  def pass_functions(self, prog: Program):
    """pass_functions(prog) of this model, and the (trunk, MTP) caches they read."""
    return (*pass_functions(self.graphdef, self._treedef, prog),
            jax.jit(functools.partial(pass_caches, self.graphdef, self._treedef, prog))(
                self._leaves))

  def choose(self, batch: int, prompt_len: int, max_new: int, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, chains_only: bool = False,
             log=lambda s: None) -> picker_lib.Choice:
    """The picker's shape for this program shape (memoized; calibrates on first use)."""
    key = (batch, bucket(prompt_len), bucket(max_new),
           acceptance_lib.sampling_key(temperature, top_k, top_p), chains_only)
    if key in self.choices:
      return self.choices[key]
    acc = self.acceptance
    if acc is None:
      raise RequestError('an automatic draft shape needs the model\'s acceptance rates '
                         '(Decoder(..., acceptance=acceptance.measure(...)))')
    if acc.key() != acceptance_lib.sampling_key(temperature, top_k, top_p):
      raise RequestError(f'the acceptance rates were measured for {acc.key()}, not for '
                         f'{acceptance_lib.sampling_key(temperature, top_k, top_p)}')
    depth = cost_lib.max_depth(self.args)
    cost = self.cost or cost_lib.calibrate(self, batch, prompt_len, max_new,
                                           temperature=temperature, max_rows=self.max_rows,
                                           depth=depth, log=log)
    trees = not chains_only and self.args.mtp_head().chained
    self.choices[key] = picker_lib.choose(acc, cost, max_depth=depth, max_rows=self.max_rows,
                                          trees=trees)
    return self.choices[key]

  def program(self, batch: int, prompt_len: int, max_new: int, *, num_drafts=None,
              temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
              record: bool = False, draft_threshold: float = 0.0) -> Program:
    tree = self.tree
    if num_drafts == AUTO or (self.auto and num_drafts is None):
      chosen = self.choose(batch, prompt_len, max_new, temperature=temperature, top_k=top_k,
                           top_p=top_p, chains_only=num_drafts == AUTO or draft_threshold > 0)
      tree, num_drafts = chosen.tree, chosen.num_drafts
    drafting = self.args.drafting_depths()
    tree = tree_lib.program_tree(tree, num_drafts, draft_threshold)
    num_drafts = (tree.depth if tree else drafting) if num_drafts is None else num_drafts
    if drafting < self.args.mtp_depth:  # leap targets: only the adjacent prefix drafts
      if not 0 <= num_drafts <= drafting:
        raise RequestError(
            f'num_drafts must be in [0, {drafting}]: model.mtp.target_offsets '
            f'{self.args.mtp_target_offsets} let only the first {drafting} depth(s) draft '
            '(offsets 2, 3, ...); a leap depth does not predict the next position')
    limit = self.args.mtp_head().max_drafts(drafting)
    if not 0 <= num_drafts <= limit:
      raise RequestError(f'num_drafts must be in [0, {limit}] (the model\'s '
                         f'model.mtp.depth {drafting}; sequential modules recurse up to '
                         f'{MAX_DRAFTS}), got {num_drafts}')
    greedy = temperature == 0
    return Program(batch, bucket(prompt_len), bucket(max_new), num_drafts, greedy=greedy,
                   record=record, top_k=not greedy and top_k > 0,
                   top_p=not greedy and top_p < 1.0, layout=self.layout,
                   weights=self.weight_dtype, adaptive=draft_threshold > 0 and num_drafts > 0,
                   tall_attention=self.tall_attention,
                   bitwise_thresholds=self.bitwise_thresholds, tree=tree)

  def _inputs(self, prog, prompts, max_new, eos_id, temperature, top_k, top_p, seed,
              draft_argmax=False, draft_threshold=0.0):
    b = len(prompts)
    padded = np.zeros((b, prog.prompt_len), np.int32)
    for i, p in enumerate(prompts):
      padded[i, :len(p)] = p
    lens = np.array([len(p) for p in prompts], np.int32)
    max_new = np.broadcast_to(np.asarray(max_new, np.int32), (b,)).copy()
    sampling = Sampling(np.float32(temperature if temperature > 0 else 1.0),
                        np.int32(top_k), np.float32(top_p), np.bool_(draft_argmax),
                        use_top_k=prog.top_k, use_top_p=prog.top_p,
                        bitwise=prog.bitwise_thresholds)
    return (self._leaves, padded, lens, max_new, np.int32(-1 if eos_id is None else eos_id),
            sampling, np.int32(seed), np.float32(draft_threshold))

  def compile(self, prog: Program):
    """The ahead-of-time compiled program (cached), so timings exclude compilation."""
    if prog in self._programs:
      return self._programs[prog]
    key = (self.graphdef, prog)
    if key not in _COMPILED:
      example = self._inputs(prog, [[0]] * prog.batch, 1, 1, 0.0, 0, 1.0, 0)
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)),
                              example)
      fn = jax.jit(functools.partial(decode_program, prog, self.graphdef, self._treedef))
      with decode_ops.tall_attention(prog.tall_attention):  # read while tracing
        _COMPILED[key] = fn.lower(*abstract).compile()
    self._programs[prog] = _COMPILED[key]
    return _COMPILED[key]

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
               num_drafts: int | None = None, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, eos_id: int | None = 1, seed: int = 0,
               draft_argmax: bool = False, draft_threshold: float = 0.0,
               max_len: int | None = None, pad_to: tuple[int, int] = (1, 1),
               record: bool = False) -> DecodeResult:
    """Decodes a batch of token-id prompts (different lengths allowed).

    max_new_tokens: one int or one per row. num_drafts: drafting depths to use (default
    all of the model's; 0 = plain autoregressive decoding). temperature 0 is greedy;
    otherwise drafts are sampled from the MTP heads' adjusted distributions (or taken
    by argmax with draft_argmax) and accepted by the speculative sampling rule.
    draft_threshold > 0: confidence-adaptive draft length; a row proposes its drafts up
    to the first drawn from a distribution whose largest probability is below the
    threshold, and each iteration verifies the narrowest static window that holds
    every row's proposals (Program.verify_widths). Lossless either way: the stop is
    decided from the drafts' side alone.
    eos_id None: never stop early. max_len: limit on prompt + new tokens per row.
    pad_to: (prompt length, max_new_tokens) to size the program for at least, so calls
    with different requests can share one compiled program.
    """
    check_request(prompts, max_new_tokens, temperature, top_k, top_p,
                  vocab_size=self.args.vocab_size, max_len=max_len)
    if not 0 <= draft_threshold <= 1:
      raise RequestError(f'draft_threshold must be in [0, 1], got {draft_threshold}')
    mn = np.broadcast_to(np.asarray(max_new_tokens), (len(prompts),))
    prog = self.program(len(prompts), max(pad_to[0], *(len(p) for p in prompts)),
                        max(pad_to[1], int(mn.max())),
                        num_drafts=num_drafts, temperature=temperature, top_k=top_k,
                        top_p=top_p, record=record, draft_threshold=draft_threshold)
    fn = self.compile(prog)
    inputs = self._inputs(prog, prompts, mn, eos_id, temperature, top_k, top_p, seed,
                          draft_argmax, draft_threshold)
    t0 = time.perf_counter()
    st = jax.block_until_ready(fn(*inputs))
    seconds = time.perf_counter() - t0
    h = {k: np.asarray(getattr(st, k)) for k in (
        'tokens', 'length', 'prompt_len', 'step', 'verify_steps', 'committed', 'accepted',
        'dropped', 'verify_rows', 'history_drafts', 'history_length')}
    steps = int(h['step'])
    return DecodeResult(
        tokens=[h['tokens'][i, h['prompt_len'][i]:h['length'][i]] for i in range(len(prompts))],
        num_drafts=prog.num_drafts, steps=steps, verify_steps=h['verify_steps'],
        tree=prog.tree, flops_per_iteration=tree_lib.flops_per_iteration(
            self.args, prog.tree, prog.num_drafts),
        committed=h['committed'], accepted=h['accepted'], dropped=h['dropped'],
        verify_rows=h['verify_rows'], seconds=seconds,
        history_drafts=h['history_drafts'][:steps] if record else None,
        history_length=h['history_length'][:steps] if record else None)

  def generate_batched(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                       batch_size: int, warm_up: bool = False, **kw) -> DecodeResult:
    """generate() over consecutive batches of batch_size prompts, as one result.

    The last batch is filled up with copies of its first prompt, so every call runs the
    same compiled program; those rows are left out of the result. warm_up: first run
    one short untimed call (a program's first runs are slower), so `seconds` measures
    decoding only. kw: generate()'s keyword arguments.
    """
    chunks = [list(prompts[i:i + batch_size]) for i in range(0, len(prompts), batch_size)]
    fill = lambda c: c + [c[0]] * (batch_size - len(c))  # noqa: E731 one static batch shape
    if warm_up:
      self.generate(fill(chunks[0]), min(2, max_new_tokens), **kw)
    return _merge_results([(self.generate(fill(c), max_new_tokens, **kw), len(c))
                           for c in chunks])


def check_request(prompts, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, *,
                  vocab_size: int | None = None, max_len: int | None = None) -> None:
  """RequestError naming the problem, for a request that cannot be decoded."""
  if len(prompts) == 0:
    raise RequestError('no prompts given')
  mn = np.asarray(max_new_tokens)
  if mn.ndim > 1 or (mn.ndim == 1 and mn.shape[0] != len(prompts)):
    raise RequestError('max_new_tokens must be one int or one per prompt')
  if np.any(mn <= 0):
    raise RequestError(f'max_new_tokens must be > 0, got {max_new_tokens}')
  for i, p in enumerate(prompts):
    if len(p) == 0:
      raise RequestError(f'prompt {i} is empty')
    if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
      raise RequestError(f'prompt {i} has token ids outside [0, {vocab_size})')
    if max_len is not None:
      n_new = int(mn if mn.ndim == 0 else mn[i])
      if len(p) >= max_len:
        raise RequestError(f'prompt {i} has {len(p)} tokens: longer than the cache '
                           f'({max_len} positions, --max_len)')
      if len(p) + n_new > max_len:
        raise RequestError(f'prompt {i} ({len(p)} tokens) + max_new_tokens ({n_new}) exceeds '
                           f'the cache ({max_len} positions, --max_len)')
  if not temperature >= 0:
    raise RequestError(f'temperature must be >= 0, got {temperature}')
  if top_k < 0:
    raise RequestError(f'top_k must be >= 0, got {top_k}')
  if not 0 < top_p <= 1:
    raise RequestError(f'top_p must be in (0, 1], got {top_p}')


def _merge_results(parts) -> DecodeResult:
  """One DecodeResult from batches, keeping only the real (not padding) rows."""
  r0 = parts[0][0]
  rows = {k: np.concatenate([getattr(r, k)[:n] for r, n in parts]) for k in (
      'verify_steps', 'committed', 'accepted', 'dropped', 'verify_rows')}
  return DecodeResult(
      tokens=[t for r, n in parts for t in r.tokens[:n]], num_drafts=r0.num_drafts,
      steps=sum(r.steps for r, _ in parts), seconds=sum(r.seconds for r, _ in parts),
      tree=r0.tree, flops_per_iteration=r0.flops_per_iteration, **rows)


def __getattr__(name: str):  # a name an earlier release had here: mtp_jax.MOVED_NAMES
  return mtp_jax.moved_name(__name__, name)
