"""A ~7B-parameter dense M = 1 MTP model on a TPU v5p-256 slice (128 chips, 32 hosts).

  python scripts/aot_compile.py --config configs/tpu_7b.py --topology v5p-256
  scripts/launch_tpu_pod.sh my-v5p-256 us-east5-a -- \\
      --config configs/tpu_7b.py --workdir /mnt/shared/runs/tpu_7b

Mistral-7B's shape (d 4096, 32 layers, 32 query / 8 KV heads of 128, SwiGLU 14336),
untied 32k vocabulary. Mesh (data 1, fsdp 128, tensor 1): parameters, gradients and Adam
moments sharded ZeRO-3 style over every chip; docs/scaling.md has the compiled memory,
collectives and step-time estimate.
"""
import os

from mtp_jax import config_files

# configs/_tpu_pod.py: what every pod config shares
POD = config_files.load_module(os.path.join(os.path.dirname(__file__), '_tpu_pod.py'))

DEVICES = 128  # v5p-256 = 128 chips (256 TensorCores)


def get_config():
  c = POD.pod_config()
  m = c.model
  m.d_model = 4096
  m.n_layers = 32
  m.n_heads = 32
  m.n_kv_heads = 8
  m.head_dim = 128
  m.mlp_dim = 14336
  d = c.data
  d.batch_size = 512  # 2M tokens per step; 4 sequences per chip
  t = c.train
  t.lr = 2e-4
  c.mesh.axes.data, c.mesh.axes.fsdp = 1, 128
  return c
