"""A ~350M-parameter M = 1 MTP model for one 80 GB GPU (H100 / H200), bf16 compute.

  python scripts/train_tokenizer.py --vocab_size 32000 --output runs/tokenizer/spm32k.model
  python scripts/train.py --config configs/gpu_350m.py --workdir runs/gpu_350m

CI only parses, validates and builds it abstractly (tests/test_scale.py). Data: any
TFDS ArrayRecord text data set via data.dataset / data.data_dir (python_stdlib by default).
"""
from mtp_jax import config_lib

DEVICES = 1  # the mesh below is one GPU


def get_config():
  c = config_lib.base_config()
  m = c.model
  m.vocab_size = 32768  # the 32k SentencePiece model, rounded to a multiple of 128
  m.d_model = 1024
  m.n_layers = 24
  m.n_heads = 16
  m.n_kv_heads = 16
  m.head_dim = 64
  m.mlp_dim = 2816  # ~ 8/3 d, a multiple of 128
  m.tie_embeddings = True  # 357M params; untied adds 33.5M
  m.dtype = 'bfloat16'  # params and optimizer state stay float32
  m.remat = 'block'  # recompute attention and elementwise ops, keep the matmul outputs
  m.scan_layers = True  # one block in the HLO: compiles in seconds, not minutes
  m.loss_chunk = 512  # [B, 512, V] logits at a time
  m.mtp.depth = 1  # DeepSeek-V3's setting
  m.mtp.lambda_values = (0.3, 0.1)
  m.mtp.lambda_boundaries = (15000,)
  d = c.data
  d.tokenizer = 'sentencepiece'
  d.spm_model = 'runs/tokenizer/spm32k.model'
  d.seq_len = 2048
  d.batch_size = 64  # 131k tokens per step
  d.worker_count = 4
  t = c.train
  t.steps = 20000
  t.lr = 6e-4
  t.warmup_steps = 1000
  # two microbatches of 32: the whole batch at once needs 94.2 GiB per GPU under remat block
  # (deviceless h100-1 compile, --config.train.grad_accum=1), past an H100's 74.5
  t.grad_accum = 2
  t.log_every = 50
  t.eval_every = 1000
  t.eval_batches = 16
  t.checkpoint_every = 1000
  c.mesh.axes.data = 1
  return c
