"""Decoding a trained workdir from text: prompt files, `decode_workdir`, token provenance.

What scripts/decode.py and the notebooks need around `Decoder`: prompts read
from flags or a file, a checkpoint restored and decoded in one call, and which depth
proposed each generated token.
"""
from __future__ import annotations

import json
import os

import numpy as np

import mtp_jax.decode.acceptance as acceptance_lib
import mtp_jax.decode.cost as cost_lib
import mtp_jax.decode.tree as tree_lib
from mtp_jax.checkpoint.reader import load_workdir
from mtp_jax.data import tokenizers
from mtp_jax.decode.decoder import AUTO, Decoder, DecodeResult, check_request
from mtp_jax.errors import RequestError
from mtp_jax.runtime import peak as peak_lib
from mtp_jax.train_state.restore import restore_model_at


# -- prompts and a workdir, end to end (scripts/decode.py) --------------------------------------
def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
  """--prompt, or --prompts_file: one prompt per line, or per JSON line in a .jsonl file."""
  if (prompt is None) == (prompts_file is None):
    raise RequestError('give exactly one of --prompt and --prompts_file')
  if prompt is not None:
    if not prompt:
      raise RequestError('--prompt is empty')
    return [prompt]
  try:
    with open(prompts_file, encoding='utf-8') as f:
      lines = f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise RequestError(f'--prompts_file {prompts_file!r} cannot be read: {e}') from e
  prompts = []
  for i, line in enumerate(lines, 1):
    if prompts_file.endswith('.jsonl'):
      if not line.strip():
        continue
      try:
        item = json.loads(line)
      except json.JSONDecodeError as e:
        raise RequestError(f'--prompts_file line {i} is not JSON: {e}') from e
      line = item.get('prompt') if isinstance(item, dict) else item
      if not isinstance(line, str):
        raise RequestError(f'--prompts_file line {i}: expected a string or {{"prompt": ...}}')
    if not line:
      raise RequestError(f'--prompts_file line {i}: empty prompt')
    prompts.append(line)
  if not prompts:
    raise RequestError(f'--prompts_file {prompts_file!r} holds no prompts')
  return prompts


