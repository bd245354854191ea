"""A decode model for the weight-bound regime of this 2-core CPU: d 768, L 12, D = 3, byte level.

Issue 15: at d 256 / L 4 (stdlib_mtp) an AR step is ~170 tiny ops and a D = 3 iteration
costs 10x a step, so drafting cannot pay; at d 768 / L 12 an AR step reads ~340 MB of
f32 weights and the iteration costs 1.7-1.9 AR steps as built (~1.35 with bf16 weights
and x.W_t dots), so tau ~3 can turn into a real speedup. 6 x 128-wide heads (XLA:CPU
runs wide heads faster), SwiGLU 2048, tied byte embedding (V 256); 85 M trunk
parameters, 25 M in the 3 MTP modules.

Trained in bounded time in two stages (the README's research recipe): a short trunk run
(D = 0), then D = 3 MTP modules on the frozen trunk with self-distillation targets (each
depth learns the trunk's own greedy token, the one the verifier accepts), from
--init_from. T 128 x batch 8 = 1,024 tokens a step.

  python scripts/train.py --config configs/decode_768.py --workdir runs/decode768_trunk \
      --config.model.mtp.depth=0
  python scripts/train.py --config configs/decode_768.py --workdir runs/decode768_mtp \
      --init_from runs/decode768_trunk --config.model.mtp.freeze_trunk=True \
      --config.loss.mtp_targets=self --config.train.steps=50 --config.train.warmup_steps=5
  python benchmarks/decode_speed.py --workdir runs/decode768_mtp --batch_sizes 1 \
      --temperatures 0,1 --num_prompts 4 --prompt_len 64 --max_new_tokens 64

NOT YET A USABLE DECODE MODEL (December 2026, benchmarks/RESULTS.md "Decode groundwork").
A trunk step costs ~4-6 s on 2 cores at load 2.5 and 17-28 s at load 7 (3 other agents),
so the ~35 minutes allowed bought 53 trunk steps (stopped by SIGTERM; steps 1-27 under a
150-step schedule, 28-53 under this file's 100) and the 50 MTP steps: the trunk is still
on the unigram plateau (eval loss 3.15 nats, 4.55 bits per byte) and its greedy output is
one repeated byte, so greedy tau is 3.94 (every draft accepted: meaningless) and tau at
T = 1 is 1.59. The iteration cost does not depend on the weights, so the model serves
cost measurements and the losslessness checks as it is; a speedup claim needs the
trunk trained past the plateau: likely several hundred steps (the README's d 128 recipe
reached 2.39 nats after 400 steps of 2k tokens), i.e. ~40+ min of 2 quiet cores.
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
