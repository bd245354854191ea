"""The human-readable report of compile_report's dict, one block per program, per chip."""
from __future__ import annotations

from mtp_jax.train.aot.figures import GIB, PROGRAMS


def format_report(report: dict) -> str:
  """The human-readable report: one block per program, per chip."""
  chip = report['chip']
  hbm = chip['hbm_bytes']
  lines = [f'{report["topology"]} ({report["chips"]} chips x {report["num_slices"]} slice(s), '
           f'{report["device_kind"]}, {hbm / GIB:.1f} GiB HBM, '
           f'{chip["bf16_tflops"]:.0f} TFLOP/s bf16 per chip); compiled in '
           f'{report["compile_s"]:.1f} s']
  if 'mesh' in report:
    lines.append(f'mesh {report["mesh"]}; per chip: parameters {report["param_bytes"] / GIB:.3f} '
                 f'GiB, optimizer {report["optimizer_bytes"] / GIB:.3f} GiB, batch '
                 f'{report["batch_bytes"] / 2 ** 20:.2f} MiB')
    for p in report['largest_params'][:3]:
      info = report['params'][p]
      lines.append(f'  {p} {list(info["shape"])} {info["dtype"]}: {info["spec"]}')
    if report['replicated_params']:
      lines.append(f'  replicated (>= 1 MiB): {", ".join(report["replicated_params"][:6])}')
  for name in PROGRAMS:
    prog = report.get(name)
    if not prog:
      continue
    mem, est = prog['memory'], prog['estimate']
    cached = ' (figures from the cache)' if prog.get('cached') else ''
    lines.append(
        f'{name}: compile {prog["compile_s"]:.1f} s{cached}; HBM per chip '
        f'{mem["total"] / GIB:.2f} of '
        f'{hbm / GIB:.1f} GiB ({100 * prog["hbm_fraction"]:.0f} %): arguments '
        f'{mem["argument"] / GIB:.2f}, outputs {mem["output"] / GIB:.2f} (aliased '
        f'{mem["alias"] / GIB:.2f}), temporaries {mem["temp"] / GIB:.2f} GiB')
    kernels = prog.get('kernels') or {}
    kernel_text = '; '.join(
        f'{kind.replace("_", " ")} {k["calls"]:.0f} calls, {k["flops"]:.4g} FLOPs'
        for kind, k in sorted(kernels.items()))
    flop_line = (f'  FLOPs per chip per step {prog["hlo_matmul_flops"]:.4g} (matmuls in the HLO'
                 + (f' and kernel calls: {kernel_text}' if kernel_text else '') + ')')
    if name == 'train':
      flop_line += (f'; flops.py {report["flops_py"]["model_train_per_chip"]:.4g} (ratio '
                    f'{prog["flops_ratio_vs_flops_py"]:.3f}); with the full T x T scores '
                    'and the recomputed forward '
                    f'{report["flops_py"]["expected_compiled_per_chip"]:.4g}'
                    f' (ratio {prog["flops_ratio_vs_expected"]:.3f})')
    lines.append(flop_line)
    coll = prog['collectives']
    lines.append('  collectives per step: ' + (', '.join(
        f'{op} {c["count"]:.0f}x {c["bytes"] / 2 ** 20:.1f} MiB' for op, c in sorted(coll.items()))
        or 'none'))
    priced = prog.get('priced')
    if priced:
      lines += priced_lines(priced, name)
    ici = 'n/a' if est['ici_s'] is None else f'{est["ici_s"] * 1e3:.2f} ms'
    hbm_t = (f'{est["hbm_s"] * 1e3:.2f} for {est["hbm_bytes"] / GIB:.1f} GiB'
             if est.get('hbm_bytes') else 'n/a')
    est_line = (f'  roofline (a lower bound on the step time): {est["step_s"] * 1e3:.2f} ms '
                f'(compute {est["compute_s"] * 1e3:.2f}, HBM {hbm_t}, ICI {ici})')
    if name == 'train' and est.get('mfu'):
      est_line += f', MFU <= {est["mfu"]:.2f}'
    lines.append(est_line)
    if priced and priced['top_ops']:
      lines += top_ops_lines(priced)
  return '\n'.join(lines)


_BASIS_WORDS = {'compiler': 'compiler cycles', 'kernel roofline': 'kernel calls at their roofline',
                'ICI': 'collectives over ICI', 'roofline': 'other ops at their roofline'}


def priced_lines(priced: dict, name: str) -> list:
  """The headline step time: where it comes from, and its parts."""
  step = priced['step_s'] * 1e3
  mfu = f' (MFU {priced["mfu"]:.2f})' if name == 'train' and priced.get('mfu') else ''
  parts = ', '.join(f'{_BASIS_WORDS[b]} {t * 1e3:.2f}' for b, t in priced['by_basis'].items()
                    if t)
  if priced['basis'] == 'compiler' and priced['clock_ghz']:
    head = (f'  step priced by the TPU compiler\'s cost model: {step:.2f} ms{mfu}, its ops one '
            f'after another (estimated_cycles of {priced["ops_with_cycles"]} ops at an '
            f'assumed {priced["clock_ghz"]:.2f} GHz clock; kernel calls, collectives and '
            f'{priced["ops_without_cycles"]} ops without cycles at their roofline)')
  elif priced['basis'] == 'compiler':
    head = (f'  step priced by the compiler\'s cost model: {step:.2f} ms{mfu}, its ops one '
            f'after another ({priced["ops_with_cycles"]} ops by the compiler\'s estimate, '
            f'{priced["ops_without_cycles"]} at their roofline)')
  else:
    head = (f'  step with each op at its roofline (the compiled module prints no per-op '
            f'estimate; a lower bound): {step:.2f} ms{mfu}')
  return [head, f'    ms: {parts}']


def top_ops_lines(priced: dict) -> list:
  """The costliest ops of the priced step, one line each."""
  lines = ['  costliest ops:  ms/step  share     runs  what / priced by / instruction / JAX source']
  for op in priced['top_ops']:
    source = op['source'].split('/')
    source = '/'.join(source[-3:]) if len(source) > 3 else op['source']
    name = op['name'] + (f' (and {op["ops"] - 1} alike)' if op.get('ops', 1) > 1 else '')
    lines.append(f'    {op["time_s"] * 1e3:#17.4g} {100 * op["share"]:5.1f} % {op["runs"]:8.0f}  '
                 f'{op["kind"]} / {op["basis"]} / {name} / {source}')
  return lines