def decode_workdir(workdir: str, prompts: list[str], *, mode: str, max_new_tokens: int = 128,
                   temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                   batch_size: int = 1, seed: int = 0, max_len: int = 0,
                   num_drafts: int | str | None = None, tree: str | None = None,
                   acceptance_prompts: list[str] | None = None, max_rows: int = 0,
                   log=lambda s: None) -> dict:
  """What scripts/decode.py does: checks everything, restores, decodes, reports.

  mode: spec | ar | compare (both, on the same prompts). max_len: cache positions per
  row (0: the training sequence length). num_drafts: MTP depths drafting in spec mode
  (None: every depth; 0: none, which decodes as plain autoregression), as Decoder.generate.
  tree: draft this tree (tree.parse_tree) in spec mode; compare then runs AR, the chain
  and the tree side by side and reports the tree's figures under `tree_...`.
  tree 'auto' / num_drafts 'auto': the picker's shape (picker.py; 'auto' drafts: chains
  only), from the workdir's stored acceptance rates for this sampling setting, measured
  first on `acceptance_prompts` (default: the prompts) and stored when absent, and this
  backend's calibrated cost; `auto` in the result says what it chose and why, and
  compare adds the expected speed-up beside the measured one. max_rows: the picker's
  row budget (0: picker.MAX_ROWS). log: progress lines (calibration, the choice).
  """
  if mode not in ('spec', 'ar', 'compare'):
    raise RequestError(f'--mode must be spec, ar or compare, got {mode!r}')
  if batch_size <= 0:
    raise RequestError(f'--batch_size must be > 0, got {batch_size}')
  auto = AUTO in (tree, num_drafts)
  if num_drafts == AUTO:
    if tree not in (None, AUTO):
      raise RequestError('--num_drafts auto picks a chain; give --tree auto to pick among '
                         'trees too, or a --tree without --num_drafts')
    num_drafts = None
  if max_len < 0 or max_rows < 0 or (num_drafts is not None and num_drafts < 0):
    raise RequestError('--max_len, --max_rows and --num_drafts must be >= 0')
  check_request([[0]], max_new_tokens, temperature, top_k, top_p)
  chains_only = auto and tree != AUTO
  if tree is not None and tree != AUTO:
    tree = tree_lib.parse_tree(tree)
  config, step = load_workdir(workdir)
  # 'auto' (as trained, whatever the training resolved it to) decodes in float32: the
  # speculative output must equal plain decoding's (peak_lib.compute_dtype)
  peak_lib.resolve_model_dtype(config, 'decode')
  mtp_depth = int(config.model.mtp.depth)
  if mode != 'ar' and mtp_depth == 0:
    raise RequestError(f'--mode {mode} needs MTP modules, but the checkpoint in {workdir!r} has '
                       'model.mtp.depth = 0 (use --mode ar)')
  if num_drafts is not None and num_drafts > mtp_depth:
    raise RequestError(f'--num_drafts {num_drafts} exceeds the checkpoint\'s model.mtp.depth '
                       f'({mtp_depth})')
  tokenizer = tokenizers.get_tokenizer(config.data)
  ids = [list(tokenizer.encode(p)) for p in prompts]
  max_len = max_len or int(config.data.seq_len)
  check_request(ids, max_new_tokens, temperature, top_k, top_p,
                vocab_size=config.model.vocab_size, max_len=max_len)

  model, step = restore_model_at(config, workdir, step, fallback=True)
  decoder = Decoder(model)
  choice = None
  if auto and mode != 'ar':
    if tree == AUTO and not model.args.mtp_head().chained:
      chains_only = True  # parallel heads draft chains only
    acc = workdir_acceptance(workdir, decoder, [list(tokenizer.encode(p)) for p in
                                                (acceptance_prompts or prompts)],
                             max_new_tokens, temperature, top_k, top_p, log)
    chooser = decoder.with_tree(AUTO)
    chooser.acceptance, chooser.max_rows = acc, max_rows or chooser.max_rows
    choice = chooser.choose(batch_size, max(map(len, ids)), max_new_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p,
                            chains_only=chains_only, log=log)
    log(choice.line())
    tree, num_drafts = choice.tree, choice.num_drafts
  modes = ['ar', 'spec'] if mode == 'compare' else [mode]
  drafts = {'ar': 0, 'spec': mtp_depth if num_drafts is None else num_drafts}
  tree_decoder = None if tree is None or mode == 'ar' else Decoder(model, tree=tree)
  if tree_decoder and mode == 'spec':
    decoder, drafts['spec'] = tree_decoder, tree_decoder.tree.depth
  kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=tokenizer.eos_id,
            seed=seed, pad_to=(max(map(len, ids)), max_new_tokens))
  results = {m: decoder.generate_batched(ids, max_new_tokens, batch_size=batch_size,
                                         warm_up=True, num_drafts=drafts[m], **kw)
             for m in modes}
  out = {'workdir': os.path.abspath(workdir), 'step': step, 'mode': mode,
         'compute_dtype': str(config.model.dtype),
         'num_drafts': drafts['spec'] if mode != 'ar' else 0, 'temperature': temperature,
         'batch_size': batch_size}
  for m, r in results.items():
    texts = [tokenizer.decode(t) for t in r.tokens]
    prefix = '' if mode != 'compare' else f'{m}_'
    st = r.stats()
    out.update({f'{prefix}outputs': texts, f'{prefix}tokens_per_sec': st['tokens_per_sec'],
                f'{prefix}seconds': st['seconds']})
    if m == 'spec' or mode == 'ar':
      out.update({k: st[k] for k in ('new_tokens', 'verify_steps', 'mean_accepted_length',
                                     'acceptance_per_depth', 'conditional_acceptance')})
  if mode == 'compare':
    same = all(np.array_equal(a, b) for a, b in zip(results['ar'].tokens, results['spec'].tokens))
    out['identical'] = same if temperature == 0 else None  # sampled outputs differ by design
    out['speedup'] = results['ar'].seconds / max(results['spec'].seconds, 1e-12)
  if tree_decoder:
    out.update(_tree_figures(tree_decoder, ids, max_new_tokens, batch_size, kw, mode, results))
  if choice is not None:
    out['auto'] = choice.line()
    out.update(choice.summary())
    if mode == 'compare':
      run = 'tree_' if tree_decoder else ''
      out['auto_measured_speedup'] = out[f'{run}speedup']
      out['auto_measured_tau'] = out[f'{run}mean_accepted_length']
  return out


