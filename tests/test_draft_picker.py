"""The automatic draft shape's parts without a model: acceptance records, the expected tau
of a shape, the cost model's tables and cache, and the picker's search.

The picker's shapes decoded losslessly (greedy and sampled) are in test_decode.py.
"""
import itertools
import json

import numpy as np
import pytest

from mtp_jax.decode import acceptance as acc_lib
from mtp_jax.decode import cost as cost_lib
from mtp_jax.decode import picker
from mtp_jax.decode import tree as tree_lib


def rates(*rows):
  return acc_lib.Acceptance([list(r) for r in rows], [100] * len(rows))


def test_expected_tau_chain_and_tree():
  """tau = 1 + the sum over nodes of the product of the rates along the node's path."""
  acc = rates((0.6, 0.2), (0.5, 0.3), (0.4, 0.1))
  assert acc.expected_tau(None, 0) == 1.0
  assert acc.expected_tau(None, 2) == pytest.approx(1 + 0.6 + 0.6 * 0.5)
  t = tree_lib.parse_tree('0;1;0.0;1.0;0.1')
  want = 1 + 0.6 + 0.2 + 0.6 * 0.5 + 0.2 * 0.5 + 0.6 * 0.3
  assert acc.expected_tau(t) == pytest.approx(want)
  # past the measured depths the deepest one's rates, past the ranks nothing
  assert acc.expected_tau(None, 4) == pytest.approx(1 + 0.6 + 0.3 + 0.12 + 0.048)
  assert acc.rate(1, 5) == 0.0


def _closed_trees(max_nodes, depth, ranks):
  """Every valid tree of at most max_nodes nodes whose siblings' ranks are contiguous."""
  nodes = [p for d in range(1, depth + 1) for p in itertools.product(range(ranks), repeat=d)]
  for n in range(1, max_nodes + 1):
    for combo in itertools.combinations(nodes, n):
      s = set(combo)
      if all((len(p) == 1 or p[:-1] in s) and (p[-1] == 0 or p[:-1] + (p[-1] - 1,) in s)
             for p in combo):
        yield tree_lib.parse_tree(list(combo))


def test_best_trees_are_the_most_likely_nodes():
  """best_trees' tree of n nodes has the largest expected tau of every valid tree of n nodes
  and that depth limit (brute force over all of them)."""
  acc = rates((0.7, 0.2, 0.05), (0.5, 0.3, 0.1), (0.8, 0.1, 0.05))
  for depth in (1, 2, 3):
    best = picker.best_trees(acc, depth, 5, 3)
    brute = {}
    for t in _closed_trees(5, depth, 3):
      brute[t.size] = max(brute.get(t.size, 0), acc.expected_tau(t))
    for n, t in best.items():
      assert t.depth <= depth
      assert acc.expected_tau(t) == pytest.approx(brute[n]), (depth, n, str(t))


def flat_cost(verify_per_row=0.0, block_per_row=0.0, base=1.0, per_depth=0.1):
  rows = range(1, 65)
  return cost_lib.IterationCost(
      verify={str(r): 1.0 + verify_per_row * r for r in rows},
      block={str(r): 0.1 + block_per_row * r for r in rows},
      logits={str(r): 0.01 * r for r in rows}, base=base, per_depth=per_depth)


def test_cost_of_a_chain_and_a_tree():
  """The iteration's windows: chain A verifies A+1 rows, depth k's block runs A+k rows with
  one logit row; a tree's depth k runs A+1+N_<k rows, its logits one row per parent."""
  c = cost_lib.IterationCost(verify={'1': 1.0, '4': 2.0, '8': 3.0},
                             block={'4': 0.5, '8': 0.7, '12': 0.9}, logits={'1': 0.1, '4': 0.2},
                             base=0.25, per_depth=0.05, tree_extra=0.5)
  # chain 3: verify 4 rows; blocks of 4, 5, 6 rows (read at 4, 8, 8); 3 logit rows
  assert c.seconds(None, 3) == pytest.approx(2.0 + 0.5 + 0.7 + 0.7 + 3 * 0.1 + 0.25 + 0.15)
  t = tree_lib.parse_tree('2,1')  # 4 nodes, depth 2: windows 3 + 0 and 3 + 2 rows
  p = c.parts(t)
  assert p == {'verify_rows': 5, 'depths': [(3, 1), (5, 2)]}
  assert c.seconds(t) == pytest.approx(3.0 + 0.5 + 0.1 + 0.7 + 0.2 + 0.25 + 0.1 + 0.5)
  assert c.seconds(None, 0) == pytest.approx(1.25)
  c.ar = 0.75  # plain decoding's step as its whole program measured it
  assert c.seconds(None, 0) == 0.75 and c.seconds(None, 0, overheads=False) == 1.0
  assert cost_lib._lookup({'4': 1.0, '8': 2.0}, 12) == pytest.approx(3.0)  # past: linear


