"""A synthetic induction task: random sequences in which one random span occurs twice.

Each row of T tokens is uniform random over an alphabet of `alphabet` byte tokens,
except that a span of L ~ U[span_min, span_max] tokens is written `repeats` times in a
row, after a random-length prefix (random filler after the last copy). Nothing but
the first occurrence predicts the second one, so a model can only beat chance
(1 / alphabet) on the second occurrence by looking back at the first and copying what
followed the current token there: an induction head (Olsson et al. 2022). Gloeckle
et al. 2024 (Section 3.7) report that multi-token prediction makes small models learn
this earlier. Occurrences after the second add training signal only (with two, a
2-layer d 64 model did not learn the task in 800 steps here).

The score: top-1 accuracy of the main head on the second occurrence's tokens after
its first (the first one follows random filler, so no model can know a copy starts):
`copy_mask` marks those target tokens.

Every batch is a pure function of (seed, step): no files, no download, the same on
every machine, and a resumed run sees exactly the batches an uninterrupted one does.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mtp_jax.data import tokenizers

# Byte tokens of 'A', 'B', ...: the alphabet is printable text under the byte tokenizer.
FIRST_BYTE = ord('A')


@dataclasses.dataclass(frozen=True)
class InductionTask:
  seq_len: int = 128
  alphabet: int = 32  # distinct tokens; chance accuracy is 1 / alphabet
  span_min: int = 16
  span_max: int = 32
  repeats: int = 2  # occurrences of the span (>= 2)

  def __post_init__(self):
    if not 2 <= self.alphabet <= 256 - FIRST_BYTE:
      raise ValueError(f'alphabet must be in [2, {256 - FIRST_BYTE}], got {self.alphabet}')
    if not 2 <= self.span_min <= self.span_max:
      raise ValueError(f'need 2 <= span_min <= span_max, got {self.span_min}, {self.span_max}')
    if self.repeats < 2 or self.repeats * self.span_max > self.seq_len:
      raise ValueError(f'{self.repeats} spans of span_max {self.span_max} do not fit seq_len '
                       f'{self.seq_len} (repeats must be >= 2)')

  @property
  def first_id(self) -> int:
    return int(tokenizers.ByteTokenizer().encode_array(bytes([FIRST_BYTE]))[0])

  def rows(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [n, T] int32, copy_mask [n, T] bool) of n fresh rows."""
    t = self.seq_len
    tokens = rng.integers(0, self.alphabet, (n, t)) + self.first_id
    mask = np.zeros((n, t), bool)
    for r in range(n):
      length = int(rng.integers(self.span_min, self.span_max + 1))
      a = int(rng.integers(0, t - self.repeats * length + 1))  # first occurrence at a
      for j in range(1, self.repeats):
        tokens[r, a + j * length:a + (j + 1) * length] = tokens[r, a:a + length]
      b = a + length  # the second occurrence
      mask[r, b + 1:b + length] = True
    return tokens.astype(np.int32), mask

  def batch(self, seed: int, step: int, batch_size: int) -> dict[str, np.ndarray]:
    """Training batch `step` of run `seed`: {tokens, segment_ids, positions, copy_mask}."""
    tokens, mask = self.rows(np.random.default_rng([seed, step]), batch_size)
    return _as_batch(tokens, mask)

  def eval_batch(self, n: int, seed: int = 12345) -> dict[str, np.ndarray]:
    """A fixed evaluation set of n rows, from a seed no training run uses (negative step)."""
    tokens, mask = self.rows(np.random.default_rng([seed, 2**31]), n)
    return _as_batch(tokens, mask)


def _as_batch(tokens: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
  n, t = tokens.shape
  return {'tokens': tokens, 'segment_ids': np.ones((n, t), np.int32),
          'positions': np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy(),
          'copy_mask': mask}


def copy_accuracy(pred_BxT: np.ndarray, batch: dict) -> float:
  """Accuracy on the copyable tokens: pred[:, i] is the prediction of tokens[:, i + 1]."""
  target, mask = batch['tokens'][:, 1:], batch['copy_mask'][:, 1:]
  return float(((pred_BxT[:, :-1] == target) & mask).sum() / max(mask.sum(), 1))
