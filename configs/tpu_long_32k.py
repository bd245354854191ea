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

# configs/tpu_pod_1b.py: the model, mesh and pod settings this config keeps
POD_1B = config_files.load_module(os.path.join(os.path.dirname(__file__), 'tpu_pod_1b.py'))

DEVICES = POD_1B.DEVICES  # v5p-64 = 32 chips (64 TensorCores)


def get_config():
  c = POD_1B.get_config()
  c.model.rope_theta = 500000.0
  c.data.seq_len = 32768
  c.data.batch_size = 32  # 1M tokens per step; one sequence per chip
  return c
