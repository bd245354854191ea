"""Ahead-of-time compiles of the real train step, eval step and decode loop for a TPU slice
(or a GPU host).

With libtpu installed, `jax.experimental.topologies` describes a TPU slice on a machine
that has none: its devices are compile-only, but a program compiled for them is the
program the slice would run, with the slice's memory limits. `compile_report` lowers and
compiles `steps.train_step`, `steps.eval_step` and the decoder's while loop with the
config's mesh and sharding rules and reads, per chip:

  memory    parameter, optimizer and batch bytes (from the shardings), the compiled
            program's argument / output / temporary bytes, their total against the chip's
            HBM; a program that does not fit fails with the shortfall and the largest
            allocations (the TPU compiler's own list).
  FLOPs     matmul FLOPs counted in the compiled HLO and its kernel calls (splash / Triton /
            cuDNN attention, the grouped-matmul kernel: from their shapes), every loop body
            times its trip count, beside flops.py's model count.
  HBM       bytes read and written by the compiled ops, loop bodies times their trip
            counts (XLA's cost_analysis counts a while body once and sees no kernel's
            insides; its figure is kept beside).
  traffic   all-gather / reduce-scatter / all-reduce / (ragged) all-to-all / collective-permute
            of the compiled HLO with their executions per step and bytes.
  priced    the headline step time and MFU: the TPU compiler's own per-op cycle estimates
            summed over the executed ops (loop bodies times their trip counts) at the chip's
            clock, kernel calls at their roofline; the costliest ops (pricing.py). On a GPU,
            whose compiled module prints no per-op estimate, each op at its roofline.
  estimate  a roofline step time (the largest of compute, HBM and ICI time): a lower bound
            on the step time, and the MFU it implies for flops.py's count.

The modules: devices (accelerator types and their compile-only devices), hlo_read (an HLO
module's text: instructions, array bytes, matmul FLOPs), hlo (the compiled module's
figures), kernels (kernel calls from their shapes), pricing (the op-by-op step
time), programs (compiling the steps), figures (FLOPs against flops.py, fit, roofline),
report (the text). Public names load lazily (mtp_jax/exports.py), as in every sub-package.
"""
from mtp_jax.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    'COLLECTIVES': 'hlo',
    'DoesNotFit': 'figures',
    'ExecutedOp': 'hlo',
    'GIB': 'figures',
    'HloStats': 'hlo',
    'KernelCall': 'kernels',
    'PROGRAMS': 'figures',
    'Topology': 'devices',
    'analyze_hlo': 'hlo',
    'attention_core_of': 'figures',
    'causal_kept_fraction': 'kernels',
    'check_fits': 'figures',
    'compile_report': 'programs',
    'expected_compiled_flops': 'figures',
    'format_report': 'report',
    'hlo_text': 'programs',
    'kernel_call': 'kernels',
    'parse_topology': 'devices',
    'price_step': 'pricing',
    'read_computations': 'hlo',
    'shard_bytes': 'programs',
    'spec_text': 'programs',
    'topology_devices': 'devices',
    'traced_for': 'devices',
})
