"""Decodes with a trained checkpoint: speculative (MTP drafts), plain autoregressive, or both.

  mtp-decode --workdir DIR (--prompt TEXT | --prompts_file FILE)
      [--max_new_tokens N] [--temperature T] [--top_k K] [--top_p P] [--batch_size B]
      [--mode {spec,ar,compare}] [--tree SHAPE] [--json]

Parses flags and calls mtp_jax.decode.generate.decode_workdir. Bad input exits
with code 2 and a one-line error, before anything is compiled. Each prompt is printed
apart from its continuation (dimmed on a terminal, under `[prompt]` / `[continuation]`
headings elsewhere; NO_COLOR=1 asks for the headings); --json gives both as plain strings.
"""
from __future__ import annotations

import json
import os
import sys

import mtp_jax.commands.common as common
from mtp_jax import cli  # argparse only: JAX starts after the flags


def parse(argv):
  p = cli.ArgumentParser(prog='mtp-decode', description=__doc__.splitlines()[0])
  p.add_argument('--workdir', required=True, help='training workdir (latest checkpoint is used)')
  p.add_argument('--prompt', help='one prompt')
  p.add_argument('--prompts_file', help='one prompt per line (.jsonl: one JSON string per line)')
  common.add_sampling_flags(p, max_new_tokens=128, temperature=0.0)
  p.add_argument('--batch_size', type=cli.positive_int, default=1, help='prompts decoded together')
  p.add_argument('--mode', default='spec', choices=('spec', 'ar', 'compare'),
                 help='spec: MTP drafts verified by the main model (lossless); ar: plain '
                 'autoregressive; compare: both, with their speeds and whether they agree')
  p.add_argument('--json', action='store_true', help='print one JSON object')
  p.add_argument('--seed', type=int, default=0, help='sampling seed')
  p.add_argument('--max_len', type=cli.non_negative_int, default=0,
                 help='positions per row, prompt + new tokens (0: the training seq_len)')
  p.add_argument('--num_drafts', type=drafts_arg,
                 help='MTP depths to draft with (default: all; 0: none, plain decoding; auto: '
                 'the chain length expected fastest on this machine)')
  p.add_argument('--tree', help='draft a tree: candidates per depth (3,2,1) or nodes as rank '
                 'paths (0;1;0.0); auto: the chain or tree expected fastest on this machine; '
                 'compare runs AR, the chain and the tree')
  p.add_argument('--max_rows', type=cli.non_negative_int, default=0,
                 help='auto: the most rows a verify pass may have per prompt (default 16)')
  return p.parse_args(argv)


def drafts_arg(text: str):
  return text if text == 'auto' else cli.non_negative_int(text)


RULE = '-' * 40
TREE_KEYS = ('tree', 'tree_mean_accepted_length', 'tree_tokens_per_sec', 'tree_speedup',
             'tree_vs_chain_speedup', 'tree_outputs_identical', 'tree_extra_flops_per_step',
             'tree_flops_vs_chain')


def show(prompt: str, text: str, styled: bool) -> str:
  """One prompt and its continuation, marked apart so the model's text is never read as a
  change to the prompt: on a terminal the prompt is dimmed and the continuation follows
  it in place; elsewhere (a pipe, a file) each is under its own heading."""
  if styled:
    return f'\x1b[2m{prompt}\x1b[0m{text}\n{RULE}'
  return f'[prompt]\n{prompt}\n[continuation]\n{text}\n{RULE}'


def main(argv=None) -> int:
  args = parse(argv)
  files = () if args.prompts_file is None else ((args.prompts_file, '--prompts_file'),)
  return common.run_on_workdir(args.workdir, lambda: decode(args), files)


def held_out(workdir: str, n: int = 8):
  """Up to n held-out validation prompts of the workdir's data (what the picker's
  acceptance rates are measured on); None when its split holds too few documents."""
  from mtp_jax.checkpoint.reader import load_workdir  # pylint: disable=import-outside-toplevel
  from mtp_jax.config.readers import decode_prompt_len  # pylint: disable=import-outside-toplevel
  from mtp_jax.data import tokenizers  # pylint: disable=import-outside-toplevel
  from mtp_jax.errors import ConfigError  # pylint: disable=import-outside-toplevel
  from mtp_jax.train import evaluation  # pylint: disable=import-outside-toplevel
  config, _ = load_workdir(workdir)
  tokenizer = tokenizers.get_tokenizer(config.data)
  try:
    ids = evaluation.validation_prompts(config, tokenizer, n,
                                        decode_prompt_len(config))
  except ConfigError:
    return None
  return [tokenizer.decode(p) for p in ids]


def decode(args) -> int:
  from mtp_jax.decode import generate  # after flag parsing: JAX starts here
  prompts = generate.read_prompts(args.prompt, args.prompts_file)
  auto = 'auto' in (args.tree, args.num_drafts)
  out = generate.decode_workdir(
      args.workdir, prompts, mode=args.mode, max_new_tokens=args.max_new_tokens,
      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
      batch_size=args.batch_size, seed=args.seed, max_len=args.max_len,
      num_drafts=args.num_drafts, tree=args.tree, max_rows=args.max_rows,
      acceptance_prompts=held_out(args.workdir) if auto else None,
      log=lambda s: print(s, file=sys.stderr, flush=True))
  if args.json:
    print(json.dumps(out))
    return 0
  outputs = out['spec_outputs' if args.mode == 'compare' else 'outputs']
  styled = sys.stdout.isatty() and not os.environ.get('NO_COLOR')
  for prompt, text in zip(prompts, outputs):
    print(show(prompt, text, styled))
  keys = ('compute_dtype', 'new_tokens', 'verify_steps', 'mean_accepted_length', 'tokens_per_sec',
          'ar_tokens_per_sec', 'spec_tokens_per_sec', 'speedup', 'identical')
  keys += TREE_KEYS + ('auto_expected_speedup', 'auto_measured_speedup', 'auto_expected_tau',
                       'auto_measured_tau')
  summary = {k: out[k] for k in keys if k in out}
  print(' '.join(f'{k}={v:.3g}' if isinstance(v, float) else f'{k}={v}'
                 for k, v in summary.items()), file=sys.stderr)
  return 0


if __name__ == '__main__':
  sys.exit(main())
