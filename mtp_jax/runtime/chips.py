"""Accelerator chips by their published figures: the one table the ahead-of-time check reads.

Each figure is the vendor's data-sheet number for one chip (Cloud TPU's system-architecture
pages; NVIDIA's H100 / H200 data sheets, SXM parts, dense bf16 without sparsity). A figure
that is not published is None, and the estimates that need it say so instead of guessing.
TPU HBM is taken in GiB: the TPU compiler's own limits read 95.74 GiB on a v5p and
15.75 GiB on a v5e (what it leaves to a program), so the published "95 GB" and "16 GB"
are binary gigabytes; whether a program fits is the compiler's verdict either way.

`cores` is the TensorCores of one chip; v4 and v5p run both as one device (megacore), so a
v5p-64 (64 cores) is 32 JAX devices.

`clock_ghz` is the TensorCore clock that turns the TPU compiler's cycle estimates into
seconds. Google publishes it for no current chip; it is the peak over the matrix units'
FLOPs per cycle: 4 MXUs per TensorCore, 128 x 128 multiply-adds each (v6e: 256 x 256), so
v4 275 TFLOP/s / (2 cores x 4 MXUs x 2 x 128^2 FLOPs) = 1.05 GHz, v5e 1.5 GHz, v5p 1.75
GHz, v6e 1.75 GHz (rounded). It is an assumption the report states beside every figure it
prices with it.
"""
from __future__ import annotations

import dataclasses

GB = 1e9
GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str  # accelerator-type prefix (v5p) or the GPU's name (h100)
  device_kind: str  # what jax's device.device_kind reads on it
  bf16_tflops: float  # peak dense bf16, TFLOP/s
  hbm_bytes: float  # HBM capacity in bytes (published in GB or GiB, converted)
  hbm_published: str  # the capacity as published
  hbm_gbps: float  # HBM bandwidth, GB/s
  ici_gbps: float | None  # chip-to-chip bandwidth, GB/s, bidirectional per chip (TPU ICI,
  # NVLink); None: not published per chip
  cores: int  # TensorCores per chip (TPU) / 1 (GPU)
  platform: str = 'tpu'
  clock_ghz: float | None = None  # TensorCore clock (derived, see above); None on a GPU

  @property
  def clock_hz(self) -> float | None:
    return None if self.clock_ghz is None else self.clock_ghz * 1e9

  @property
  def peak_flops(self) -> float:
    return self.bf16_tflops * 1e12

  @property
  def hbm_bandwidth(self) -> float:
    return self.hbm_gbps * GB

  @property
  def ici_bandwidth(self) -> float | None:
    return None if self.ici_gbps is None else self.ici_gbps * GB


CHIPS = {
    # Cloud TPU v4: 275 TFLOP/s (bf16), HBM2 32 GiB at 1200 GB/s; no per-chip ICI figure.
    'v4': Chip('v4', 'TPU v4', 275.0, 32 * GIB, '32 GiB', 1200.0, None, 2,
               clock_ghz=1.05),
    # v5e: 197 TFLOP/s, HBM2 16 GB at 819 GB/s, ICI 400 GB/s bidirectional per chip.
    'v5e': Chip('v5e', 'TPU v5 lite', 197.0, 16 * GIB, '16 GB', 819.0, 400.0, 1,
                clock_ghz=1.5),
    # v5p: 459 TFLOP/s, HBM2e 95 GB at 2765 GB/s, ICI 1200 GB/s bidirectional per chip.
    'v5p': Chip('v5p', 'TPU v5', 459.0, 95 * GIB, '95 GB', 2765.0, 1200.0, 2,
                clock_ghz=1.75),
    # v6e (Trillium): 918 TFLOP/s, HBM 32 GB at 1638 GB/s, ICI 800 GB/s bidirectional.
    'v6e': Chip('v6e', 'TPU v6 lite', 918.0, 32 * GIB, '32 GB', 1638.0, 800.0, 1,
                clock_ghz=1.75),
    # H100 SXM: 989 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s.
    'h100': Chip('h100', 'NVIDIA H100 80GB HBM3', 989.0, 80 * GB, '80 GB', 3350.0, 900.0, 1,
                 'gpu'),
    # H200 SXM: 989 TFLOP/s dense bf16, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    'h200': Chip('h200', 'NVIDIA H200', 989.0, 141 * GB, '141 GB', 4800.0, 900.0, 1, 'gpu'),
}
ALIASES = {'v5litepod': 'v5e'}

# What XLA's GPU compiler needs to know of a device it cannot see (its GpuTargetConfig):
# NVIDIA's published figures for the SXM parts (Hopper, compute capability 9.0: 132 SMs at
# up to 1.98 GHz, 50 MB L2, 228 KB shared memory per SM of which 227 KB per block opt-in,
# 2048 threads and 64 K registers per SM).
GPU_TARGETS = {
    name: {'core_count': 132, 'clock_rate_ghz': 1.98, 'l2_cache_size': 50 * 2 ** 20,
           'shared_memory_per_core': 228 * 1024, 'shared_memory_per_block_optin': 227 * 1024,
           'shared_memory_per_block': 48 * 1024, 'threads_per_core_limit': 2048,
           'threads_per_block_limit': 1024, 'threads_per_warp': 32,
           'registers_per_core_limit': 65536, 'registers_per_block_limit': 65536,
           'fpus_per_core': 128, 'compute_capability': (9, 0)}
    for name in ('h100', 'h200')}


def gpu_target_config(c: Chip) -> str:
  """The chip as XLA's GpuTargetConfigProto text (deviceless GPU compiles)."""
  g = GPU_TARGETS[c.name]
  major, minor = g['compute_capability']
  fields = [f'  {k}: {g[k]}' for k in (
      'threads_per_block_limit', 'threads_per_warp', 'shared_memory_per_block',
      'shared_memory_per_core', 'threads_per_core_limit', 'core_count', 'fpus_per_core',
      'l2_cache_size', 'clock_rate_ghz', 'shared_memory_per_block_optin',
      'registers_per_core_limit', 'registers_per_block_limit')]
  fields += ['  block_dim_limit_x: 2147483647', '  block_dim_limit_y: 65535',
             '  block_dim_limit_z: 65535', f'  memory_bandwidth: {int(c.hbm_bandwidth)}',
             f'  device_memory_size: {int(c.hbm_bytes)}',
             f'  cuda_compute_capability {{ major: {major} minor: {minor} }}']
  return ('gpu_device_info {\n' + '\n'.join(fields) + '\n}\nplatform_name: "CUDA"\n'
          f'device_description_str: "{c.device_kind}"\n')


def chip(name: str) -> Chip:
  """The table's chip for an accelerator-type prefix (v5p, v5litepod, h100, ...)."""
  name = ALIASES.get(name.lower(), name.lower())
  if name not in CHIPS:
    raise KeyError(name)
  return CHIPS[name]
