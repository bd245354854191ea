"""A decode model for the weight-bound regime of this 2-core CPU: d 768, L 12, D = 3, byte level.

Issue 15: at d 256 / L 4 (stdlib_mtp) an AR step is ~170 tiny ops and a D = 3 iteration
costs 10x a step, so drafting cannot pay; at d 768 / L 12 an AR step reads ~340 MB of
f32 weights and the iteration costs 1.7-1.9 AR steps as built (~1.35 with bf16 weights
and x.W_t dots), so tau ~3 can turn into a real speedup. 6 x 128-wide heads (XLA:CPU
runs wide heads faster), SwiGLU 2048, tied byte embedding (V 256); 85 M trunk parameters, 25 M in the 3 MTP modules.

Trained in bounded time in two stages (the README's research recipe): a short trunk run
(D = 0), then D = 3 MTP modules on the frozen trunk with self-distillation targets (each
depth learns the trunk's own greedy token, the one the verifier accepts), from
--init_from. T 128 x batch 8 = 1,024 tokens a step: at ~5 s a step on 2 quiet cores
(17 s at load 7) the token budget is what 2 shared cores allow in ~35 minutes, so the
trunk is undertrained; it is a decode-speed testbed, not a language model.

  python scripts/train.py --config configs/decode_768.py --workdir /work/runs/decode768_trunk \
      --config.model.mtp.depth=0
  python scripts/train.py --config configs/decode_768.py --workdir /work/runs/decode768_mtp \
      --init_from /work/runs/decode768_trunk --config.model.mtp.freeze_trunk=True \
      --config.loss.mtp_targets=self --config.train.steps=MTP_STEPS --config.train.warmup_steps=5
  python scripts/eval.py --workdir /work/runs/decode768_mtp --num_prompts 8 --json
  python benchmarks/decode_speed.py --workdir /work/runs/decode768_mtp --temperatures 0,1

RESULTS_PLACEHOLDER
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
