"""Evaluation of a checkpoint: teacher-forced per-depth figures and free-running decoding.

Shared by scripts/eval.py and the trainer's periodic evaluation, so both report the
same `eval/...` keys: `evaluate`'s loss, accuracy, agreement and bits per byte
per depth, plus the decoder's (docs/design.md §5) on fixed validation prompts:
  eval/decode_tau               mean accepted length, committed tokens / verify steps
  eval/decode_accept_mtp_<k>    P(the first k drafts of a verify step are accepted)
  eval/decode_tree_tau, eval/decode_tree_accept_mtp_<k>: the same for tree drafting
                                (scripts/eval.py --tree; eval/decode_tree names the tree)
Decoding here is greedy and never stops at EOS (every row generates the same number
of tokens), so with the same parameters, prompts and batch the figures are the same
bit for bit: a resumed run logs what an uninterrupted one does, and scripts/eval.py
on a checkpoint reproduces the trainer's line of that step.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mtp_jax.train.loss as loss_lib
import mtp_jax.train.steps as steps
from mtp_jax.checkpoint.reader import load_workdir, restore_state
from mtp_jax.config.mesh import DEFAULT_AXES, resolved_mesh_axes
from mtp_jax.config.readers import decode_prompt_len
from mtp_jax.config.validation import validate
from mtp_jax.data import checks as data_checks
from mtp_jax.data import tokenizers, user_data
from mtp_jax.decode import tree as tree_lib
from mtp_jax.decode.decoder import Decoder
from mtp_jax.errors import ConfigError, RequestError
from mtp_jax.model.args import ModelArgs
from mtp_jax.runtime import peak as peak_lib
from mtp_jax.runtime import sharding
from mtp_jax.train.metrics import TAU_KEY, depth_name, metric_key

MAX_PLAIN_DOCS = 4096  # documents read from a split without a 'path' feature to order by


# -- teacher-forced ----------------------------------------------------------------------------
def padded_token_bytes(config, tokenizer) -> np.ndarray:
  """UTF-8 bytes of each token id, padded to the model's vocabulary (bits per byte)."""
  token_bytes = tokenizer.token_bytes()
  vocab = tokenizers.model_vocab_size(config)
  return np.pad(token_bytes, (0, vocab - len(token_bytes)), constant_values=1)


def evaluate(ts: steps.TrainSetup, state, batches, token_bytes_V) -> dict:
  """eval/... per-depth loss, accuracy, agreement and bits per byte over `batches`."""
  total = None
  with sharding.use_mesh(ts.mesh, ts.rules):
    tb = jax.device_put(jnp.asarray(token_bytes_V, jnp.int32), sharding.replicated(ts.mesh))
    for batch in batches:
      sums = ts.eval_step(state, sharding.host_batch_to_global(batch, ts.mesh), tb)
      total = sums if total is None else jax.tree.map(jnp.add, total, sums)
  total = jax.device_get(total)
  out = {k: float(v) for k, v in loss_lib.summarize(total, 'eval').items()}
  bpb = total['loss_sum'] / (math.log(2) * np.maximum(total['bytes'], 1.0))
  for k in range(len(bpb)):
    out[metric_key('eval', 'bpb', k)] = float(bpb[k])
  out[metric_key('eval', 'tokens')] = float(total['count'][0])
  return out


# -- prompts -----------------------------------------------------------------------------------
def split_texts(data_config, split: str) -> list[str]:
  """The documents of a split in a fixed order: by path when the data set has one.

  TFDS stores records in hashed order; python_stdlib's sorted paths are the corpus's own
  file order (corpus.split_documents), the same on every machine and every call.
  """
  # Deferred: stdlib_dataset imports tensorflow_datasets (seconds); the trainer's and
  # scripts/eval.py's decode prompts are the only readers of raw documents here.
  from mtp_jax.data import stdlib_dataset  # pylint: disable=g-import-not-at-top
  source = stdlib_dataset.data_source(data_config, split)
  first = source[0]
  stdlib_dataset.check_text_key(data_config, first)
  as_text = tokenizers.as_text
  if 'path' in first:
    records = sorted((as_text(r['path']), as_text(r[data_config.text_key]))
                     for r in (source[i] for i in range(len(source))))
    return [text for _, text in records]
  return [as_text(source[i][data_config.text_key])
          for i in range(min(len(source), MAX_PLAIN_DOCS))]


