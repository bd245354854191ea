"""A ~7B-parameter dense D = 1 MTP model on a TPU v5p-256 slice (128 chips, 32 hosts).

  python scripts/aot_compile.py --config configs/tpu_7b.py --topology v5p-256
  scripts/launch_tpu_pod.sh my-v5p-256 us-east5-a -- \\
      --config configs/tpu_7b.py --workdir /mnt/shared/runs/tpu_7b

Mistral-7B's shape (d 4096, 32 layers, 32 query / 8 KV heads of 128, SwiGLU 14336),
untied 32k vocabulary. Mesh (data 1, fsdp 128, tensor 1): parameters, gradients and Adam
moments sharded ZeRO-3 style over every chip; docs/scaling.md has the compiled memory,
collectives and step-time estimate.
"""
from mtp_jax import config_lib

DEVICES = 128  # v5p-256 = 128 chips (256 TensorCores)


def get_config():
  c = config_lib.base_config()
  m = c.model
  m.vocab_size = 32768
  m.d_model = 4096
  m.n_layers = 32
  m.n_heads = 32
  m.n_kv_heads = 8
  m.head_dim = 128
  m.mlp_dim = 14336
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
  d.batch_size = 512  # 2M tokens per step; 4 sequences per chip
  d.worker_count = 8
  t = c.train
  t.steps = 50000
  t.lr = 2e-4
  t.warmup_steps = 2000
  t.log_every = 100
  t.eval_every = 2000
  t.eval_batches = 8
  t.checkpoint_every = 1000
  c.mesh.shape = (1, 128, 1)
  return c
