"""A ~1B-parameter M = 1 MTP model on a TPU v5p-64 pod slice (32 chips, 8 hosts).

  scripts/launch_tpu_pod.sh my-v5p-64 us-east5-a -- \\
      --config configs/tpu_pod_1b.py --workdir /mnt/shared/runs/tpu_pod_1b

The workdir (checkpoints) must be one directory every host sees: a GCS bucket mounted
with gcsfuse, or Filestore / NFS, at the same path on all workers.

Mesh (data 2, fsdp 16, tensor 1): parameters and optimizer state sharded ZeRO-3 style
over 16 chips, two data-parallel replicas. Checked before renting the slice:

  python scripts/aot_compile.py --config configs/tpu_pod_1b.py --topology v5p-64

compiles the train step (all 18 layers unrolled, remat block_mlp, splash attention) to
42.4 GiB per chip of a v5p's 95 (docs/scaling.md has the figures).
"""
import os

from mtp_jax import config_files

# configs/_tpu_pod.py: what every pod config shares
POD = config_files.load_module(os.path.join(os.path.dirname(__file__), '_tpu_pod.py'))

DEVICES = 32  # v5p-64 = 32 chips (64 TensorCores); mesh.axes below need this many


def get_config():
  c = POD.pod_config()
  m = c.model
  m.d_model = 2048
  m.n_layers = 18
  m.n_heads = 16
  m.n_kv_heads = 8  # GQA
  m.head_dim = 128
  m.mlp_dim = 5632
  # block's matmul outputs and the SwiGLU product (block: 34.1 GiB and dearer;
  # docs/scaling.md, the remat table)
  m.remat = 'block_mlp'
  # the 18 layers unrolled: each layer's saved activations are buffers of their own, not
  # slices of [L, ...] stacks written and read back by in-place updates in the scan's
  # loops. The compiler's price 788 ms against 832 scanned, 42.4 GiB per chip against
  # 41.0; the compile takes about 1.5x as long. The parameter tree is the same.
  m.scan_layers = False
  d = c.data
  d.batch_size = 256  # 1M tokens per step; 8 per chip
  c.mesh.axes.data, c.mesh.axes.fsdp = 2, 16
  return c
