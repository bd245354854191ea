"""Acceptance statistics of a model's drafts, per depth and per sibling rank, and the
expected tokens a chain or tree commits per iteration under them.

`rates[k-1][r]` is the probability that the r-th candidate at depth k is the one taken,
given the path to its parent was taken: greedy, that the parent's r-th ranked token is the
main model's argmax; sampling, that the r-th child drawn is accepted by the recursive
rejection after children 0..r-1 were rejected (both independent of whether later
siblings exist, so a node with children 0..c-1 extends the path with probability
sum(rates[k-1][:c])). A node's probability of being reached is the product of the rates
along its path (the positional-acceptance model of Sequoia), and an iteration commits
1 + the sum of its nodes' probabilities on average (tau).

Measured by decoding held-out prompts with a probe tree (`probe_tree`): the chain of rank-0
candidates with `ranks` siblings at every depth, so every rank at every depth is tried
whenever the rank-0 path reaches its parent. The rates assume the rank-0 path's children
stand for every parent's (the model's measured tau checks it: benchmarks/tree_decode.py).
Stored with the workdir (`decode_acceptance.json`), one entry per sampling setting.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os

import numpy as np

import mtp_jax.decode.tree as tree_lib
from mtp_jax.errors import RequestError

FILE = 'decode_acceptance.json'
PROBE_RANKS = 4


@dataclasses.dataclass
class Acceptance:
  """rates [depths][ranks]; trials[k-1]: iterations in which depth k's rank-0 parent was
  reached (each rate's denominator)."""
  rates: list
  trials: list
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  prompts: int = 0
  new_tokens: int = 0
  measured_tau: float | None = None  # the probe tree's own tau, beside expected_tau(probe)
  date: str | None = None

  @property
  def depths(self) -> int:
    return len(self.rates)

  def rate(self, depth: int, rank: int) -> float:
    """rates[depth-1][rank]; past the measured depths the deepest one's, past the measured
    ranks 0."""
    if not self.rates:
      return 0.0
    row = self.rates[min(depth, self.depths) - 1]
    return float(row[rank]) if rank < len(row) else 0.0

  def node_prob(self, path) -> float:
    return float(np.prod([self.rate(k, r) for k, r in enumerate(path, 1)]))

  def expected_tau(self, tree: tree_lib.Tree | None = None, num_drafts: int = 0) -> float:
    """Expected tokens committed per iteration of a tree, or of a chain of num_drafts."""
    paths = tree.paths if tree is not None else [(0,) * k for k in range(1, num_drafts + 1)]
    return 1.0 + sum(self.node_prob(p) for p in paths)

  def key(self) -> str:
    return sampling_key(self.temperature, self.top_k, self.top_p)

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def sampling_key(temperature: float, top_k: int = 0, top_p: float = 1.0) -> str:
  if temperature == 0:
    return 'greedy'
  return f'T={temperature:g} top_k={int(top_k)} top_p={top_p:g}'


def probe_tree(depths: int, ranks: int = PROBE_RANKS) -> tree_lib.Tree:
  """The rank-0 chain of `depths` nodes, each rank-0 node with `ranks` children."""
  paths = [(0,) * (k - 1) + (r,) for k in range(1, depths + 1) for r in range(ranks)]
  return tree_lib.parse_tree(paths)


def from_records(tree: tree_lib.Tree, tokens, history_drafts, history_length):
  """(hits [depth][rank], trials [depth]) from a recorded probe-tree decode.

  tokens[b]: row b's generated tokens; history_drafts [iterations, B, N] the node tokens
  each iteration verified; history_length [iterations, B] the committed count n before it
  (-1 once done). An iteration commits a + 1 tokens from position n - 1 + 1: the accepted
  nodes' tokens, then the bonus, which never equals a tried child's token (greedy: it is
  the argmax no child matched; sampling: a rejected token has no mass left in the residual
  it is drawn from), so the taken child at each depth is the first child holding the
  committed token. The last iteration of a row (possibly cut at its end) is left out.
  """
  hits = np.zeros((tree.depth, int(tree.children.shape[1])), np.int64)
  trials = np.zeros(tree.depth, np.int64)
  kids = tree.children
  for b, toks in enumerate(tokens):
    steps = np.flatnonzero(history_length[:, b] >= 0)
    first = int(history_length[steps[0], b]) - 1 if len(steps) else 0  # toks[0]'s position
    for i, nxt in zip(steps[:-1], steps[1:]):
      n, m = int(history_length[i, b]), int(history_length[nxt, b] - history_length[i, b])
      block = toks[n - first:n - first + m]
      node = 0
      for k in range(1, min(m, tree.depth) + 1):
        children = [c for c in kids[node] if c >= 0]
        if not children:
          break
        full = len(children) == kids.shape[1]
        if full:
          trials[k - 1] += 1
        taken = next((c for c in children if history_drafts[i, b, c - 1] == block[k - 1]), None)
        if taken is None or k > m - 1:  # block[k-1] is the bonus: nothing taken at depth k
          break
        if full:
          hits[k - 1, tree.paths[taken - 1][-1]] += 1
        node = taken
  return hits, trials


def measure(decoder, prompts, max_new_tokens: int, *, depths: int, temperature: float = 0.0,
            top_k: int = 0, top_p: float = 1.0, ranks: int = PROBE_RANKS, seed: int = 0,
            batch_size: int = 1) -> Acceptance:
  """Decodes `prompts` with the probe tree and returns the measured rates.

  decoder: a Decoder (its model drafts the probe tree: sequential modules)."""
  tree = probe_tree(depths, ranks)
  probe = decoder.with_tree(tree)
  hits = np.zeros((depths, ranks), np.int64)
  trials = np.zeros(depths, np.int64)
  committed = steps = new = 0
  for i in range(0, len(prompts), batch_size):
    chunk = list(prompts[i:i + batch_size])
    r = probe.generate(chunk, max_new_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, eos_id=None, seed=seed + i, record=True)
    h, t = from_records(tree, r.tokens, r.history_drafts, r.history_length)
    hits += h
    trials += t
    committed += int(r.committed.sum())
    steps += int(r.verify_steps.sum())
    new += r.new_tokens
  rates = [[float(hits[k, j] / trials[k]) if trials[k] else 0.0 for j in range(ranks)]
           for k in range(depths)]
  return Acceptance(rates, trials.tolist(), float(temperature), int(top_k), float(top_p),
                    len(prompts), new, committed / max(steps, 1),
                    datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'))


# -- stored with the workdir ---------------------------------------------------------------
def path(workdir: str) -> str:
  return os.path.join(workdir, FILE)


def _from_json(entry: dict) -> Acceptance:
  fields = {f.name for f in dataclasses.fields(Acceptance)}
  return Acceptance(**{k: v for k, v in entry.items() if k in fields})


def load(workdir: str, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
         depths: int = 0) -> Acceptance | None:
  """The stored rates for this sampling setting (None when absent or shallower than
  `depths`)."""
  try:
    with open(path(workdir)) as f:
      entry = json.load(f).get(sampling_key(temperature, top_k, top_p))
  except (OSError, ValueError):
    return None
  if not entry:
    return None
  acc = _from_json(entry)
  return acc if acc.depths >= depths else None


def load_file(file: str, temperature: float = 0.0, top_k: int = 0,
              top_p: float = 1.0) -> Acceptance:
  """One setting's rates from a decode_acceptance.json; RequestError when it lacks them."""
  try:
    with open(file) as f:
      entry = json.load(f).get(sampling_key(temperature, top_k, top_p))
  except (OSError, ValueError) as e:
    raise RequestError(f'cannot read acceptance rates from {file!r}: {e}') from e
  if not entry:
    raise RequestError(f'{file!r} holds no acceptance rates for '
                       f'{sampling_key(temperature, top_k, top_p)}')
  return _from_json(entry)


def store(workdir: str, acc: Acceptance) -> str:
  """Adds (or replaces) this setting's entry in the workdir's file; returns its path."""
  p = path(workdir)
  try:
    with open(p) as f:
      data = json.load(f)
  except (OSError, ValueError):
    data = {}
  data[acc.key()] = acc.to_json()
  tmp = f'{p}.{os.getpid()}.tmp'
  try:
    with open(tmp, 'w') as f:
      json.dump(data, f, indent=1)
    os.replace(tmp, p)
  except OSError as e:
    raise RequestError(f'cannot write the acceptance statistics to {p!r}: {e}') from e
  return p