def workdir_acceptance(workdir: str, decoder, prompts, max_new_tokens: int, temperature: float,
                       top_k: int, top_p: float, log=lambda s: None):
  """The workdir's stored acceptance rates for this sampling setting; measured on `prompts`
  (acceptance.measure) and stored first when absent."""
  depth = cost_lib.max_depth(decoder.args)
  acc = acceptance_lib.load(workdir, temperature, top_k, top_p, depth)
  if acc is None:
    log(f'measuring acceptance rates ({acceptance_lib.sampling_key(temperature, top_k, top_p)})'
        f' on {len(prompts)} prompts')
    acc = acceptance_lib.measure(decoder, prompts, min(max_new_tokens, 128), depths=depth,
                                 temperature=temperature, top_k=top_k, top_p=top_p)
    log(f'stored in {acceptance_lib.store(workdir, acc)}')
  return acc


def _tree_figures(decoder, ids, max_new_tokens, batch_size, kw, mode, results) -> dict:
  """The tree's decode summary: its FLOPs per verify step beside the chain's of the same
  depth; compare: its own run, tau, speed-up over AR and over the chain."""
  tree = decoder.tree
  chain = tree_lib.flops_per_iteration(decoder.args, None, tree.depth)['flops']
  flops = tree_lib.flops_per_iteration(decoder.args, tree, tree.depth)['flops']
  out = {'tree': str(tree), 'tree_nodes': tree.size, 'tree_flops_per_step': flops,
         'tree_extra_flops_per_step': flops - chain,
         'tree_flops_vs_chain': flops / chain}
  if mode != 'compare':
    return out
  r = decoder.generate_batched(ids, max_new_tokens, batch_size=batch_size, warm_up=True, **kw)
  st = r.stats()
  same = all(np.array_equal(a, b) for a, b in zip(results['ar'].tokens, r.tokens))
  out.update({'tree_outputs_identical': same if kw['temperature'] == 0 else None,
              'tree_tokens_per_sec': st['tokens_per_sec'], 'tree_seconds': st['seconds'],
              'tree_mean_accepted_length': st['mean_accepted_length'],
              'tree_acceptance_per_depth': st['acceptance_per_depth'],
              'tree_speedup': results['ar'].seconds / max(r.seconds, 1e-12),
              'tree_vs_chain_speedup': results['spec'].seconds / max(r.seconds, 1e-12)})
  return out


# -- provenance of generated tokens ----------------------------------------------------------
def token_sources(result: DecodeResult) -> list[np.ndarray]:
  """Per row, per generated token: 0 = the main model's own token, k = accepted draft of depth k.

  The prefill's token and each verify step's bonus are 0; a verify step that accepted a
  drafts commits [1, 2, .., a, 0], cut short where the row stopped (EOS, max_new_tokens).
  Needs a result of generate(..., record=True).

  The accepted count of each step is read back from what was recorded: the step's
  committed block (history_length to the next step, or the row's end) begins with
  exactly the accepted drafts, because the bonus never equals the draft it replaces
  (greedy: a stops at the first d_{j+1} != g_j; sampling: the rejected draft has
  probability 0 under normalize(max(0, p - q))).
  """
  if result.history_length is None:
    raise ValueError('token_sources needs a DecodeResult of generate(..., record=True)')
  if result.tree is not None:
    raise ValueError("token_sources reads a chain's drafts; a tree decoder records its nodes")
  out = []
  for row, toks in enumerate(result.tokens):
    src = np.zeros(len(toks), np.int32)
    lengths = result.history_length[:, row]
    steps = np.flatnonzero(lengths >= 0)
    if len(steps):  # active from step 0 (only the prefill can finish a row earlier)
      start = int(lengths[steps[0]]) - 1  # position of the first generated token
      ends = np.append(lengths[steps[1:]], start + len(toks))
      for it, n, end in zip(steps, lengths[steps], ends):
        block = toks[n - start:end - start]
        drafts = result.history_drafts[it, row, :len(block)]
        a = int(np.cumprod(block[:len(drafts)] == drafts).sum())
        src[n - start:n - start + a] = np.arange(1, a + 1)
    out.append(src)
  return out
