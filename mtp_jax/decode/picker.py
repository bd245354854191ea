"""The draft shape with the most expected tokens per second: `--num_drafts auto`, `--tree auto`.

Expected tokens per iteration come from the measured acceptance rates (acceptance.py),
the iteration's time from this backend's cost model (cost.py); the picker takes the
shape with the largest tau / seconds among a bounded family, searched exhaustively:

  chains    0 (plain decoding), 1, .., A drafts (A: cost.max_depth, the model's drafting
            depths plus one recursive draft where sequential modules allow it);
  trees     for every depth limit d = 1..A and node count n up to the row budget (verify
            rows n + 1 <= max_rows), the n nodes of largest probability of being reached
            with depth <= d. Under the positional model a node is never likelier than
            its parent or its next-lower-ranked sibling, so these n nodes form a valid
            tree and it is the tree of n nodes (depth <= d) of largest expected tau;
            trees that are a single path are left to the chain's cheaper program.

Only the time depends on more than the node count and depth (the MTP windows and logit
rows per depth), so the best tau for each (n, d) priced by the cost model covers the
family's trade-offs; every candidate is priced exactly, none by a proxy.
"""
from __future__ import annotations

import dataclasses
import heapq

import mtp_jax.decode.tree as tree_lib
from mtp_jax.decode.acceptance import Acceptance
from mtp_jax.decode.cost import IterationCost

MAX_ROWS = 16  # default row budget: verified rows per batch row


@dataclasses.dataclass
class Candidate:
  tree: tree_lib.Tree | None
  num_drafts: int
  tau: float
  seconds: float  # one iteration

  @property
  def tokens_per_second(self) -> float:
    return self.tau / self.seconds

  @property
  def rows(self) -> int:
    return self.tree.size + 1 if self.tree else self.num_drafts + 1

  @property
  def name(self) -> str:
    if self.tree:
      return f'tree {self.tree}'
    return 'autoregressive' if not self.num_drafts else f'chain of {self.num_drafts}'


@dataclasses.dataclass
class Choice:
  """The chosen shape and the ranked family it was chosen from."""
  best: Candidate
  ranked: list  # every candidate, fastest first
  ar: Candidate
  cost: IterationCost
  acceptance: Acceptance

  @property
  def tree(self):
    return self.best.tree

  @property
  def num_drafts(self) -> int:
    return self.best.num_drafts

  @property
  def expected_speedup(self) -> float:
    return self.best.tokens_per_second / self.ar.tokens_per_second

  def line(self) -> str:
    """What it chose and why, in one line."""
    b = self.best
    others = [c for c in self.ranked if c is not b][:2]
    alt = '; '.join(f'{c.name}: {c.tokens_per_second / self.ar.tokens_per_second:.2f}x'
                    for c in others)
    return (f'auto: {b.name} ({b.rows} rows): expected tau {b.tau:.2f} in '
            f'{1e3 * b.seconds:.2f} ms an iteration = {self.expected_speedup:.2f}x AR '
            f'({1e3 * self.ar.seconds:.2f} ms a token), of {len(self.ranked)} shapes; next: '
            f'{alt}; acceptance {self.acceptance.key()} over {self.acceptance.prompts} '
            f'prompts, cost {self.cost.source}')

  def summary(self) -> dict:
    return {'auto_shape': str(self.tree) if self.tree else self.num_drafts,
            'auto_expected_tau': self.best.tau,
            'auto_expected_ms_per_iteration': 1e3 * self.best.seconds,
            'auto_expected_speedup': self.expected_speedup,
            'auto_shapes_considered': len(self.ranked)}


def best_trees(acc: Acceptance, depth: int, max_nodes: int, max_rank: int):
  """{nodes: Tree} for n = 1..max_nodes: the most likely n nodes of depth <= `depth`."""
  out = {}
  chosen = []
  frontier = [(-acc.node_prob((0,)), (0,))]
  while frontier and len(chosen) < max_nodes:
    negp, path = heapq.heappop(frontier)
    if -negp <= 0:
      break
    chosen.append(path)
    out[len(chosen)] = tree_lib.parse_tree(list(chosen))
    if path[-1] + 1 < max_rank:
      sib = path[:-1] + (path[-1] + 1,)
      heapq.heappush(frontier, (-acc.node_prob(sib), sib))
    if len(path) < depth:
      kid = path + (0,)
      heapq.heappush(frontier, (-acc.node_prob(kid), kid))
  return out


def candidates(acc: Acceptance, cost: IterationCost, *, max_depth: int,
               max_rows: int = MAX_ROWS, trees: bool = True) -> list:
  """Every shape of the family (module docstring), priced; fastest first."""
  out = [Candidate(None, a, acc.expected_tau(None, a), cost.seconds(None, a))
         for a in range(max_depth + 1)]
  if trees:
    seen = set()
    max_rank = max(len(r) for r in acc.rates) if acc.rates else 1
    for d in range(1, max_depth + 1):
      for t in best_trees(acc, d, max_rows - 1, max_rank).values():
        if t.size == t.depth or t.paths in seen:  # a path: the chain's program
          continue
        seen.add(t.paths)
        out.append(Candidate(t, t.depth, acc.expected_tau(t), cost.seconds(t)))
  return sorted(out, key=lambda c: -c.tokens_per_second)


def choose(acc: Acceptance, cost: IterationCost, *, max_depth: int, max_rows: int = MAX_ROWS,
           trees: bool = True) -> Choice:
  """The fastest shape by the two models (chains only with trees=False)."""
  ranked = candidates(acc, cost, max_depth=max_depth, max_rows=max_rows, trees=trees)
  ar = next(c for c in ranked if c.tree is None and c.num_drafts == 0)
  return Choice(ranked[0], ranked, ar, cost, acc)
