"""Self-distilled MTP training data: samples continuations from a trained trunk (FastMTP).

  mtp-self-distill --workdir DIR --out OUT [--num_prompts N] [--prompt_len P]
      [--max_new_tokens M] [--temperature T] [--top_k K] [--top_p P] [--seed S]
      [--batch_size B] [--num_drafts K] [--split SPLIT] [--data FIELD=VALUE ...]

Prompts are seeded windows of documents of the workdir's own data (its train split by
default; `--data source=jsonl --data path=...` reads another corpus, any data.* field),
continuations are sampled from the newest checkpoint with mtp_jax's decoder, and
OUT/data.jsonl holds one record per prompt (token ids of prompt + continuation). The last
line is the command that trains MTP modules on it (the trunk's saved config with
data.source=jsonl, data.path=OUT/data.jsonl, data.tokens_key=tokens, the trunk frozen and
loaded from DIR, into OUT_mtp). Intentionally thin: parse flags, call
mtp_jax.research.distill.self_distill. Bad input exits with code 2 and one line, before compiling.
"""
from __future__ import annotations

import json
import os
import sys

import mtp_jax.commands.common as common
from mtp_jax import cli  # argparse only: JAX starts after the flags


def parse(argv):
  p = cli.ArgumentParser(prog='mtp-self-distill', description=__doc__.splitlines()[0])
  p.add_argument('--workdir', required=True, help='trained workdir (its newest checkpoint)')
  p.add_argument('--out', required=True, help='directory to write data.jsonl and meta.json')
  p.add_argument('--num_prompts', type=cli.positive_int, default=256)
  p.add_argument('--prompt_len', type=cli.positive_int, default=32, help='prompt tokens')
  common.add_sampling_flags(p, max_new_tokens=96, temperature=1.0)
  p.add_argument('--seed', type=int, default=0, help='prompt draw and sampling seed')
  p.add_argument('--batch_size', type=cli.positive_int, default=64, help='prompts decoded together')
  p.add_argument('--num_drafts', type=cli.non_negative_int, default=0,
                 help='0: autoregressive; k: speculative with k MTP depths (same distribution)')
  p.add_argument('--split', default='', help='prompt split (default: data.train_split)')
  p.add_argument('--data', action='append', default=[], metavar='FIELD=VALUE',
                 help='override a data.* field of the prompt corpus (repeatable)')
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse(argv)
  return common.run_on_workdir(args.workdir, lambda: self_distill(args))


def self_distill(args) -> int:
  from mtp_jax.research import distill  # after flag parsing: JAX starts here
  settings = distill.Settings(
      num_prompts=args.num_prompts, prompt_len=args.prompt_len,
      max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
      top_p=args.top_p, seed=args.seed, batch_size=args.batch_size,
      num_drafts=args.num_drafts, split=args.split)
  meta = distill.self_distill(args.workdir, args.out, settings, args.data,
                              notify=lambda s: print(s, file=sys.stderr))
  print(json.dumps(meta))
  print(f'train MTP modules on it: {train_command(args.workdir, args.out, meta)}',
        file=sys.stderr)
  return 0


def train_command(workdir: str, out: str, meta: dict) -> str:
  """The trunk's own config (its config.json) on the sampled data, the trunk frozen and
  loaded from `workdir`, into OUT_mtp: a command that runs as printed."""
  from mtp_jax.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  flags = [f'--init_from={workdir}', '--config.model.mtp.freeze_trunk=True']
  try:
    with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
      depth = json.load(f)['model']['mtp']['depth']
  except (OSError, ValueError, KeyError, TypeError):
    depth = 1
  if not depth:  # a trunk without MTP modules: train one
    flags.append('--config.model.mtp.depth=1')
  flags += [f'--config.{k}={v}' for k, v in meta['train_overrides'].items() if v != '']
  flags += [f'--config.{k}={v}' for k, v in meta.get('train_flags', {}).items()]
  return metrics_lib.train_from_command(workdir, os.path.normpath(out) + '_mtp', flags)


if __name__ == '__main__':
  sys.exit(main())
