"""Tree drafting: the MTP modules propose a static tree of continuations and the main model
verifies every node in one pass (docs/decoding.md "Tree drafting").

A tree is fixed per program. Node 0 is the root, the last committed token x at position
n-1; node i = 1..N is a path of sibling ranks (r_1, .., r_j): the r_j-th candidate that
drafting depth j proposes after the path (r_1, .., r_{j-1}), at position n-1+j. Nodes are
in breadth-first order, so a node's parent comes before it and the nodes of depths < k
are the prefix 1..N_{<k}. `3,2,1` is the full tree of 3 candidates at depth 1, 2 after
each of them, 1 after each of those (15 nodes).

Every cached pass here runs one window over a cache: C "catch-up" entries at positions
s..s+C-1, then nodes 1..n; node i sits at position s + a + depth(i) (a: the row's last
true catch-up index) and window index C - 1 + i. A catch-up query sees the slots before
the window and the catch-up entries up to its own; a node sees the slots before the
window, the catch-up entries up to a and its own ancestors (itself included): exactly
an uncached forward over [committed ; the node's path]. Entries at negative positions
are masked out, as in the chain's windows.
  verify   C = 1, a = 0: x at n-1 and the N nodes, one main-model pass; the longest
           path the main model agrees with is accepted, and its main-cache entries move
           to slots n-1..n-1+a (move_slots): the rest are never read again.
  depth k  C = A+1 (the prefill: the prompt bucket) catch-up entries at n-k.., as the
           chain's (decoder.py): the committed tokens, true up to index a, then the
           nodes of depths 1..k-1, each reading its own token and h^{k-1} of its parent.
           Depth k's logits at the root (catch-up index a, k = 1) or at the depth-(k-1)
           nodes propose their children: depth k runs once per kept prefix, batched.
The MTP caches get the accepted path's entries from the next catch-up, as in the chain.

Sampling: children are drawn independently from their parent's adjusted distribution q
(draft_argmax: the top-ranked tokens of q, each a one-hot proposal), and each node's
children are tried in turn by recursive rejection (SpecInfer): accept child c with
probability min(1, p(c) / q_c(c)); on rejection p <- normalize(max(p - q_c, 0)); the
bonus is drawn from what is left of p. Each try is one speculative-sampling step towards
the current p, so the committed tokens follow the main model's distribution.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

import mtp_jax.decode.sampling as sampling_lib
from mtp_jax.decode.sampling import PAD_ID, row_keys, take_rows
from mtp_jax.errors import RequestError
from mtp_jax.model import decode_ops
from mtp_jax.model.blocks import block_classes

Array = jax.Array
MAX_TREE_NODES = 63  # verify rows = nodes + 1, within decode_ops.TALL_ROWS at batch 1
MAX_RANK = 16  # candidates one node may propose


@dataclasses.dataclass(frozen=True)
class Tree:
  """A static draft tree: node i = paths[i - 1], a tuple of sibling ranks (BFS order)."""
  paths: tuple

  @property
  def size(self) -> int:  # N: drafted nodes (the root excluded)
    return len(self.paths)

  @property
  def depth(self) -> int:  # A: drafting depths used
    return max(map(len, self.paths))

  @functools.cached_property
  def depths(self) -> np.ndarray:  # [N+1], the root's 0
    return np.array([0] + [len(p) for p in self.paths], np.int32)

  @functools.cached_property
  def parents(self) -> np.ndarray:  # [N+1], the root's -1
    index = {p: i for i, p in enumerate(self.paths, 1)}
    return np.array([-1] + [index.get(p[:-1], 0) for p in self.paths], np.int32)

  def below(self, k: int) -> int:
    """N_{<k}: nodes of depths 1..k-1."""
    return int(np.sum(self.depths[1:] < k))

  @functools.cached_property
  def children(self) -> np.ndarray:
    """[N+1, max children]: each node's children in rank order, -1 past them."""
    kids = [[i for i in range(1, self.size + 1) if self.parents[i] == n]
            for n in range(self.size + 1)]
    out = np.full((self.size + 1, max(map(len, kids))), -1, np.int32)
    for n, ks in enumerate(kids):
      out[n, :len(ks)] = sorted(ks, key=lambda i: self.paths[i - 1][-1])
    return out

  @functools.cached_property
  def ancestors(self) -> np.ndarray:
    """[N+1, N+1] bool: [i, j] = node j is node i or one of its ancestors."""
    out = np.eye(self.size + 1, dtype=bool)
    for i in range(1, self.size + 1):
      out[i] |= out[self.parents[i]]
    return out

  def __str__(self) -> str:
    counts = [int(np.sum(self.depths == d)) for d in range(1, self.depth + 1)]
    widths = [c // max(prev, 1) for c, prev in zip(counts, [1] + counts[:-1])]
    if min(widths) >= 1 and int(np.sum(np.cumprod(widths))) == self.size:
      if self == parse_tree(widths):
        return ','.join(map(str, widths))
    return ';'.join('.'.join(map(str, p)) for p in self.paths)


def parse_tree(spec) -> Tree:
  """A Tree from a shape (`3,2,1` or (3, 2, 1): candidates per depth) or an explicit node
  list (`0;1;0.0;0.1;0.0.0`, or a sequence of rank tuples); RequestError when invalid."""
  if isinstance(spec, Tree):
    return spec
  if isinstance(spec, str):
    text = spec.replace(' ', '')
    try:
      if ';' in text or '.' in text:
        spec = [tuple(int(r) for r in node.split('.')) for node in text.split(';') if node]
      else:
        spec = [int(c) for c in text.split(',') if c]
    except ValueError:
      raise RequestError(f'tree {spec!r}: give candidates per depth (3,2,1) or nodes as '
                         'rank paths (0;1;0.0)') from None
  spec = list(spec)
  if not spec:
    raise RequestError('tree is empty')
  if all(isinstance(c, (int, np.integer)) for c in spec):  # a shape
    if any(c < 1 or c > MAX_RANK for c in spec):
      raise RequestError(f'tree shape {spec}: candidates per depth must be in [1, {MAX_RANK}]')
    if int(np.sum(np.cumprod(spec))) > MAX_TREE_NODES:
      raise RequestError(f'tree shape {spec} has {int(np.sum(np.cumprod(spec)))} nodes; '
                         f'at most {MAX_TREE_NODES}')
    spec = [p for d in range(1, len(spec) + 1)
            for p in itertools.product(*[range(c) for c in spec[:d]])]
  paths = [tuple(int(r) for r in p) for p in spec]
  if len(set(paths)) != len(paths):
    raise RequestError('tree lists a node twice')
  if len(paths) > MAX_TREE_NODES:
    raise RequestError(f'tree has {len(paths)} nodes; at most {MAX_TREE_NODES}')
  for p in paths:
    if not p or min(p) < 0 or max(p) >= MAX_RANK:
      raise RequestError(f'tree node {p}: ranks must be in [0, {MAX_RANK})')
    if len(p) > 1 and p[:-1] not in set(paths):
      raise RequestError(f'tree node {".".join(map(str, p))} has no parent in the tree')
  return Tree(tuple(sorted(paths, key=lambda p: (len(p), p))))


# -- windows over a cache ----------------------------------------------------------------------
def window(prog, start_B, a_B, catch_up: int, nodes: int):
  """Positions [B, W] and mask [B, 1, W, S] of a window of `catch_up` entries from start_B,
  then nodes 1..nodes of prog.tree (module docstring)."""
  tree, c, w = prog.tree, catch_up, catch_up + nodes
  pos = jnp.concatenate([start_B[:, None] + jnp.arange(c, dtype=jnp.int32),
                         (start_B + a_B)[:, None] + jnp.asarray(tree.depths[1:nodes + 1])], 1)
  rel = np.zeros((w, w), bool)  # query e sees window entry e'
  rel[:c, :c] = np.tril(np.ones((c, c), bool))
  rel[c:, :c] = True
  rel[c:, c:] = tree.ancestors[1:nodes + 1, 1:nodes + 1]
  e = jnp.arange(w)
  upto_a = (e[None, :] <= a_B[:, None]) | (e[None, :] >= c)  # nodes see catch-up <= a
  sees = (jnp.asarray(rel)[None] & (pos[:, None, :] >= 0)
          & (upto_a[:, None, :] | (e[None, :, None] < c)))  # [B, W, W]
  slot_pos = jnp.arange(prog.cache_len, dtype=jnp.int32) - prog.offset
  r = slot_pos[None, :] - start_B[:, None]  # [B, S]: window index of each slot
  idx = jnp.broadcast_to(jnp.clip(r, 0, w - 1)[:, None, :], (r.shape[0], w, r.shape[1]))
  inside = jnp.take_along_axis(sees, idx, 2) & ((r >= 0) & (r < w))[:, None, :]
  mask = inside | ((r < 0) & (slot_pos >= 0)[None, :])[:, None, :]
  return pos, mask[:, None]


def move_slots(caches: tuple, layout: str, src_BxT, dst_B) -> tuple:
  """Each layer's cache entries at slots src_BxT[b] moved to slots dst_B[b]..: the accepted
  path to consecutive positions (decode_ops.cache_slot_axes names the slot axes)."""
  b = src_BxT.shape[0]

  def move(x, axis):
    rows = x.reshape((b, x.shape[0] // b) + x.shape[1:])
    vals = jax.vmap(lambda c, s: jnp.take(c, s, axis=axis))(rows, src_BxT)
    return decode_ops.write_heads_major(x, vals, dst_B, axis)

  return tuple(tuple(move(x, ax) for x, ax in zip(c, decode_ops.cache_slot_axes(c, layout)))
               for c in caches)


# -- verify and accept ----------------------------------------------------------------------
def verify(prog, model, x_B, drafts_BxN, q_BxNxV, start_B, caches, sampling, keys_B):
  """One main-model pass over [x ; every node], the accepted path, its cache entries moved.

  Returns (h^0 along the path [B, A+1, D] (true up to a), main caches, a [B], candidates
  [B, A+1]: the a accepted drafts, the bonus, then PAD_ID; the rows verified, N + 1).
  """
  tree = prog.tree
  tokens = jnp.concatenate([x_B[:, None], drafts_BxN], 1)
  pos, mask = window(prog, start_B, jnp.zeros_like(start_B), 1, tree.size)
  h0, caches = model.decode_trunk(tokens, pos, mask, caches, start_B + prog.offset, prog.layout)
  b, w, d = h0.shape
  logits = model.decode_logits(h0.reshape(b * w, d), 0).reshape(b, w, -1)
  a, path, cand = accept(prog.greedy, tree, logits, tokens, q_BxNxV, sampling, keys_B)
  caches = move_slots(caches, prog.layout, path + (start_B + prog.offset)[:, None],
                      start_B + prog.offset)
  return jnp.take_along_axis(h0, path[..., None], 1), caches, a, cand, w


def accept(greedy: bool, tree: Tree, logits_BxWxV, tokens_BxW, q_BxNxV, sampling, keys_B):
  """(a [B], path [B, A+1] node ids (root first; the last one repeated past a), cand [B, A+1]).

  Greedy: follow the child whose token is the main model's argmax. Sampling: recursive
  rejection over each node's children (module docstring).
  """
  b, dn = tokens_BxW.shape[0], tree.depth
  rows = jnp.arange(b)
  kids_table = jnp.asarray(tree.children)
  cur = jnp.zeros((b,), jnp.int32)
  alive = jnp.ones((b,), bool)
  a = jnp.zeros((b,), jnp.int32)
  path = [cur]
  if greedy:
    g = jnp.argmax(logits_BxWxV, -1).astype(jnp.int32)  # [B, W]
    for _ in range(dn):
      kids = kids_table[cur]
      match = (kids >= 0) & (jnp.take_along_axis(tokens_BxW, jnp.maximum(kids, 0), 1)
                             == take_rows(g, cur)[:, None])
      found = alive & jnp.any(match, 1)
      cur = jnp.where(found, take_rows(kids, jnp.argmax(match, 1)), cur)
      a, alive = a + found, found
      path.append(cur)
    path = jnp.stack(path, 1)
    cand = jnp.take_along_axis(g, path, 1)  # node j+1 of the path is g at node j
    return a, path, jnp.where(jnp.arange(dn + 1) <= a[:, None], cand, PAD_ID)
  p = sampling_lib.adjusted_probs(logits_BxWxV, sampling)  # [B, W, V]
  u = jax.vmap(lambda k: jax.random.uniform(k, (dn, kids_table.shape[1])))(row_keys(keys_B, 2))
  r = p[:, 0]
  last = jnp.zeros_like(r)  # the distribution the bonus is drawn from
  for depth in range(dn):
    kids = kids_table[cur]
    taken, nxt = jnp.zeros((b,), bool), cur
    for c in range(kids.shape[1]):
      kid = kids[:, c]
      valid = alive & (kid >= 0) & ~taken
      node = jnp.maximum(kid, 1) - 1
      tok = take_rows(tokens_BxW, jnp.maximum(kid, 0))
      q = take_rows(q_BxNxV, node)  # [B, V]
      ok = valid & (u[:, depth, c] * q[rows, tok] < r[rows, tok])  # min(1, p / q)
      res = jnp.maximum(r - q, 0.0)
      total = jnp.sum(res, -1, keepdims=True)
      res = jnp.where(total > 0, res / jnp.where(total > 0, total, 1.0), r)  # p == q: kept
      r = jnp.where((valid & ~ok)[:, None], res, r)
      taken, nxt = taken | ok, jnp.where(ok, kid, nxt)
    last = jnp.where((alive & ~taken)[:, None], r, last)
    cur, a, alive = jnp.where(taken, nxt, cur), a + taken, taken
    r = jnp.where(taken[:, None], take_rows(p, cur), r)
    path.append(cur)
  last = jnp.where(alive[:, None], r, last)  # accepted down to a leaf: p there
  bonus = sampling_lib.categorical(row_keys(keys_B, 3), last)
  path = jnp.stack(path, 1)
  j = jnp.arange(dn + 1)
  drafted = jnp.take_along_axis(tokens_BxW, jnp.concatenate([path[:, 1:], path[:, -1:]], 1), 1)
  cand = jnp.where(j < a[:, None], drafted, jnp.where(j == a[:, None], bonus[:, None], PAD_ID))
  return a, path, cand


# -- drafting ------------------------------------------------------------------------------------
def _children(prog, logits_BxPxV, parent_slot: dict, depth: int, sampling, keys_B):
  """Tokens and proposal distributions of the depth-`depth` nodes: {node: (tok [B], q)}."""
  tree = prog.tree
  nodes = [i for i in range(1, tree.size + 1) if tree.depths[i] == depth]
  ranks = 1 + max(tree.paths[i - 1][-1] for i in nodes)
  out = {}
  if prog.greedy:
    top = jax.lax.top_k(logits_BxPxV, ranks)[1].astype(jnp.int32)
    for i in nodes:
      tok = top[:, parent_slot[tree.parents[i]], tree.paths[i - 1][-1]]
      out[i] = (tok, jnp.zeros((tok.shape[0], 0)))
    return out
  q_all = sampling_lib.adjusted_probs(logits_BxPxV, sampling)
  top = jax.lax.top_k(q_all, ranks)[1].astype(jnp.int32)
  for i in nodes:
    q = q_all[:, parent_slot[tree.parents[i]]]
    drawn = sampling_lib.categorical(row_keys(keys_B, i), q)
    ranked = top[:, parent_slot[tree.parents[i]], tree.paths[i - 1][-1]]
    tok = jnp.where(sampling.draft_argmax, ranked, drawn)
    one_hot = jax.nn.one_hot(ranked, q.shape[-1], dtype=q.dtype)
    out[i] = (tok, jnp.where(sampling.draft_argmax, one_hot, q))
  return out


def mtp_pass(prog, model, h0_BxCxD, start_B, u_BxU, a_B, hidden, caches, sampling, keys_B):
  """Catch-up and tree drafting, one block call per depth; the chain's _mtp_pass contract.

  h0_BxCxD: h^0 at positions start..start+C-1, true up to index a; u_BxU: t_{start+1}..
  Returns (node tokens [B, N], q [B, N, V or 0], ones [B, A], hidden, caches).
  """
  tree = prog.tree
  b, c, _ = h0_BxCxD.shape
  drafted = {}
  new_hidden, new_caches = [], []
  h_prev = h0_BxCxD
  for k in range(1, tree.depth + 1):
    n = tree.below(k)
    h_in = h0_BxCxD if k == 1 else jnp.concatenate([hidden[k - 2][:, None], h_prev[:, :c - 1]], 1)
    tok_in = u_BxU[:, :c]
    if n:  # the nodes of depths < k: their own token, their parent's h^{k-1}
      root = take_rows(h_prev, a_B)
      h_in = jnp.concatenate([h_in, jnp.stack(
          [root if p == 0 else h_prev[:, c - 1 + p] for p in tree.parents[1:n + 1]], 1)], 1)
      tok_in = jnp.concatenate([tok_in, jnp.stack([drafted[i][0] for i in range(1, n + 1)], 1)],
                               1)
    s = start_B - (k - 1)
    pos, mask = window(prog, s, a_B, c, n)
    h_k, cache = model.decode_mtp_step(k, h_in, tok_in, pos, mask, caches[k - 1],
                                       s + prog.offset, prog.layout)
    new_caches.append(cache)
    parents = sorted({int(tree.parents[i]) for i in range(1, tree.size + 1)
                      if tree.depths[i] == k})
    rows = jnp.stack([take_rows(h_k, a_B) if p == 0 else h_k[:, c - 1 + p] for p in parents], 1)
    logits = model.decode_logits(rows.reshape(b * len(parents), -1), k).reshape(
        b, len(parents), -1)
    drafted.update(_children(prog, logits, {p: j for j, p in enumerate(parents)}, k, sampling,
                             keys_B))
    if k < tree.depth:
      new_hidden.append(take_rows(h_k, a_B))
    h_prev = h_k
  order = range(1, tree.size + 1)
  return (jnp.stack([drafted[i][0] for i in order], 1),
          jnp.stack([drafted[i][1] for i in order], 1).astype(jnp.float32),
          jnp.ones((b, tree.depth)), tuple(new_hidden), tuple(new_caches))


# -- host side -----------------------------------------------------------------------------------
def check_tree(args, spec) -> Tree:
  """The Tree a model can draft (sequential modules, within their recursion limit)."""
  tree = parse_tree(spec)
  head = args.mtp_head()
  if not args.drafting_depths() or not head.chained:
    raise RequestError('tree drafting needs sequential MTP modules (model.mtp.kind '
                       'sequential, model.mtp.depth > 0)')
  limit = head.max_drafts(args.drafting_depths())
  if tree.depth > limit:
    raise RequestError(f'tree depth {tree.depth} exceeds the {limit} drafts this model '
                       'can make')
  if args.drafting_depths() < args.mtp_depth and tree.depth > args.drafting_depths():
    raise RequestError(f'tree depth {tree.depth}: only the first {args.drafting_depths()} '
                       'depth(s) draft (model.mtp.target_offsets)')
  return tree


def default_tree(depths: int) -> str:
  """The tree mtp-eval scores beside the chain: 3,2,1 cut to `depths`, then 1s."""
  return ','.join(map(str, ((3, 2, 1) + (1,) * max(0, depths - 3))[:depths]))


def program_tree(tree: Tree | None, num_drafts, draft_threshold) -> Tree | None:
  """The tree a Decoder's program drafts: none for autoregressive decoding (num_drafts 0)."""
  if tree is None or num_drafts == 0:
    return None
  if num_drafts not in (None, tree.depth) or draft_threshold > 0:
    raise RequestError(f'a tree decoder drafts its tree ({tree}): num_drafts must be 0 '
                       f'(autoregressive) or its depth {tree.depth}, draft_threshold 0')
  return tree


def flops_per_iteration(args, tree: Tree | None, num_drafts: int) -> dict | None:
  """Matmul FLOPs of one verify step's weights (attention over the cache left out): the
  main model's rows, the MTP blocks' rows and the drafting logits, for a chain of
  num_drafts drafts or a tree; None for autoregressive decoding."""
  if not num_drafts:
    return None
  if tree is None:
    main, mtp, heads = num_drafts + 1, sum(num_drafts + k for k in range(1, num_drafts + 1)), (
        num_drafts)
  else:
    main = tree.size + 1
    mtp = sum(tree.depth + 1 + tree.below(k) for k in range(1, tree.depth + 1))
    heads = len({int(p) for p in tree.parents[1:]})
  vocab = 2.0 * args.d_model * args.vocab_size
  trunk = sum(_block_flops(args, i) for i in range(args.n_layers))
  block = _block_flops(args, args.n_layers) + args.mtp_head().flops_per_token(args)
  return {'verify_rows': main, 'mtp_rows': mtp, 'draft_logit_rows': heads,
          'flops': main * (trunk + vocab) + mtp * block + heads * vocab}


def _block_flops(args, layer: int) -> float:
  attn_cls, mlp_cls = block_classes(args, layer)
  return attn_cls.flops_per_token(args, 0.0)[0] + mlp_cls.flops_per_token(args)