def prompts_from_docs(docs: Sequence[str], tokenizer, n: int, length: int) -> list[list[int]]:
  """Up to n prompts of at most `length` tokens, one per document of >= 4 * length tokens,
  evenly spaced through docs, each starting at a line a third into its document (past
  license headers and imports). Fewer than n when too few documents are that long."""
  docs = [d for d in docs if len(tokenizer.encode(d)) >= 4 * length]
  step = max(1, len(docs) // n)
  prompts = []
  for doc in docs[::step][:n]:
    lines = doc.splitlines(keepends=True)
    start = sum(len(line) for line in lines[:len(lines) // 3])
    prompts.append(list(tokenizer.encode(doc[start:]))[:length])
  return prompts


def validation_prompts(config, tokenizer, n: int, length: int,
                       split: str | None = None) -> list[list[int]]:
  """n prompts of at most `length` tokens from n different held-out documents.

  Documents of at least 4 * length tokens, evenly spaced through the split (default
  data.eval_split); each prompt starts at a line a third into its document, past the
  license header and imports. ConfigError when too few documents are that long.
  """
  split = split or config.data.eval_split
  prompts = prompts_from_docs(split_texts(config.data, split), tokenizer, n, length)
  if len(prompts) < n:
    raise ConfigError(f'split {split!r} of {user_data.describe(config.data)} has only '
                      f'{len(prompts)} documents of {4 * length}+ tokens, too few for {n} '
                      f'decode prompts of {length} tokens: ask for fewer or shorter prompts '
                      '(train.eval_decode_prompts, or --num_prompts / --prompt_len), or hold '
                      'out more documents (data.validation_percent)')
  return prompts


def training_prompts(config, tokenizer) -> list[list[int]]:
  """The trainer's decode-evaluation prompts ([] when train.eval_decode_prompts or M is 0)."""
  n = config.train.eval_decode_prompts
  if not n or not config.model.mtp.depth:
    return []
  return validation_prompts(config, tokenizer, n, decode_prompt_len(config))


def suggested_prompt(tokenizer, batches, max_chars: int = 24) -> str:
  """A prompt for the final block's `mtp-decode` line, from the run's own validation data:
  the start of the first document in `batches` that begins with text, cut at its first line
  end and at a word boundary within max_chars ('' when none does)."""
  for batch in batches:
    for tokens, positions in zip(np.asarray(batch['tokens']), np.asarray(batch['positions'])):
      for start in np.flatnonzero(positions == 0):
        text = tokenizer.decode(tokens[start:start + 4 * max_chars].tolist())
        line = text.lstrip().split('\n', 1)[0].rstrip()
        if len(line) > max_chars:
          cut = line.rfind(' ', 0, max_chars + 1)
          line = line[:cut + 1] if cut > 0 else line[:max_chars]
        if line.strip() and line.isprintable():
          return line
  return ''


# -- decoding ------------------------------------------------------------------------------------
def _identity(tree):
  return tree


def local_decoder(graphdef, state, mesh, tree=None) -> Decoder:
  """A Decoder of a train state's model, each parameter whole on this process's first device.

  With several processes a parameter is sharded over devices this process cannot
  read; a replicating jit, which every process must join, gathers it first.
  """
  model, _ = nnx.merge(graphdef, state)
  gdef, params = nnx.split(model)
  if not all(x.is_fully_addressable for x in jax.tree.leaves(params)):
    params = jax.jit(_identity, out_shardings=sharding.replicated(mesh))(params)
    params = jax.tree.map(lambda x: x.addressable_data(0), params)
  return Decoder(nnx.merge(gdef, params), tree=tree)


def decode_metrics(decoder: Decoder, prompts: Sequence[Sequence[int]],
                   max_new_tokens: int, *, batch_size: int = 0, compare: bool = False,
                   tree_decoder: Decoder | None = None) -> dict:
  """eval/decode_... figures of greedy speculative decoding with every MTP depth.

  All prompts form one batch unless batch_size says otherwise (the trainer uses one).
  compare: also decode autoregressively, after one untimed run of each program, and
  add the speedup, tokens/s of both and `identical` (spec tokens == AR tokens). A
  model without MTP modules decodes autoregressively only (compare) or not at all.
  tree_decoder: also decode with its tree, beside the chain (eval/decode_tree_...).
  """
  drafting = decoder.args.drafting_depths()  # every depth that can draft (not leap ones)
  kw = dict(batch_size=batch_size or len(prompts), warm_up=compare, eos_id=None,
            pad_to=(max(map(len, prompts)), max_new_tokens))
  modes = ([0] if compare else []) + ([drafting] if drafting else [])
  results = {n: decoder.generate_batched(prompts, max_new_tokens, num_drafts=n, **kw)
             for n in modes}
  out = {}
  if drafting:
    st = results[drafting].stats()
    out[TAU_KEY] = st['mean_accepted_length']
    for k, a in enumerate(st['acceptance_per_depth'], 1):
      out[metric_key('eval', 'decode_accept', k)] = a
  if compare:
    ar = results[0]
    out['eval/decode_ar_tokens_per_sec'] = ar.new_tokens / max(ar.seconds, 1e-12)
    if drafting:
      sp = results[drafting]
      out['eval/decode_spec_tokens_per_sec'] = sp.new_tokens / max(sp.seconds, 1e-12)
      out['eval/decode_speedup'] = ar.seconds / max(sp.seconds, 1e-12)
      out['eval/decode_identical'] = all(np.array_equal(a, s)
                                         for a, s in zip(ar.tokens, sp.tokens))
  if tree_decoder is not None and drafting:
    tr = tree_decoder.generate_batched(prompts, max_new_tokens, **kw)
    st = tr.stats()
    out['eval/decode_tree'] = st['tree']
    out[metric_key('eval', 'decode_tree_tau')] = st['mean_accepted_length']
    for k, a in enumerate(st['acceptance_per_depth'], 1):
      out[metric_key('eval', 'decode_tree_accept', k)] = a
    if compare:
      out['eval/decode_tree_tokens_per_sec'] = tr.new_tokens / max(tr.seconds, 1e-12)
      out['eval/decode_tree_speedup'] = results[0].seconds / max(tr.seconds, 1e-12)
      out['eval/decode_tree_identical'] = all(np.array_equal(a, s) for a, s in
                                              zip(results[0].tokens, tr.tokens))
  return out


# -- a checkpoint, end to end (scripts/eval.py) --------------------------------------------------
def _check_options(split, eval_batches, num_prompts, prompt_len, max_new_tokens, batch_size,
                   step):
  for name, v, low in [('--eval_batches', eval_batches, 1), ('--num_prompts', num_prompts, 0),
                       ('--prompt_len', prompt_len, 1), ('--max_new_tokens', max_new_tokens, 1),
                       ('--batch_size', batch_size, 1), ('--step', step, 0)]:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
      raise RequestError(f'{name} must be an integer >= {low}, got {v!r}')
  if split is not None and not split.strip():
    raise RequestError('--split is empty')


def _mesh_for(config, num_devices: int):
  """The saved mesh if it fits these devices, else all of them on the data axis."""
  try:
    resolved_mesh_axes(config.mesh, num_devices)
  except ConfigError:
    config.mesh.shape = None
    for axis, size in DEFAULT_AXES.items():
      config.mesh.axes[axis] = size


def evaluate_workdir(workdir: str, *, split: str | None = None, eval_batches: int | None = None,
                     num_prompts: int | None = None, prompt_len: int | None = None,
                     max_new_tokens: int | None = None, batch_size: int | None = None,
                     step: int | None = None, devices=None, tree: str | None = '') -> dict:
  """What scripts/eval.py does: checks, restores, evaluates, decodes; one flat dict.

  None picks the trainer's own setting: data.eval_split, train.eval_batches,
  train.eval_decode_prompts (8 when off) and train.eval_decode_tokens, prompts of
  data.seq_len // 2 tokens, one batch of every prompt. num_prompts 0: no decoding.
  tree: also decode with this draft tree ('' : tree.default_tree of the model's drafting
  depths; None: the chain only).
  RequestError / ConfigError for bad input, before anything compiles.
  """
  # Deferred: the data pipeline imports tensorflow_datasets (seconds).
  from mtp_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  _check_options(split, eval_batches, num_prompts, prompt_len, max_new_tokens, batch_size, step)
  if tree:  # the tree itself; what the model can draft is checked once its config is read
    tree_lib.parse_tree(tree)
  explicit = step is not None
  config, step = load_workdir(workdir, step)
  # its decoding promises plain decoding's output: 'auto' resolves as for mtp-decode
  peak_lib.resolve_model_dtype(config, 'decode')
  devices = jax.local_devices() if devices is None else devices
  t, d = config.train, config.data
  split = split or d.eval_split
  d.eval_split = split
  eval_batches = eval_batches or t.eval_batches
  if num_prompts is None:
    num_prompts = t.eval_decode_prompts or 8
  prompt_len = prompt_len or decode_prompt_len(config)
  if num_prompts and prompt_len >= d.seq_len:  # else max_new_tokens defaults to 0
    raise RequestError(f'--prompt_len ({prompt_len}) must be below the training sequence '
                       f'length data.seq_len ({d.seq_len}) to leave room for new tokens')
  if max_new_tokens is None:
    max_new_tokens = min(t.eval_decode_tokens, d.seq_len - prompt_len)
  if num_prompts and prompt_len + max_new_tokens > d.seq_len:
    raise RequestError(f'--prompt_len ({prompt_len}) + --max_new_tokens ({max_new_tokens}) '
                       f'exceeds the training sequence length data.seq_len ({d.seq_len})')
  _mesh_for(config, len(devices))
  validate(config, len(devices))
  if tree:
    tree_lib.check_tree(ModelArgs.from_config(config, tokenizers.model_vocab_size(config)), tree)
  data_checks.validate_data(config, 1)  # the split exists and is readable
  tokenizer = tokenizers.get_tokenizer(d)
  prompts = validation_prompts(config, tokenizer, num_prompts, prompt_len) if num_prompts else []

  ts, state = steps.setup(config, devices)
  # Verified on read; without --step a broken newest step gives way to an older one.
  restored = restore_state(workdir, step, ts.abstract_state, fallback=not explicit)
  state, step = restored.state, restored.step

  batches = pipeline.make_eval_batches(config, num_batches=eval_batches)
  out = {'workdir': os.path.abspath(workdir), 'step': step, 'split': split,
         'eval_batches': eval_batches, 'mtp_depth': int(config.model.mtp.depth)}
  out.update(evaluate(ts, state, batches, padded_token_bytes(config, tokenizer)))
  out.update(decode_prompts=num_prompts, decode_prompt_len=prompt_len,
             decode_max_new_tokens=max_new_tokens)
  if not num_prompts:
    out['decode_note'] = 'decoding skipped (--num_prompts 0)'
    return out
  if not config.model.mtp.depth:
    out['decode_note'] = ('model.mtp.depth = 0: no MTP modules to draft with; '
                          'plain autoregressive decoding only')
  decoder = local_decoder(ts.graphdef, state, ts.mesh)
  tree_decoder = None
  if tree is not None and decoder.args.drafting_depths() and decoder.args.mtp_head().chained:
    tree_decoder = local_decoder(ts.graphdef, state, ts.mesh,
                                 tree or tree_lib.default_tree(decoder.args.drafting_depths()))
  out.update(decode_metrics(decoder, prompts, max_new_tokens, batch_size=batch_size or 0,
                            compare=True, tree_decoder=tree_decoder))
  return out


def format_table(r: dict) -> str:
  """A readable report of evaluate_workdir's dict."""
  mtp_depth = r['mtp_depth']
  lines = [f"{r['workdir']}  step {r['step']}  split {r['split']}  "
           f"({r['eval_batches']} batches, {int(r['eval/tokens'])} tokens)", '',
           f"{'depth':<8}{'loss':>9}{'acc':>9}{'agree':>9}{'bpb':>9}"]
  for k in range(mtp_depth + 1):
    stat = lambda s, k=k: r[metric_key('eval', s, k)]  # noqa: E731
    agree = f"{stat('agree'):9.4f}" if k else f"{'-':>9}"
    lines.append(f"{depth_name(k).replace('_', ' '):<8}{stat('loss'):9.4f}"
                 f"{stat('acc'):9.4f}{agree}{stat('bpb'):9.4f}")
  lines += ['loss: cross-entropy in nats per token; acc: top-1 accuracy; agree: agreement with '
            "the main model's prediction; bpb: bits per byte of text", '']
  if r.get('decode_note'):
    lines.append(r['decode_note'])
  if r['decode_prompts']:
    lines.append(f"greedy decoding: {r['decode_prompts']} validation prompts of "
                 f"{r['decode_prompt_len']} tokens, {r['decode_max_new_tokens']} new tokens each")
  if TAU_KEY in r:
    accept = '  '.join(f"{r[metric_key('eval', 'decode_accept', k)]:.3f}"
                       for k in range(1, mtp_depth + 1))
    lines.append(f'tau (mean accepted length) {r[TAU_KEY]:.3f} of at most {mtp_depth + 1}; '
                 f'acceptance per depth {accept}')
    lines.append('(tau counts the tokens kept: the last verify step of each prompt stops at '
                 'its new-token limit, so tau stays below the most even when every draft is '
                 'accepted)')
  if 'eval/decode_tree' in r:
    accept = '  '.join(f"{r[metric_key('eval', 'decode_tree_accept', k)]:.3f}"
                       for k in range(1, len(r['eval/decode_tree'].split(',')) + 1)
                       if metric_key('eval', 'decode_tree_accept', k) in r)
    lines.append(f"tree {r['eval/decode_tree']}: tau {r['eval/decode_tree_tau']:.3f}; "
                 f'acceptance per tree depth {accept}')
  if 'eval/decode_ar_tokens_per_sec' in r:
    text = f"AR {r['eval/decode_ar_tokens_per_sec']:.1f} tok/s"
    if 'eval/decode_speedup' in r:
      text += (f"   spec {r['eval/decode_spec_tokens_per_sec']:.1f} tok/s   speedup "
               f"{r['eval/decode_speedup']:.2f}x   identical {r['eval/decode_identical']}")
    if 'eval/decode_tree_speedup' in r:
      text += (f"\ntree {r['eval/decode_tree_tokens_per_sec']:.1f} tok/s   speedup "
               f"{r['eval/decode_tree_speedup']:.2f}x   identical "
               f"{r['eval/decode_tree_identical']}")
    lines.append(text)
  return '\n'.join(lines)
