"""Self-distilled training data (the FastMTP recipe): the trunk's own continuations as a dataset.

MTP drafts are accepted when they match what the main model would emit, so FastMTP trains
the MTP modules on text the model itself generated rather than on the corpus. Here:
prompts are windows of documents of a corpus split (seeded), continuations are sampled
from a trained workdir with this project's decoder (Decoder, batched), and each
prompt + continuation is written as one record of `<out>/data.jsonl`:

  {"tokens": [ids of prompt + continuation], "prompt_len": P, "text": "...", "doc": i, "start": s}

Token ids, not text, are the training data (`data.tokens_key=tokens`): they round-trip
exactly for every tokenizer, where sampled byte-level output need not be valid UTF-8 and a
SentencePiece re-encoding of sampled text need not give the sampled ids. `text` is for
people (undecodable bytes replaced). `<out>/meta.json` records the workdir, step, seed and
sampling settings, and the config overrides that train on the result.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import numpy as np

from mtp_jax.checkpoint.reader import load_workdir
from mtp_jax.config.base import base_config
from mtp_jax.config.validation import validate
from mtp_jax.data import pipeline, stdlib_dataset, tokenizers, user_data
from mtp_jax.decode.decoder import Decoder, check_request
from mtp_jax.errors import ConfigError, RequestError
from mtp_jax.train import evaluation
from mtp_jax.train_state.restore import restore_model_at

DATA_FILE = 'data.jsonl'
META_FILE = 'meta.json'


@dataclasses.dataclass
class Settings:
  """What to sample: prompts (count, tokens, split) and the decoder's options."""
  num_prompts: int = 256
  prompt_len: int = 32
  max_new_tokens: int = 96
  temperature: float = 1.0  # 0: greedy
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  batch_size: int = 64
  num_drafts: int = 0  # 0: autoregressive; k: speculative with k MTP depths (same distribution)
  split: str = ''  # '' -> data.train_split of the workdir's (or the overridden) data config

  def check(self, seq_len: int) -> None:
    for name in ('num_prompts', 'prompt_len', 'max_new_tokens', 'batch_size'):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise RequestError(f'--{name} must be a positive integer, got {v!r}')
    if self.num_drafts < 0:
      raise RequestError(f'--num_drafts must be >= 0, got {self.num_drafts}')
    if self.prompt_len + self.max_new_tokens > seq_len:
      raise RequestError(f'--prompt_len ({self.prompt_len}) + --max_new_tokens '
                         f'({self.max_new_tokens}) exceeds the trunk\'s training sequence '
                         f'length data.seq_len ({seq_len})')
    check_request([[0]], self.max_new_tokens, self.temperature, self.top_k, self.top_p)


def override_data(config, overrides: Sequence[str]) -> None:
  """Applies `field=value` strings to config.data (the prompt corpus), typed by base_config.

  A tuple field takes comma-separated values (`extensions=.md,.txt`).
  """
  base = base_config().data
  for item in overrides:
    key, sep, value = item.partition('=')
    if not sep or key not in base:
      raise RequestError(f'--data {item!r}: expected FIELD=VALUE with FIELD one of '
                         f'{sorted(base.keys())}')
    kind = type(base[key])
    try:
      if kind is tuple:
        config.data[key] = tuple(v for v in value.split(',') if v)
      elif kind is bool:
        config.data[key] = {'true': True, 'false': False}[value.lower()]
      else:
        config.data[key] = kind(value)
    except (ValueError, KeyError) as e:
      raise RequestError(f'--data {item!r}: data.{key} must be {kind.__name__}') from e


def draw_prompts(config, tokenizer, n: int, length: int, split: str,
                 seed: int) -> list[tuple[list[int], int, int]]:
  """n (prompt ids, document index, start) windows of `length` tokens, seeded.

  Documents in a seeded random order, each prompt starting at a seeded random token
  offset; documents are reused (new offsets) when n exceeds the long-enough ones.
  ConfigError / RequestError when no document of the split has `length` tokens.
  """
  d = config.data
  source = stdlib_dataset.data_source(d, split)
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(source))
  out, tried = [], 0
  while len(out) < n:
    i = int(order[tried % len(order)])
    tried += 1
    ids = pipeline.document_ids(tokenizer, d, source[i])
    if len(ids) >= length:
      start = int(rng.integers(0, len(ids) - length + 1))
      out.append((ids[start:start + length].tolist(), i, start))
    elif tried >= len(order) and not out:
      raise RequestError(f'no document of split {split!r} has --prompt_len {length} tokens')
  return out


def sample(decoder: Decoder, prompts: Sequence[Sequence[int]], s: Settings,
           eos_id: int) -> list[np.ndarray]:
  """Continuations of the prompts, batch j of s.batch_size decoded with seed s.seed + j.

  The last batch is filled up with copies of its first prompt (one compiled program);
  a continuation ends at eos (dropped: the pipeline adds eos after every document).
  """
  out = []
  for j, i in enumerate(range(0, len(prompts), s.batch_size)):
    chunk = list(prompts[i:i + s.batch_size])
    real = len(chunk)
    chunk += [chunk[0]] * (s.batch_size - real)
    r = decoder.generate(chunk, s.max_new_tokens, num_drafts=s.num_drafts,
                         temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                         eos_id=eos_id, seed=s.seed + j,
                         pad_to=(s.prompt_len, s.max_new_tokens))
    for t in r.tokens[:real]:
      t = np.asarray(t, np.int32)
      out.append(t[:-1] if len(t) and t[-1] == eos_id else t)
  return out


