"""The report's figures: FLOPs against flops.py's count, fit, and a roofline estimate.

  FLOPs     matmul FLOPs of the compiled HLO and its kernel calls (hlo.py), every loop
            body times its trip count, beside flops.py's model count and the count the
            compiled step should hold (`expected_compiled_flops`).
  priced    the step time priced op by op (pricing.py): the TPU compiler's own cycle
            estimates at the chip's clock, kernel calls at their roofline -- the headline
            step time and MFU -- and the costliest ops.
  estimate  a roofline step time: the largest of compute (those FLOPs over the chip's
            peak), HBM (the HLO's bytes, loop bodies times their trip counts, over the HBM
            bandwidth) and ICI (collective bytes over the chip's ICI bandwidth): a lower
            bound on the step time (every op at its peak, all of them overlapped), and the
            upper bound on MFU it implies for flops.py's count.
"""
from __future__ import annotations

import mtp_jax.train.aot.kernels as kernels_lib
from mtp_jax.model.args import ModelArgs
from mtp_jax.model.blocks import block_classes
from mtp_jax.model.layers import ROPE_MATMUL_CORES
from mtp_jax.train import flops as flops_lib
from mtp_jax.train.aot.devices import Topology

GIB = 2 ** 30
PROGRAMS = ('train', 'eval', 'decode')
# the attention core a compiled program ran, by the kernel calls it holds
_CORE_OF_KERNEL = {'splash_attention': 'splash', 'triton_attention': 'triton',
                   'cudnn_attention': 'cudnn'}


class DoesNotFit(Exception):
  """A program needs more HBM per chip than the chip has (exit code 1: a failed check)."""
  exit_code = 1


def attention_core_of(program: dict) -> str:
  """'splash', 'triton' or 'cudnn' when the program calls that attention kernel, else 'xla'
  (attention in plain HLO ops)."""
  for kind, core in _CORE_OF_KERNEL.items():
    if program.get('kernels', {}).get(kind, {}).get('calls'):
      return core
  return 'xla'


def add_figures(report: dict, config, topo: Topology) -> None:
  chip = topo.chip
  chips = report['chips']
  tokens = config.data.batch_size * config.data.seq_len
  per_token = flops_lib.config_flops_per_token(config)
  full = flops_lib.config_flops_per_token(config, causal=False)
  train = report.get('train')
  core = attention_core_of(train) if train else 'xla'
  expected = expected_compiled_flops(config, core)
  report['tokens_per_step'] = tokens
  report['flops_py'] = {'model_train_per_chip': per_token.train * tokens / chips,
                        'noncausal_train_per_chip': full.train * tokens / chips,
                        'expected_compiled_per_chip': expected['expected_train'] * tokens / chips,
                        'expected_attention_core': core,
                        'forward_per_token': per_token.forward, 'train_per_token': per_token.train}
  for name in PROGRAMS:
    prog = report.get(name)
    if not prog:
      continue
    mem = prog['memory']
    prog['fits'] = mem['total'] <= chip.hbm_bytes
    prog['hbm_fraction'] = mem['total'] / chip.hbm_bytes
    t_compute = prog['hlo_matmul_flops'] / chip.peak_flops
    hbm = prog.get('hbm_bytes') or prog['cost_analysis']['bytes_accessed']
    t_hbm = hbm / chip.hbm_bandwidth
    ici = sum(c['ici_bytes'] for c in prog['collectives'].values())
    t_ici = ici / chip.ici_bandwidth if chip.ici_bandwidth else None
    prog['estimate'] = {'bound': 'lower bound on the step time: max(compute, HBM, ICI)',
                        'compute_s': t_compute, 'hbm_s': t_hbm, 'hbm_bytes': hbm,
                        'ici_s': t_ici, 'ici_bytes': ici,
                        'step_s': max(t_compute, t_hbm, t_ici or 0.0)}
  if train:
    model = report['flops_py']['model_train_per_chip']
    train['flops_ratio_vs_flops_py'] = train['hlo_matmul_flops'] / model
    train['flops_ratio_vs_noncausal'] = (train['hlo_matmul_flops']
                                         / report['flops_py']['noncausal_train_per_chip'])
    train['flops_ratio_vs_expected'] = (train['hlo_matmul_flops']
                                        / report['flops_py']['expected_compiled_per_chip'])
    for est in (train['estimate'], train.get('priced')):
      step = est['step_s'] if est else None
      if est is not None:
        est['mfu'] = model / chip.peak_flops / step if step else None
        est['tokens_per_s'] = tokens / step if step else None


def _attention_parts(args, t: int) -> list:
  """[(non-causal forward attention FLOPs per token, D_qk, D_v, FLOPs per token of the
  forward RoPE half swap by matmul)] of the trunk layers and the MTP blocks."""
  parts = []
  for layer in list(range(args.n_layers)) + [args.n_layers] * args.mtp_depth:
    attn_cls, _ = block_classes(args, layer)
    d_qk, d_v = attn_cls.facts.head_widths(args)
    heads, width = attn_cls.facts.rotated(args) if attn_cls.facts.rotated else (0, 0)
    parts.append((flops_lib.layer_flops(args, layer, t, causal=False)[1], d_qk, d_v,
                  2.0 * heads * width * width))
  return parts


