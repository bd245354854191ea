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
import functools
import re
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

import mtp_jax.data.tokenizers as tokenizers

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


# -- stories with random names (Gloeckle et al. 2024, section 4.1, scaled down) ----------------
# Short children's-story sentences; {A} and {B} are the story's two characters. Every story
# opens with one INTRO sentence that names both, so each name's next mention is its second.
INTRO = (
    'Once upon a time, {A} and {B} went to the park.',
    '{A} lived next to {B} in a small town.',
    'One day {A} met {B} by the river.',
    '{A} and {B} were best friends.',
)
BODY = (
    '{A} found a shiny red stone.', '{B} wanted to see it.', '{A} gave the stone to {B}.',
    '{B} said thank you to {A}.', 'Then {B} and {A} played a game.', '{A} was very happy.',
    '{B} ran home to tell mom.', 'Later {A} and {B} ate cake together.',
    'The dog barked at {B}.', '{A} laughed and jumped.', 'It started to rain on {A}.',
    '{B} shared a big umbrella.', 'At night {A} dreamed of the sea.', '{B} sang a song.',
)
LETTERS = 'abcdefghijklmnopqrstuvwxyz'
# A name's capital is none that starts a template word ('Once', 'The', ...): in a story a
# capital then marks one name only, and the letter after it has one right answer.
NAME_CAPITALS = ''.join(sorted(set(LETTERS.upper()) - {
    ch for t in INTRO + BODY for ch in t.replace('{A}', '').replace('{B}', '') if ch.isupper()}))


@dataclasses.dataclass(frozen=True)
class _StoryTask:
  """What the story tasks share: rows of `seq_len` tokens, stories of an INTRO sentence and
  body_min .. body_max BODY sentences; a row holds at least SHORTEST tokens."""
  SHORTEST: ClassVar[int] = 32
  seq_len: int = 128
  body_min: int = 2
  body_max: int = 4

  def __post_init__(self):
    if not 1 <= self.body_min <= self.body_max:
      raise ValueError(f'need 1 <= body_min <= body_max, got {self.body_min}, {self.body_max}')
    if self.seq_len < self.SHORTEST:
      raise ValueError(f'seq_len {self.seq_len} cannot hold a story opening '
                       f'(need >= {self.SHORTEST})')


