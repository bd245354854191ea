"""Compiles a config's train step, eval step and decode loop for a TPU slice, on any machine.

  mtp-aot-compile --config configs/tpu_pod_1b.py --topology v5p-64 [--json]

Needs libtpu (`pip install -e '.[tpu]'`), no TPU. Prints per chip: parameter, optimizer and
batch bytes, the compiled programs' HBM against the chip's, FLOPs per step beside
flops.py's count, the collectives of the compiled HLO, the step time and MFU priced by the
TPU compiler's own per-op cost estimates with the costliest ops, and the roofline beside it
as a lower bound on the step time (docs/scaling.md). Exit 0: everything fits; 1: a program
does not fit the chip's HBM (one `error:` line with the shortfall and the largest
allocations); 2: bad input.
"""
from __future__ import annotations

import json
import os
import re
import sys

from mtp_jax import cli

PROGRAMS = ('train', 'eval', 'decode')


def parser() -> cli.ArgumentParser:
  p = cli.ArgumentParser(prog='mtp-aot-compile', description=__doc__.splitlines()[0])
  p.add_argument('--config', required=True, metavar='FILE', help=cli.CONFIG_HELP)
  p.add_argument('--topology', required=True,
                 help='Cloud TPU accelerator type: v4-N, v5p-N (N TensorCores, 2 per chip), '
                 'v5e-N / v5litepod-N, v6e-N (N chips)')
  p.add_argument('--num_slices', type=cli.positive_int, default=1,
                 help='slices joined over the data-center network (multislice); the mesh '
                 'shape must cover all their chips (default: %(default)s)')
  p.add_argument('--programs', default=','.join(PROGRAMS),
                 help='comma-separated programs to compile: train, eval, decode '
                 '(default: %(default)s)')
  p.add_argument('--decode_batch', type=cli.positive_int, default=1,
                 help='rows of the compiled decode loop (default: %(default)s)')
  p.add_argument('--decode_tokens', type=cli.positive_int, default=64,
                 help='new tokens the compiled decode loop is sized for (default: %(default)s)')
  p.add_argument('--pick_draft_shape', metavar='FILE',
                 help="a workdir's decode_acceptance.json: instead of the programs, price the "
                 "decode passes on one chip and print the draft shape (chain or tree) the "
                 "picker expects fastest there under those acceptance rates (greedy)")
  p.add_argument('--max_rows', type=cli.positive_int, default=16,
                 help='--pick_draft_shape: the most verify rows a shape may have per prompt')
  p.add_argument('--json', action='store_true', help='print the whole report as JSON')
  p.add_argument('--dump_hlo', metavar='DIR',
                 help='write each compiled program as HLO text to DIR/<program>.hlo.txt')
  p.add_argument('--cache_dir', default=None,
                 help="where each compiled program's figures are kept, keyed by the lowered "
                 "program, topology and compiler versions (default: ~/.cache/mtp_jax/aot; "
                 "'' turns it off): a rerun of the same compile reads them back")
  return p


def _programs(text: str) -> tuple:
  names = tuple(p.strip() for p in text.split(',') if p.strip())
  bad = [p for p in names if p not in PROGRAMS]
  if bad or not names:
    raise cli.RequestError(f'--programs must be some of {",".join(PROGRAMS)}, got {text!r}')
  return names


def main(argv=None) -> int:
  args, overrides = cli.parse_with_config(parser(), argv)
  try:
    config = cli.load_config(args.config, overrides)
    wanted = _programs(args.programs)
    for name in ('num_slices', 'decode_batch', 'decode_tokens'):
      if getattr(args, name) < 1:
        raise cli.RequestError(f'--{name} must be a positive integer, got {getattr(args, name)}')
  except (cli.ConfigError, cli.RequestError) as e:
    return cli.report_expected(e)
  cli.quiet_library_logs()
  # JAX starts here, after the flags are known to be good; the compile-only TPU devices
  # need no TPU, and this process's own backend stays the CPU.
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  # libtpu looks for the TPU VM it runs on and warns at length when there is none; it is
  # told this one host and the slice being compiled for (no device is opened either way).
  accelerator = args.topology.strip().lower().replace('v5e-', 'v5litepod-')
  if re.fullmatch(r'(v4|v5p|v5litepod|v6e)-\d+', accelerator):
    os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
    os.environ.setdefault('TPU_ACCELERATOR_TYPE', accelerator)
  # the trainer's TPU compiler flags, read by libtpu when the topology is created below
  from mtp_jax.runtime import tpu_flags  # pylint: disable=g-import-not-at-top
  tpu_flags.apply()
  from mtp_jax.train.aot import devices, figures, programs  # pylint: disable=g-import-not-at-top
  from mtp_jax.train.aot import report as report_lib  # pylint: disable=g-import-not-at-top
  cache = args.cache_dir
  if cache is None:
    cache = os.path.join(os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'),
                         'mtp_jax', 'aot')
  log = (lambda s: print(s, file=sys.stderr)) if args.json else print
  try:
    topo = devices.parse_topology(args.topology, args.num_slices)
    if args.pick_draft_shape:
      return _pick(args, config, topo, log)
    report = programs.compile_report(config, topo, wanted, decode_batch=args.decode_batch,
                                     decode_tokens=args.decode_tokens, log=log,
                                     dump_dir=args.dump_hlo, cache_dir=cache or None)
    if args.json:
      print(json.dumps(report, indent=1, default=str))
    else:
      print(report_lib.format_report(report))
    figures.check_fits(report, topo)
  except Exception as e:  # pylint: disable=broad-except
    return cli.report_expected(e)
  return 0


def _pick(args, config, topo, log) -> int:
  from mtp_jax.decode import acceptance  # pylint: disable=g-import-not-at-top
  from mtp_jax.train.aot import decode_cost  # pylint: disable=g-import-not-at-top
  acc = acceptance.load_file(args.pick_draft_shape)
  choice = decode_cost.pick(config, topo, acc, batch=args.decode_batch,
                            new_tokens=args.decode_tokens, max_rows=args.max_rows, log=log)
  if args.json:
    print(json.dumps(choice.summary() | {
        'line': choice.line(), 'cost': choice.cost.to_json(),
        'ranked': [{'shape': c.name, 'rows': c.rows, 'tau': c.tau, 'ms': 1e3 * c.seconds,
                    'speedup': c.tokens_per_second / choice.ar.tokens_per_second}
                   for c in choice.ranked[:10]]}, indent=1))
  else:
    print(choice.line())
  return 0


if __name__ == '__main__':
  sys.exit(main())
