"""Exports a trained checkpoint as a Hugging Face-layout directory that serving code loads.

  mtp-export --workdir W --out DIR --layout llama|deepseek_v3|mimo [--step N] [--fp8]
      [--shard_mb N] [--json]

llama: the trunk as a Llama (or, with q/k/v biases, Qwen2) causal LM, for dense GQA models;
the MTP modules are not written (the layout has no names for them). deepseek_v3:
DeepSeek-V3's names (MTP depth k at model.layers.{N+k-1}: enorm / hnorm / eh_proj /
shared_head.*; MLA + MoE blocks; rotary rows in DeepSeek's interleaved order), for MLA
models; --fp8 stores the projection weights as float8_e4m3fn + 128 x 128 weight_scale_inv
as DeepSeek's release does (lossy). mimo: Xiaomi MiMo's MTP layers on a Qwen2 trunk
(model.mtp_layers.{k-1}.*), for dense GQA models. Every export holds config.json,
generation_config.json and the tokenizer, so transformers' AutoModelForCausalLM and
AutoTokenizer load it, and `--init_from hf:DIR` trains from it. Without --step the newest
intact checkpoint is read, so a run that is training right now can be exported.

Parses flags and calls mtp_jax.interop.export.export_workdir. Bad input exits with code 2
and a one-line error, before anything is restored.
"""
from __future__ import annotations

import json
import os
import sys

import mtp_jax.commands.common as common
from mtp_jax import cli  # argparse only: JAX starts after the flags

# mtp_jax.interop.layouts.LAYOUTS, without importing JAX before the flags are parsed
LAYOUTS = ('llama', 'deepseek_v3', 'mimo')


def parse(argv):
  p = cli.ArgumentParser(prog='mtp-export', description=__doc__.splitlines()[0])
  p.add_argument('--workdir', required=True, help='training workdir')
  p.add_argument('--out', required=True, help='output directory (new or empty)')
  p.add_argument('--layout', required=True, choices=LAYOUTS, help='tensor names to write')
  p.add_argument('--step', type=int,
                 help='checkpoint step (default: the newest intact one)')
  p.add_argument('--fp8', action='store_true',
                 help='deepseek_v3: FP8 e4m3 projection weights + weight_scale_inv (lossy)')
  p.add_argument('--shard_mb', type=int, default=4096,
                 help='safetensors shard size in MiB (more: model.safetensors.index.json)')
  p.add_argument('--json', action='store_true', help='print one JSON object')
  args = p.parse_args(argv)
  if args.shard_mb <= 0:
    p.error(f'--shard_mb must be positive, got {args.shard_mb}')
  if args.step is not None and args.step < 0:
    p.error(f'--step must be >= 0, got {args.step}')
  return args


def main(argv=None) -> int:
  args = parse(argv)
  return common.run_on_workdir(args.workdir, lambda: export_and_report(args))


def export_and_report(args) -> int:
  from mtp_jax.interop import export  # pylint: disable=g-import-not-at-top  (JAX starts here)
  out = export.export_workdir(args.workdir, args.out, args.layout, step=args.step,
                              fp8=args.fp8, shard_bytes=args.shard_mb << 20)
  if args.json:
    print(json.dumps(out))
    return 0
  mtp = (f"MTP depth {out['mtp_depth']}" if out['mtp_depths_written'] == out['mtp_depth']
         else f"MTP depth {out['mtp_depth']} not written: the {out['layout']} layout has no "
         'MTP names (use --layout mimo or deepseek_v3)')
  print(f"Exported step {out['step']} ({out['params']:,} parameters, {mtp}) as "
        f"{out['layout']} to {out['out']}: {out['tensors']} tensors, "
        f"{out['bytes'] / 2**20:.1f} MiB{' (FP8)' if out['fp8'] else ''}")
  from mtp_jax.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  again = metrics_lib.train_from_command(args.workdir, os.path.normpath(out['out']) + '_train',
                                         [f"--init_from=hf:{out['out']}"])
  print(f"Load it: transformers.AutoModelForCausalLM.from_pretrained({out['out']!r})")
  print(f'Train from it: {again}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
