"""Evaluates a trained checkpoint: teacher-forced per-depth figures and free-running decoding.

  mtp-eval --workdir DIR [--split validation] [--step N] [--eval_batches N]
      [--num_prompts N] [--prompt_len N] [--max_new_tokens N] [--batch_size N]
      [--tree SHAPE] [--json]

Restores the checkpoint (default: the latest) with its saved config and tokenizer and
reports (a) per depth: validation loss, accuracy, agreement with the main model and
bits per byte, as the trainer's eval lines; (b) greedy decoding of held-out prompts:
tau, acceptance per depth, AR-vs-speculative speedup and whether both decoded the
same tokens, for the chain of drafts and for a draft tree (--tree: tau and acceptance
per tree depth beside the chain's). Keys are those of metrics.jsonl (`eval/...`). Unset
options take the trainer's own eval settings, so a checkpoint's figures repeat its
metrics.jsonl line.

Parses flags and calls mtp_jax.train.evaluation.evaluate_workdir. Bad input
exits with code 2 and a one-line error, before anything is compiled.
"""
from __future__ import annotations

import json
import sys

import mtp_jax.commands.common as common
from mtp_jax import cli  # argparse only: JAX starts after the flags


def parse(argv):
  p = cli.ArgumentParser(prog='mtp-eval', description=__doc__.splitlines()[0])
  p.add_argument('--workdir', required=True, help='training workdir')
  p.add_argument('--split', help='data split to evaluate on (default: data.eval_split)')
  p.add_argument('--step', type=cli.non_negative_int, help='checkpoint step (default: the latest)')
  p.add_argument('--eval_batches', type=cli.positive_int,
                 help='batches (default: train.eval_batches)')
  p.add_argument('--num_prompts', type=cli.non_negative_int,
                 help='prompts to decode (default: train.eval_decode_prompts, or 8; 0: skip)')
  p.add_argument('--prompt_len', type=cli.positive_int,
                 help='prompt tokens (default: data.seq_len // 2)')
  p.add_argument('--max_new_tokens', type=cli.positive_int,
                 help='tokens per prompt (default: train.eval_decode_tokens, within data.seq_len)')
  p.add_argument('--batch_size', type=cli.positive_int,
                 help='prompts decoded together (default: all)')
  p.add_argument('--tree', default='',
                 help='also decode with this draft tree, beside the chain (default: 3,2,1 cut '
                 'to the drafting depths; none: the chain only)')
  p.add_argument('--json', action='store_true', help='print one JSON object')
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse(argv)
  return common.run_on_workdir(args.workdir, lambda: evaluate(args))


def evaluate(args) -> int:
  from mtp_jax.train import evaluation  # after flag parsing: JAX starts here
  out = evaluation.evaluate_workdir(
      args.workdir, split=args.split, step=args.step, eval_batches=args.eval_batches,
      num_prompts=args.num_prompts, prompt_len=args.prompt_len,
      max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
      tree=None if args.tree == 'none' else args.tree)
  print(json.dumps(out) if args.json else evaluation.format_table(out))
  return 0


if __name__ == '__main__':
  sys.exit(main())
