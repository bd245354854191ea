"""A tiny M = 2 model for tests and smoke runs: trains in seconds on 2 CPU cores.

d 64, 2 layers, 4 query / 2 key-value heads (GQA); 0.23 M parameters; 60 steps of 8 x 64
tokens of the stdlib corpus.

  python scripts/train.py --config configs/tiny.py
"""
from mtp_jax import config_lib


def get_config():
  c = config_lib.base_config()
  c.model.d_model = 64  # small enough to compile in ~1 s
  c.model.n_layers = 2
  c.model.n_heads = 4
  c.model.n_kv_heads = 2  # exercise GQA
  c.model.head_dim = 16
  c.model.mlp_dim = 192
  c.model.mtp.depth = 2
  c.data.seq_len = 64
  c.data.batch_size = 8
  c.train.steps = 60
  c.train.lr = 3e-3
  c.train.warmup_steps = 10
  c.train.log_every = 10
  c.train.eval_every = 30
  c.train.eval_batches = 2
  c.train.checkpoint_every = 30
  return c