def self_distill(workdir: str, out_dir: str, settings: Settings,
                 data_overrides: Sequence[str] = (), notify=print) -> dict:
  """Samples settings.num_prompts continuations from workdir's newest checkpoint into out_dir.

  Returns meta.json's dict. RequestError / ConfigError (one line) before anything compiles.
  """
  config, step = load_workdir(workdir)
  override_data(config, data_overrides)
  settings.check(int(config.data.seq_len))
  if os.path.exists(os.path.join(out_dir, DATA_FILE)):
    raise RequestError(f'--out {out_dir!r} already holds {DATA_FILE}; choose a new directory')
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise RequestError(f'--out {out_dir!r} exists and is not a directory')
  mtp_depth = int(config.model.mtp.depth)
  if settings.num_drafts > mtp_depth:
    raise RequestError(f'--num_drafts {settings.num_drafts} exceeds the checkpoint\'s '
                       f'model.mtp.depth ({mtp_depth})')
  validate(config)
  split = settings.split or config.data.train_split
  tokenizer = tokenizers.get_tokenizer(config.data)
  drawn = draw_prompts(config, tokenizer, settings.num_prompts, settings.prompt_len, split,
                       settings.seed)
  model, step = restore_model_at(config, workdir, step, fallback=True)
  decoder = Decoder(model)
  notify(f'self_distill: {len(drawn)} prompts of {settings.prompt_len} tokens from split '
         f'{split!r}, {settings.max_new_tokens} new tokens each, temperature '
         f'{settings.temperature}, step {step} of {workdir}')
  continuations = sample(decoder, [p for p, _, _ in drawn], settings, tokenizer.eos_id)

  os.makedirs(out_dir, exist_ok=True)
  tmp = os.path.join(out_dir, DATA_FILE + '.tmp')
  with open(tmp, 'w', encoding='utf-8') as f:
    for (prompt, doc, start), cont in zip(drawn, continuations):
      ids = [int(t) for t in prompt] + cont.tolist()
      # Ids past the tokenizer's (the model's padded rows) have no text; they stay in tokens.
      text = tokenizer.decode([t for t in ids if t < tokenizer.vocab_size])
      f.write(json.dumps({'tokens': ids, 'prompt_len': len(prompt), 'text': text,
                          'doc': doc, 'start': start}) + '\n')
  os.replace(tmp, os.path.join(out_dir, DATA_FILE))  # a half-written file is never data.jsonl
  d = config.data
  meta = {
      'workdir': os.path.abspath(workdir), 'step': step, 'split': split,
      'settings': dataclasses.asdict(settings), 'records': len(drawn),
      'new_tokens': int(sum(len(c) for c in continuations)),
      'model_vocab_size': config.model.vocab_size,
      'prompt_data': {k: d[k] for k in ('source', 'path', 'dataset', 'corpus_dir', 'text_key',
                                        'tokens_key', 'train_split', 'validation_percent')},
      # Train on it: the trunk's tokenizer, the ids as stored; the file, not the folder (a
      # workdir put there would add its metrics.jsonl).
      'train_overrides': {'data.source': 'jsonl',
                          'data.path': os.path.abspath(os.path.join(out_dir, DATA_FILE)),
                          'data.tokens_key': 'tokens', 'data.text_key': 'text',
                          'data.tokenizer': d.tokenizer, 'data.spm_model': d.spm_model},
  }
  held_out = _held_out_percent(config, meta['train_overrides'])
  if held_out != d.validation_percent:  # few records: hold out enough for a validation split
    meta['train_overrides']['data.validation_percent'] = held_out
  if not _decode_eval_fits(config, meta['train_overrides'], tokenizer):
    meta['train_flags'] = {'train.eval_decode_prompts': 0}  # records too short to prompt from
  with open(os.path.join(out_dir, META_FILE), 'w') as f:
    json.dump(meta, f, indent=1)
  return meta


def _decode_eval_fits(config, overrides: dict, tokenizer) -> bool:
  """Whether the trainer's decode evaluation (train.eval_decode_prompts) finds its prompts
  in the written records' validation split (they need documents of 4 x the prompt length)."""
  cfg = config.copy_and_resolve_references()
  cfg.data.update({k.split('.', 1)[1]: v for k, v in overrides.items()})
  try:
    evaluation.training_prompts(cfg, tokenizer)
  except ConfigError:
    return False
  return True


def _held_out_percent(config, overrides: dict) -> float:
  """The trunk's data.validation_percent, doubled (up to 50) until the written records'
  validation split is not empty: records are split by hash, so a few may hold out none."""
  d = base_config().data
  d.update({k.split('.', 1)[1]: v for k, v in overrides.items()})
  percent = d.validation_percent = config.data.validation_percent
  while percent < 50:
    try:
      user_data.data_source(d, 'validation')
      break
    except ConfigError:
      percent = d.validation_percent = min(50, percent * 2)
  return percent
