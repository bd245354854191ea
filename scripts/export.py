"""Exports a trained checkpoint (trunk + MTP modules) as a Hugging Face-layout directory.

  python scripts/export.py --workdir W --out DIR --layout deepseek_v3|mimo [--step N]
      [--fp8] [--shard_mb N] [--json]

deepseek_v3: DeepSeek-V3's names (MTP depth k at model.layers.{N+k-1}: enorm / hnorm /
eh_proj / shared_head.*; MLA + MoE blocks; rotary rows in DeepSeek's interleaved order), for
MLA models; --fp8 stores the projection weights as float8_e4m3fn + 128 x 128
weight_scale_inv as DeepSeek's release does (lossy). mimo: Xiaomi MiMo's MTP layers on a
Qwen2 trunk (model.mtp_layers.{k-1}.*, zero q/k/v biases), for dense GQA models. Without
--fp8 every tensor is float32 as trained and reads back bit-exactly
(mtp_jax.interop.convert.load_dir). Layouts and the loaders they were checked against:
mtp_jax/interop/convert.py.

Intentionally thin: parse flags, call mtp_jax.interop.convert.export_workdir. Bad input exits with
code 2 and a one-line error, before anything is restored.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mtp_jax import cli  # noqa: E402  (argparse only; JAX starts after the flags)

LAYOUTS = ('deepseek_v3', 'mimo')  # mtp_jax.interop.convert.LAYOUTS, without importing JAX first


def parse(argv):
  p = cli.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--workdir', required=True, help='training workdir')
  p.add_argument('--out', required=True, help='output directory (new or empty)')
  p.add_argument('--layout', required=True, choices=LAYOUTS, help='MTP naming to write')
  p.add_argument('--step', type=int, help='checkpoint step (default: the latest)')
  p.add_argument('--fp8', action='store_true',
                 help='deepseek_v3: FP8 e4m3 projection weights + weight_scale_inv (lossy)')
  p.add_argument('--shard_mb', type=int, default=4096,
                 help='safetensors shard size in MiB (more: model.safetensors.index.json)')
  p.add_argument('--json', action='store_true', help='print one JSON object')
  args = p.parse_args(argv)
  if args.shard_mb <= 0:
    p.error(f'--shard_mb must be positive, got {args.shard_mb}')
  return args


def main(argv=None) -> int:
  args = parse(argv)
  from absl import logging
  from mtp_jax.interop import convert  # after flag parsing: JAX starts here
  logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
  try:
    out = convert.export_workdir(args.workdir, args.out, args.layout, step=args.step,
                                 fp8=args.fp8, shard_bytes=args.shard_mb << 20)
  except Exception as e:  # pylint: disable=broad-except
    return cli.report_expected(e)  # bad input, a broken checkpoint: 2 and one line
  if args.json:
    print(json.dumps(out))
  else:
    print(f"Exported step {out['step']} ({out['params']:,} parameters, MTP depth "
          f"{out['mtp_depth']}) as {out['layout']} to {out['out']}: {out['tensors']} tensors, "
          f"{out['bytes'] / 2**20:.1f} MiB{' (FP8)' if out['fp8'] else ''}")
  return 0


if __name__ == '__main__':
  sys.exit(main())
