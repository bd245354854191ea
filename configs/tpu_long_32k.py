"""The 1B M = 1 MTP model of tpu_pod_1b on 32k-token sequences, on a TPU v5p-64 (32 chips).

  python scripts/aot_compile.py --config configs/tpu_long_32k.py --topology v5p-64
  scripts/launch_tpu_pod.sh my-v5p-64 us-east5-a -- \\
      --config configs/tpu_long_32k.py --workdir /mnt/shared/runs/tpu_long_32k

One sequence of 32768 tokens per chip (the same 1M tokens per step as tpu_pod_1b), mesh
(data 2, fsdp 16, tensor 1). The attention core is the TPU default, the Pallas splash
kernel, which keeps no T x T scores: the train step compiles to 31.9 GiB per chip. The
dense XLA path (`--config.model.attention_core=xla`) needs 121 GiB of temporaries and does
not fit a v5p chip (docs/scaling.md has both compiles). RoPE base 500000 for the longer
positions.
"""
import os

from mtp_jax import config_files

# configs/_tpu_pod.py: what every pod config shares
POD = config_files.load_module(os.path.join(os.path.dirname(__file__), '_tpu_pod.py'))

DEVICES = 32  # v5p-64 = 32 chips (64 TensorCores); mesh.shape below needs this many


def get_config():
  c = POD.pod_config()
  m = c.model
  m.d_model = 2048
  m.n_layers = 18
  m.n_heads = 16
  m.n_kv_heads = 8  # GQA
  m.head_dim = 128
  m.mlp_dim = 5632
  m.rope_theta = 500000.0
  d = c.data
  d.seq_len = 32768
  d.batch_size = 32  # 1M tokens per step; one sequence per chip
  c.mesh.shape = (2, 16, 1)
  return c
