"""The 1B M = 1 MTP model of tpu_pod_1b on 128k-token sequences, on a TPU v5p-64 (32 chips).

  python scripts/aot_compile.py --config configs/tpu_long_128k.py --topology v5p-64
  scripts/launch_tpu_pod.sh my-v5p-64 us-east5-a -- \\
      --config configs/tpu_long_128k.py --workdir /mnt/shared/runs/tpu_long_128k

Eight sequences of 131072 tokens a step (the same 1M tokens as tpu_pod_1b). One whole
sequence does not fit a chip's activations, so each is split over a context axis of 4
chips (context parallelism, model/context.py: 32768 tokens a chip in the load-balanced
causal order, keys and values all-gathered over the axis for the splash kernel) and the
batch over fsdp 8: mesh (data 1, fsdp 8, context 4, tensor 1). Every MTP shift is taken
in the natural order, so the step computes what one device would. The layers are scanned
(one compiled block: the compile is the long part of the check). RoPE base 2000000 for the
longer positions.
"""
import os

from mtp_jax import config_files

# configs/tpu_pod_1b.py: the model and pod settings this config keeps
POD_1B = config_files.load_module(os.path.join(os.path.dirname(__file__), 'tpu_pod_1b.py'))

DEVICES = POD_1B.DEVICES  # v5p-64 = 32 chips (64 TensorCores)


def get_config():
  c = POD_1B.get_config()
  c.model.rope_theta = 2000000.0
  c.model.scan_layers = True
  c.data.seq_len = 131072
  c.data.batch_size = 8  # 1M tokens per step
  c.mesh.axes.data, c.mesh.axes.fsdp, c.mesh.axes.context = 1, 8, 4
  return c