@dataclasses.dataclass(frozen=True)
class NameStoryTask(_StoryTask):
  """Template stories whose two characters have random names: the scaled-down induction
  test of Gloeckle et al. 2024 (section 4.1), on the byte tokenizer.

  A name is a capital letter (NAME_CAPITALS) and name_min - 1 .. name_max - 1 lower-case
  letters, drawn anew for every story (the two names start with different capitals),
  so each name is
  several tokens and nothing but its first mention predicts it. A story is an INTRO
  sentence naming both characters and body_min .. body_max BODY sentences, joined by
  spaces; rows are stories packed one after another as separate documents (segment ids
  1, 2, ...; positions restart), the last one cut at seq_len.

  The score: the main head's top-1 accuracy on the second token of a name at its second
  mention. After the mention's capital, only an induction head (look back to where that
  capital started the name, copy what followed) beats chance, 1/26. `copy_mask` marks
  those target tokens.
  """
  SHORTEST: ClassVar[int] = 64
  name_min: int = 3
  name_max: int = 6
  kind: str = 'names'

  def __post_init__(self):
    if not 2 <= self.name_min <= self.name_max:
      raise ValueError(f'need 2 <= name_min <= name_max, got {self.name_min}, {self.name_max}')
    super().__post_init__()

  def story(self, rng: np.random.Generator) -> tuple[str, list[int]]:
    """(text, character offsets of the scored characters: each name's second letter at
    its second mention)."""
    caps = rng.choice(len(NAME_CAPITALS), 2, replace=False)
    names = []
    for cap in caps:
      n = int(rng.integers(self.name_min, self.name_max + 1))
      names.append(NAME_CAPITALS[cap] + ''.join(LETTERS[i] for i in rng.integers(0, 26, n - 1)))
    picks = [INTRO[int(rng.integers(len(INTRO)))]] + [
        BODY[int(i)] for i in rng.integers(0, len(BODY),
                                           int(rng.integers(self.body_min, self.body_max + 1)))]
    text, mentions = '', {0: 0, 1: 0}
    scored = []
    for sentence in picks:
      text += ' ' if text else ''
      rest = sentence
      while rest:  # fill the slots left to right, counting each name's mentions
        cut = [(rest.find(f'{{{c}}}'), j) for j, c in enumerate('AB') if f'{{{c}}}' in rest]
        if not cut:
          text += rest
          break
        at, j = min(cut)
        text += rest[:at]
        mentions[j] += 1
        if mentions[j] == 2:
          scored.append(len(text) + 1)
        text += names[j]
        rest = rest[at + 3:]
    return text, scored

  def rows(self, rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """{tokens, segment_ids, positions, copy_mask}, each [n, T], of n fresh rows."""
    tok = tokenizers.ByteTokenizer()

    def next_story():
      text, scored = self.story(rng)
      return tok.encode_array(text.encode()), scored  # one token per byte: offsets carry over

    return _pack_stories(n, self.seq_len, next_story)

  def batch(self, seed: int, step: int, batch_size: int) -> dict[str, np.ndarray]:
    """Training batch `step` of run `seed` (a pure function of both, as InductionTask's)."""
    return self.rows(np.random.default_rng([seed, step]), batch_size)

  def eval_batch(self, n: int, seed: int = 12345) -> dict[str, np.ndarray]:
    """A fixed evaluation set of n rows, from a seed no training run uses."""
    return self.rows(np.random.default_rng([seed, 2**31]), n)


# -- Gloeckle et al. 2024 section 4.1 as run there: ordinary names to train on, random
# two-token names of the run's own trained tokenizer to test on ---------------------------
# 287 given names common in English children's stories: with this many, a name's first
# token leaves its second open (about 3 bits under the default 512-piece BPE), so a later
# mention is predicted better by copying the first than by guessing.
ORDINARY_NAMES = (
    'Tom', 'Lily', 'Ben', 'Sue', 'Max', 'Anna', 'Sam', 'Mia', 'Jack', 'Lucy', 'Tim', 'Emma',
    'Jake', 'Sara', 'Leo', 'Zoe', 'Bob', 'Amy', 'Dan', 'Kate', 'Joe', 'Ella', 'Nick',
    'Rose', 'Finn', 'Ivy', 'Paul', 'Jane', 'Mark', 'Lisa', 'Noah', 'Grace', 'Adam', 'Alice',
    'Alan', 'Alex', 'Alfie', 'Amber', 'Andy', 'Annie', 'Archie', 'Arthur', 'Ava', 'Bella',
    'Benny', 'Beth', 'Betty', 'Billy', 'Bonnie', 'Brian', 'Bruno', 'Carl', 'Carla',
    'Carmen', 'Carol', 'Charlie', 'Chloe', 'Chris', 'Clara', 'Colin', 'Daisy', 'Daniel',
    'Dave', 'David', 'Dora', 'Dylan', 'Eddie', 'Edith', 'Elena', 'Eli', 'Eliza', 'Ellie',
    'Eric', 'Ethan', 'Eva', 'Evan', 'Felix', 'Fiona', 'Frank', 'Freddie', 'Gabe', 'Gary',
    'George', 'Gina', 'Greta', 'Gus', 'Hannah', 'Harry', 'Hazel', 'Heidi', 'Helen', 'Henry',
    'Holly', 'Hugo', 'Ian', 'Isaac', 'Isla', 'Jade', 'Jamie', 'Jasmine', 'Jason', 'Jenny',
    'Jess', 'Jill', 'Jimmy', 'Joan', 'Jonah', 'Josh', 'Judy', 'Julia', 'Julian', 'June',
    'Karen', 'Katie', 'Kevin', 'Kim', 'Kyle', 'Laura', 'Leah', 'Lena', 'Leon', 'Liam',
    'Linda', 'Logan', 'Lola', 'Louis', 'Luke', 'Luna', 'Mabel', 'Maggie', 'Maisie', 'Marco',
    'Maria', 'Martha', 'Mary', 'Matt', 'Maya', 'Megan', 'Mike', 'Millie', 'Milo', 'Molly',
    'Nadia', 'Nancy', 'Nate', 'Nell', 'Nina', 'Nora', 'Oliver', 'Olivia', 'Oscar', 'Owen',
    'Pam', 'Peggy', 'Penny', 'Pete', 'Peter', 'Phil', 'Pip', 'Poppy', 'Quinn', 'Rachel',
    'Ralph', 'Ray', 'Rebecca', 'Rex', 'Rita', 'Robin', 'Roger', 'Ronnie', 'Rosie', 'Ruby',
    'Rufus', 'Ruth', 'Ryan', 'Sally', 'Sandy', 'Sarah', 'Scott', 'Sean', 'Seth', 'Sophie',
    'Stella', 'Steve', 'Susan', 'Teddy', 'Tessa', 'Theo', 'Tina', 'Toby', 'Tony', 'Una',
    'Vera', 'Victor', 'Vicky', 'Violet', 'Wendy', 'Will', 'Willow', 'Xavier', 'Yara',
    'Zack', 'Zara', 'Abby', 'Agnes', 'Albert', 'Anton', 'Barry', 'Basil', 'Blake', 'Brooke',
    'Caleb', 'Cara', 'Cathy', 'Cecil', 'Celia', 'Cleo', 'Cody', 'Connor', 'Dana', 'Dean',
    'Della', 'Derek', 'Diana', 'Dixie', 'Donna', 'Edgar', 'Edna', 'Elsie', 'Elton', 'Emil',
    'Enzo', 'Erin', 'Esme', 'Faye', 'Flora', 'Fred', 'Gemma', 'Gideon', 'Gilbert', 'Gloria',
    'Hector', 'Hilda', 'Ingrid', 'Iris', 'Ivan', 'Jenna', 'Jerry', 'Josie', 'Kara', 'Keith',
    'Lara', 'Lenny', 'Lottie', 'Lyle', 'Marcus', 'Margo', 'Marvin', 'Mavis', 'Mona',
    'Morris', 'Myra', 'Neil', 'Nigel', 'Norma', 'Olga', 'Otto', 'Pablo', 'Percy', 'Polly',
    'Reggie', 'Rhoda', 'Rory', 'Rowan', 'Sadie', 'Selma', 'Simon', 'Stan', 'Sybil', 'Tara',
    'Tilly', 'Ursula', 'Wade', 'Walter', 'Wilma', 'Yvonne', 'Zelda')


def word_story(sentences: Sequence[str], names: Sequence[str]) -> tuple[list[str], list[int]]:
  """(words, indices of the scored words: each name at its second mention) of a story
  whose {A} / {B} slots take names[0] / names[1]. Punctuation is its own word, so a name is
  always a whole whitespace-separated word and its tokens never merge with a neighbour's."""
  words, seen, scored = [], [0, 0], []
  for sentence in sentences:
    for w in sentence.replace('.', ' .').replace(',', ' ,').split():
      slot = {'{A}': 0, '{B}': 1}.get(w)
      if slot is None:
        words.append(w)
        continue
      seen[slot] += 1
      if seen[slot] == 2:
        scored.append(len(words))
      words.append(names[slot])
  return words, scored


# Every word of the templates: no test name may be one ('Then', 'Later').
TEMPLATE_WORDS = frozenset(w for t in INTRO + BODY for w in
                           t.replace('.', ' ').replace(',', ' ').split() if '{' not in w)


@functools.lru_cache(maxsize=4)
def story_tokenizer(vocab_size: int, corpus_stories: int, seed: int):
  """(SentencePiece BPE trained on `corpus_stories` ordinary-name stories, the sorted
  names of exactly two of its tokens that are no ordinary name and no template word): the
  same for the same arguments on every machine (sentencepiece's trainer is deterministic on
  one thread)."""
  rng = np.random.default_rng([seed, 2**30])
  texts = [''.join(' ' + w for w in _pick_story(rng, ORDINARY_NAMES, 2, 4)[0])
           for _ in range(corpus_stories)]
  tok = tokenizers.SentencePieceTokenizer(
      tokenizers.train_sentencepiece(texts, vocab_size=vocab_size, num_threads=1))
  pieces = [tok.decode([i]) for i in range(tok.vocab_size)]
  firsts = [i for i, p in enumerate(pieces) if re.fullmatch(' [A-Z][a-z]*', p)]
  seconds = [i for i, p in enumerate(pieces) if re.fullmatch('[a-z]+', p)]
  names = sorted({pieces[a][1:] + pieces[b] for a in firsts for b in seconds
                  if tok.encode(' ' + pieces[a][1:] + pieces[b]) == [a, b]}
                 - set(ORDINARY_NAMES) - TEMPLATE_WORDS)
  return tok, tuple(names)


def _pick_story(rng, pool: Sequence[str], body_min: int, body_max: int):
  """(words, scored word indices) of one story with two distinct names from `pool`."""
  a, b = rng.choice(len(pool), 2, replace=False)
  sentences = [INTRO[int(rng.integers(len(INTRO)))]] + [
      BODY[int(i)] for i in rng.integers(0, len(BODY), int(rng.integers(body_min, body_max + 1)))]
  return word_story(sentences, (pool[int(a)], pool[int(b)]))


def _pack_stories(n: int, t: int, next_story) -> dict[str, np.ndarray]:
  """{tokens, segment_ids, positions, copy_mask}, each [n, T]: the stories next_story()
  gives as (token ids, offsets of the scored tokens), packed one after another as separate
  documents (segment ids 1, 2, ...; positions restart), the last one cut at T."""
  out = {k: np.zeros((n, t), np.int32) for k in ('tokens', 'segment_ids', 'positions')}
  mask = np.zeros((n, t), bool)
  for r in range(n):
    i, seg = 0, 1
    while i < t:
      ids, scored = next_story()
      m = min(len(ids), t - i)
      out['tokens'][r, i:i + m] = ids[:m]
      out['segment_ids'][r, i:i + m] = seg
      out['positions'][r, i:i + m] = np.arange(m)
      for c in scored:
        if c < m:
          mask[r, i + c] = True
      i, seg = i + m, seg + 1
  out['copy_mask'] = mask
  return out


@dataclasses.dataclass(frozen=True)
class BPENameStoryTask(_StoryTask):
  """Induction as Gloeckle et al. 2024 (section 4.1) ran it, on template stories: the model
  trains on stories whose characters have ordinary names (ORDINARY_NAMES) and is tested
  on stories whose names are random names of exactly two tokens of the run's own trained
  tokenizer (story_tokenizer: a SentencePiece BPE of `vocab_size` pieces trained on
  ordinary-name stories). The score: the main head's top-1 accuracy on the second token
  of a name at its second mention; given the name's first token, only a look back at its
  first mention tells the second. `copy_mask` marks those targets (in training rows too,
  where an ordinary name has a second token).

  Tokens of a story are its words' tokens, each word with a leading space (so a name is
  the same tokens at every mention): what the whole text encodes to, as the tokenizer
  splits at whitespace.
  """
  vocab_size: int = 512
  corpus_stories: int = 4000
  tokenizer_seed: int = 0
  kind: str = 'bpe_names'

  @property
  def tokenizer(self):
    return story_tokenizer(self.vocab_size, self.corpus_stories, self.tokenizer_seed)[0]

  @property
  def test_names(self) -> tuple:
    return story_tokenizer(self.vocab_size, self.corpus_stories, self.tokenizer_seed)[1]

  def chance(self) -> float:
    """1 / the number of distinct second tokens among the test names: the accuracy of a
    uniform guess among them (a model that knows nothing of the first mention)."""
    tok = self.tokenizer
    return 1 / len({tok.encode(' ' + n)[1] for n in self.test_names})

  def encode_story(self, words: Sequence[str], scored: Sequence[int]):
    """(token ids, positions of the scored tokens: the second token of each scored name)."""
    tok, ids, marks = self.tokenizer, [], []
    for j, w in enumerate(words):
      piece = tok.encode(' ' + w)
      if j in scored and len(piece) >= 2:
        marks.append(len(ids) + 1)
      ids += piece
    return ids, marks

  def rows(self, rng: np.random.Generator, n: int, test: bool) -> dict[str, np.ndarray]:
    """{tokens, segment_ids, positions, copy_mask}, each [n, T]: stories packed as
    documents, the last one cut at seq_len; test: random two-token names."""
    pool = self.test_names if test else ORDINARY_NAMES
    if len(pool) < 2:
      raise ValueError(f'a BPE of {self.vocab_size} pieces trained on {self.corpus_stories} '
                       'stories has no names of two tokens: raise vocab_size')
    return _pack_stories(n, self.seq_len, lambda: self.encode_story(
        *_pick_story(rng, pool, self.body_min, self.body_max)))

  def batch(self, seed: int, step: int, batch_size: int) -> dict[str, np.ndarray]:
    """Training batch `step` of run `seed`: ordinary-name stories."""
    return self.rows(np.random.default_rng([seed, step]), batch_size, test=False)

  def eval_batch(self, n: int, seed: int = 12345) -> dict[str, np.ndarray]:
    """The fixed test set: n rows of random-name stories, from a seed no training run uses."""
    return self.rows(np.random.default_rng([seed, 2**31]), n, test=True)


def make_task(seq_len: int, kind: str = 'spans', **fields):
  """The task of a sweep run's `task` fields: 'spans' (InductionTask), 'names'
  (NameStoryTask) or 'bpe_names' (BPENameStoryTask)."""
  if kind == 'names':
    return NameStoryTask(seq_len=seq_len, **fields)
  if kind == 'bpe_names':
    return BPENameStoryTask(seq_len=seq_len, **fields)
  if kind != 'spans':
    raise ValueError(f"induction task kind must be 'spans', 'names' or 'bpe_names', "
                     f'got {kind!r}')
  return InductionTask(seq_len=seq_len, **fields)