def test_picker_follows_the_cost_of_rows():
  """Free verify rows and a weak first guess: a tree; dear rows: a chain or plain decoding;
  the line names the choice and its expected speed-up."""
  weak = rates((0.5, 0.3, 0.1), (0.6, 0.2, 0.1), (0.6, 0.2, 0.1))
  free = picker.choose(weak, flat_cost(), max_depth=3, max_rows=16)
  assert free.tree is not None and free.tree.size >= 6
  assert free.best.tokens_per_second == max(c.tokens_per_second for c in free.ranked)
  dear = picker.choose(weak, flat_cost(verify_per_row=1.0, block_per_row=0.3), max_depth=3)
  assert dear.tree is None
  strong = rates((0.95, 0.02), (0.95, 0.02), (0.95, 0.02))
  chain = picker.choose(strong, flat_cost(verify_per_row=0.3, block_per_row=0.05), max_depth=3)
  assert chain.tree is None and chain.num_drafts == 3
  line = chain.line()
  assert line.startswith('auto: chain of 3 (4 rows): expected tau') and 'x AR' in line
  only = picker.choose(weak, flat_cost(), max_depth=3, trees=False)
  assert only.tree is None and only.num_drafts == 3
  assert all(c.tree is None for c in only.ranked)
  assert all(c.rows <= 16 for c in free.ranked)


def test_from_records_reads_the_taken_rank():
  """A recorded probe-tree decode (2 depths x 2 ranks, nodes 0, 1, 0.0, 0.1) read back into
  hits per depth and rank, the row's last iteration left out."""
  tree = acc_lib.probe_tree(2, 2)
  assert [str(p) for p in tree.paths] == ['(0,)', '(1,)', '(0, 0)', '(0, 1)']
  # node tokens per iteration [it, B=1, N=4]; n before each iteration
  drafts = np.array([[[5, 6, 7, 8]], [[9, 10, 11, 12]], [[13, 14, 15, 16]], [[1, 1, 1, 1]]])
  length = np.array([[11], [14], [16], [17]])  # commits 3 (0, 0.1 + bonus), 2, 1, (last)
  toks = np.array([4, 5, 8, 30, 10, 31, 32, 33, 34])  # toks[0] is position 10
  hits, trials = acc_lib.from_records(tree, [toks], drafts, length)
  # it 0: depth 1 rank 0 (5), depth 2 rank 1 (8); it 1: depth 1 rank 1 (10) then a leaf;
  # it 2: depth 1 nothing (32 is no child)
  np.testing.assert_array_equal(trials, [3, 1])
  np.testing.assert_array_equal(hits, [[1, 1], [0, 1]])


def test_acceptance_stored_with_the_workdir(tmp_path):
  acc = rates((0.5, 0.25), (0.4, 0.1))
  acc.temperature = 1.0
  acc_lib.store(str(tmp_path), acc)
  acc_lib.store(str(tmp_path), rates((0.9,), (0.8,)))  # greedy: a second entry
  assert acc_lib.load(str(tmp_path), 1.0).rates == acc.rates
  assert acc_lib.load(str(tmp_path), 0.0).rates == [[0.9], [0.8]]
  assert acc_lib.load(str(tmp_path), 0.7) is None
  assert acc_lib.load(str(tmp_path), 1.0, depths=3) is None  # too shallow for the picker
  data = json.loads((tmp_path / acc_lib.FILE).read_text())
  assert set(data) == {'greedy', 'T=1 top_k=0 top_p=1'}


def test_row_grid_covers_the_budget():
  assert cost_lib.grid(4) == (1, 2, 3, 4)
  assert cost_lib.grid(17) == (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 17)
  assert cost_lib.grid(70)[-1] == 70
