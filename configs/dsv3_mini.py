"""DeepSeek-V3's layout in miniature: MLA everywhere, dense first layer, DeepSeekMoE after,
M = 1 sequential MTP whose block is MLA + MoE (as DeepSeek-V3's layer 61).

Byte-level on the embedded stdlib corpus; sized to run on 2 CPU cores: d 128, 3 layers,
1.5 M parameters (0.43 M in the MTP module), 300 steps of 8 x 128 tokens. Ratios follow
DeepSeek-V3 loosely (1 shared + 8 routed experts, top-2, expert width = mlp_dim / 4,
q_lora_rank ~ 3 x kv_lora_rank, qk_rope_head_dim = qk_nope_head_dim / 2). docs/deepseek-v3.md
explains the fields.

  python scripts/train.py --config configs/dsv3_mini.py
"""
from mtp_jax import config_lib


def get_config():
  c = config_lib.base_config()
  c.model.d_model = 128
  c.model.n_layers = 3
  c.model.n_heads = 4
  c.model.mlp_dim = 384  # the dense first layer
  c.model.attention = 'mla'
  c.model.mla.q_lora_rank = 96
  c.model.mla.kv_lora_rank = 32
  c.model.mla.qk_nope_head_dim = 32
  c.model.mla.qk_rope_head_dim = 16
  c.model.mla.v_head_dim = 32
  c.model.mlp = 'moe'
  c.model.moe.first_k_dense = 1
  c.model.moe.n_routed_experts = 8
  c.model.moe.n_shared_experts = 1
  c.model.moe.num_experts_per_tok = 2
  c.model.moe.moe_intermediate_size = 96
  c.model.moe.routed_scaling_factor = 1.0
  c.model.moe.bias_update_rate = 1e-3
  c.model.moe.balance_loss_weight = 1e-4
  c.model.mtp.depth = 1  # its block: MLA (model.attention) + MoE (layer index n_layers)
  c.data.tokenizer = 'byte'
  c.data.seq_len = 128
  c.data.batch_size = 8
  c.train.steps = 300
  c.train.lr = 3e-3
  c.train.warmup_steps = 30
  c.train.log_every = 10
  c.train.eval_every = 100
  c.train.eval_batches = 4
  c.train.checkpoint_every = 100
  return c
