"""A DeepSeek-V3-style MoE with M = 1 MTP on a TPU v5p-64 slice (32 chips): MLA attention,
a dense first layer, then DeepSeekMoE layers of 2 shared + 64 routed experts (top 6).

  python scripts/aot_compile.py --config configs/tpu_moe.py --topology v5p-64

DeepSeek-V2-Lite's widths (d 2048, 16 heads, kv latent 512, expert SwiGLU 1408) with
DeepSeek-V3's query compression and MTP layer (MLA + MoE). 7.3B parameters, 1.4B active
per token. Mesh (data 8, fsdp 4, tensor 1) with the expert rule on 'data': each chip
stores 8 of the 64 routed experts of every layer (a quarter of each one's rows) and
multiplies only the tokens routed to those 8, each (token, expert) row sent to it once by a
ragged all-to-all (model/moe.py, expert parallelism); its compiled train step and memory
per chip, beside the all-gather exchange's, are in docs/scaling.md.
"""
import os

from mtp_jax import config_files

# configs/_tpu_pod.py: what every pod config shares
POD = config_files.load_module(os.path.join(os.path.dirname(__file__), '_tpu_pod.py'))

DEVICES = 32  # v5p-64 = 32 chips


def get_config():
  c = POD.pod_config()
  m = c.model
  m.d_model = 2048
  m.n_layers = 12
  m.n_heads = 16
  m.mlp_dim = 10944  # the dense first layer
  m.attention = 'mla'
  m.mla.q_lora_rank = 1536
  m.mla.kv_lora_rank = 512
  m.mla.qk_nope_head_dim = 128
  m.mla.qk_rope_head_dim = 64
  m.mla.v_head_dim = 128
  m.mlp = 'moe'
  m.moe.first_k_dense = 1
  m.moe.n_routed_experts = 64
  m.moe.n_shared_experts = 2
  m.moe.num_experts_per_tok = 6
  m.moe.moe_intermediate_size = 1408
  m.moe.routed_scaling_factor = 1.0
  m.moe.exchange = 'all_to_all'  # each row sent once to its expert's chip (ragged all-to-all)
  # receive buffers of 1.25x the mean rows per chip: dropless would size them (and the
  # grouped products remat='block' keeps) for all 8 chips' rows; rows past them are dropped
  # and logged (train/moe_dropped_rows_l{j}), each chip's buffer cutting a different
  # sender's rows (model/moe_exchange.py)
  m.moe.capacity_factor = 1.25
  # the one MTP depth (_tpu_pod.py) has this block, MLA + MoE, as DeepSeek-V3's layer 61
  # the 12 layers unrolled (as tpu_pod_1b): the compiler's price 692 ms against 768
  # scanned, 33.8 GiB per chip against 42.1 (docs/scaling.md); the same parameter tree
  m.scan_layers = False
  d = c.data
  d.batch_size = 128  # 512k tokens per step; 4 sequences per chip
  c.mesh.axes.data, c.mesh.axes.fsdp = 8, 4
  return c
