"""The main job: a byte-level decoder with M = 3 sequential MTP modules, trained on the
running interpreter's Python standard library (built on first use, no download).

d 256, 4 layers, 2 x 128-wide heads; 6.4 M parameters (3.5 M trunk, 3.0 M in the three MTP
modules); 300 steps of 16 x 256 tokens. About 10 minutes on 2 CPU cores; README.md lists
the figures it reaches.

  python scripts/train.py --config configs/stdlib_mtp.py
"""
from mtp_jax import config_lib


def get_config():
  c = config_lib.base_config()
  c.model.d_model = 256
  c.model.n_layers = 4
  c.model.n_heads = 2  # 2 x 128-wide heads: XLA:CPU runs wide heads ~2x faster than 4 x 64
  c.model.n_kv_heads = 2
  c.model.head_dim = 128
  c.model.mlp_dim = 768
  c.model.mtp.depth = 3
  c.model.mtp.lambda_values = (0.3, 0.1)  # DeepSeek-V3's schedule, scaled to this run
  c.model.mtp.lambda_boundaries = (200,)
  c.data.tokenizer = 'byte'
  c.data.seq_len = 256
  c.data.batch_size = 16
  c.train.steps = 300
  c.train.lr = 3e-3
  c.train.warmup_steps = 30
  c.train.log_every = 10
  c.train.eval_every = 100
  c.train.eval_batches = 8
  c.train.eval_decode_prompts = 8  # tau + acceptance per eval: ~1.5 s (+ ~20 s compile once), 2 cores
  c.train.eval_decode_tokens = 64
  c.train.checkpoint_every = 100
  return c
