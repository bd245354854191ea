"""The decode model: d 768, L 12, M = 3, byte level, sized for the weight-bound regime of a CPU.

At the main job's size (d 256, L 4) a decode step is a few hundred tiny ops and a M = 3
iteration costs about ten plain steps, so drafting cannot pay there; at d 768 / L 12 a step
reads ~340 MB of float32 weights and an iteration costs ~2 plain steps, so an accepted
length of 3+ turns into a real speed-up (docs/decoding.md). 6 x 128-wide heads (XLA:CPU
runs wide heads faster than many narrow ones), SwiGLU 2048, tied byte embedding;
110 M parameters: 85 M trunk, 25 M in the 3 MTP modules.

The measured model is trained in six stages, a trunk and then the MTP modules on the frozen
trunk, each from the one before (about 2 hours on 2 CPU cores):

  scripts/train_decode_model.sh

The defaults below (100 steps of 8 x 128 tokens) are one short run of the full model.
"""
from mtp_jax import config_lib


def get_config():
  c = config_lib.base_config()
  c.model.d_model = 768
  c.model.n_layers = 12
  c.model.n_heads = 6  # 6 x 128-wide heads: XLA:CPU runs wide heads faster than many narrow ones
  c.model.n_kv_heads = 6
  c.model.head_dim = 128
  c.model.mlp_dim = 2048
  c.model.mtp.depth = 3
  c.data.tokenizer = 'byte'
  c.data.seq_len = 128
  c.data.batch_size = 8
  c.train.steps = 100
  c.train.lr = 2e-3
  c.train.warmup_steps = 15
  c.train.log_every = 10
  c.train.eval_every = 0
  c.train.eval_batches = 4
  c.train.checkpoint_every = 50
  c.train.progress = False
  return c
