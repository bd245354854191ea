"""What the TPU pod configs share: a 32k SentencePiece vocabulary read from one path every
host sees, bf16 scanned layers with block remat, an MTP depth of 1, and a 50k-step schedule.

Not a config itself (no get_config): configs/tpu_*.py start from `pod_config()` and set
only what differs.
"""
from mtp_jax import config_lib

SPM_MODEL = '/mnt/shared/tokenizer/spm32k.model'  # the same path on every host


def pod_config():
  c = config_lib.base_config()
  m = c.model
  m.vocab_size = 32768
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
  d.spm_model = SPM_MODEL
  d.seq_len = 4096
  d.worker_count = 8
  t = c.train
  t.steps = 50000
  t.lr = 3e-4
  t.warmup_steps = 2000
  t.log_every = 100
  t.eval_every = 2000
  t.eval_batches = 8
  t.checkpoint_every = 1000
  return c