def expected_compiled_flops(config, attention_core: str = 'xla') -> dict:
  """Matmul FLOPs per token the compiled train step should hold, from flops.py's parts.

  flops.py counts the model's FLOPs (causal attention, no recomputation). The compiled
  step also does, by the attention core it calls:
    xla     the masked half of the T x T scores (dense attention computes them); under
            model.remat 'block' the scores and values again in the backward pass (the
            policy keeps only weight-matmul outputs);
    splash  the (query, key) block pairs its causal block mask keeps
            (model.attention_block_q / attention_block_kv), forward, dq (QKᵀ again, dP,
            dQ) and dkv (QKᵀ and dP again, dK, dV); under 'block' nothing again (the
            kernel's output and residuals are saved);
    triton  likewise with the library's blocks (128 forward, 32 backward); its one backward
            kernel recomputes QKᵀ and dP in both loops;
    cudnn   its forward and a backward that recomputes QKᵀ once;
  with splash the layers swap RoPE's halves by a matmul (layers.apply_rope): 2 R^2 per
  rotated query / key head and token, forward and input gradient;
  under 'full' the whole block forward again (a kernel's forward pass for its attention);
  with model.loss_chunk > 0 the vocab projection again (its chunks are rematerialised
  so no [B, T, V] logits are kept).
  """
  args = ModelArgs.from_config(config)
  t = config.data.seq_len
  full = flops_lib.flops_per_token(args, t, causal=False)
  parts = _attention_parts(args, t)
  dense = sum(part[0] for part in parts)  # forward, the full T x T
  remat = config.model.remat
  if attention_core == 'xla':
    attention_train, attention_again = 3.0 * dense, dense
  else:
    if attention_core == 'splash':
      block_q = min(int(config.model.get('attention_block_q', 512)), t)
      block_kv = min(int(config.model.get('attention_block_kv', 512)), t)
      passes = (('fwd', block_q, block_kv), ('dq', block_q, block_kv),
                ('dkv', block_q, block_kv))
    elif attention_core == 'triton':  # the library's blocks: 128 forward, 32 backward
      passes = (('fwd', 128, 128), ('triton_bwd', 32, 32))
    else:
      passes = (('fwd', 128, 128), ('cudnn_bwd', 128, 128))
    attention_train = attention_again = 0.0
    for a, d_qk, d_v, _ in parts:
      pairs = a / kernels_lib.attention_pass_flops('fwd', 1.0, d_qk, d_v)  # per token
      for name, bq, bkv in passes:
        frac = kernels_lib.causal_kept_fraction(t, t, min(bq, t), min(bkv, t))
        flops = kernels_lib.attention_pass_flops(name, pairs * frac, d_qk, d_v)
        attention_train += flops
        attention_again += flops if name == 'fwd' else 0.0
    if remat.startswith('block'):
      attention_again = 0.0
  # the layers of a TPU kernel swap RoPE's halves by a matmul (layers.ROPE_MATMUL_CORES):
  # forward and its input gradient, and the forward again under 'full'
  swap = sum(part[3] for part in parts) if attention_core in ROPE_MATMUL_CORES else 0.0
  train = full.train - 3.0 * dense + attention_train + 2.0 * swap
  again = (attention_again if remat.startswith('block') else
           full.forward - full.vocab - dense + attention_again + swap if remat == 'full'
           else 0.0)
  if config.model.loss_chunk:
    again += full.vocab
  return {'noncausal_train': full.train, 'recomputed_forward': again,
          'attention_train': attention_train, 'expected_train': train + again}


def check_fits(report: dict, topo: Topology) -> None:
  """DoesNotFit (one line) when a compiled program's per-chip total exceeds the HBM."""
  for name in PROGRAMS:
    prog = report.get(name)
    if prog and not prog['fits']:
      mem = prog['memory']
      largest = report.get('largest_params', [])[:3] if name != 'decode' else []
      tail = ('; largest parameters: ' + ', '.join(
          f'{p} {report["params"][p]["bytes_per_chip"] / GIB:.2f} GiB/chip' for p in largest)
              if largest else '')
      raise DoesNotFit(
          f'does not fit {topo.name}: {name} step needs {mem["total"] / GIB:.2f} GiB per chip '
          f'(arguments {mem["argument"] / GIB:.2f}, temporaries {mem["temp"] / GIB:.2f}), a '
          f'{topo.chip.name} chip has {topo.chip.hbm_bytes / GIB:.2f} GiB (short by '
          f'{(mem["total"] - topo.chip.hbm_bytes) / GIB:.2f} GiB){tail}')


