"""A ~1B-parameter D = 1 MTP model on a TPU v5p-64 pod slice (32 chips, 8 hosts).

  scripts/launch_tpu_pod.sh my-v5p-64 us-east5-a -- \\
      --config configs/tpu_pod_1b.py --workdir /mnt/shared/runs/tpu_pod_1b

The workdir (checkpoints) must be one directory every host sees: a GCS bucket mounted
with gcsfuse, or Filestore / NFS, at the same path on all workers.

Mesh (data 2, fsdp 16, tensor 1): parameters and optimizer state sharded ZeRO-3 style
over 16 chips, two data-parallel replicas. Checked before renting the slice:

  python scripts/aot_compile.py --config configs/tpu_pod_1b.py --topology v5p-64

compiles the train step (all 18 layers, scanned, remat block, splash attention) to
33.6 GiB per chip of a v5p's 95 (docs/scaling.md has the figures).
"""
from mtp_jax import config_lib

DEVICES = 32  # v5p-64 = 32 chips (64 TensorCores); mesh.shape below needs this many


def get_config():
  c = config_lib.base_config()
  m = c.model
  m.vocab_size = 32768
  m.d_model = 2048
  m.n_layers = 18
  m.n_heads = 16
  m.n_kv_heads = 8  # GQA
  m.head_dim = 128
  m.mlp_dim = 5632
  m.tie_embeddings = False
  m.dtype = 'bfloat16'
  m.remat = 'block'
  m.scan_layers = True
  m.loss_chunk = 1024
  m.mtp.depth = 1
  m.mtp.lambda_values = (0.3, 0.1)
  m.mtp.lambda_boundaries = (40000,)
  d = c.data
  d.tokenizer = 'sentencepiece'
  d.spm_model = '/mnt/shared/tokenizer/spm32k.model'  # the same path on every host
  d.seq_len = 4096
  d.batch_size = 256  # 1M tokens per step; 8 per chip
  d.worker_count = 8
  t = c.train
  t.steps = 50000
  t.lr = 3e-4
  t.warmup_steps = 2000
  t.log_every = 100
  t.eval_every = 2000
  t.eval_batches = 8
  t.checkpoint_every = 1000
  c.mesh.shape = (2, 16, 1)
  return c
