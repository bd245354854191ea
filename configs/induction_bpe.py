"""Induction as Gloeckle et al. 2024 (section 4.1) ran it: `configs/induction_bpe.py:<variant>,<size>[,smoke]`.

The task is mtp_jax/data/induction.py's BPENameStoryTask: the model trains on template
children's stories whose characters have ordinary names, tokenized by a SentencePiece BPE
of VOCAB pieces trained on such stories, and is tested on stories whose names are random
names of exactly two of that tokenizer's tokens; the score is the main head's top-1
accuracy on the second token of a name at its second mention. Variants on one trunk per
size, 16 x 128 tokens a step, warmup then a constant learning rate:
- `d0`: next-token prediction only;
- `n2`: n = 2 as in the paper (one parallel head on h^0 predicting t_(i+2), the heads'
  losses summed);
- `d1`: sequential M = 1 (a DeepSeek-V3 MTP module).
Sizes (non-embedding parameters, from the paper's 1 M up): SIZES. Every variant trains
STEPS steps and is scored every EVAL_EVERY steps on EVAL_ROWS fixed test rows.
`,smoke`: a tiny model and a few steps (tests).

  mtp-ablation --groups bpe_names --seeds 0,1,2,3,4
"""
from mtp_jax import config_lib

VARIANTS = {'d0': (0, 'sequential'), 'n2': (1, 'parallel'), 'd1': (1, 'sequential')}
BASELINE = 'd0'
# size -> (d_model, n_layers): 13 d^2 non-embedding parameters a layer (attention 4 d^2,
# SwiGLU MLP of 3 d: 9 d^2), so about 1.06 M, 2.9 M and 10.2 M
SIZES = {'1m': (128, 5), '3m': (192, 6), '10m': (256, 12)}
VOCAB = 512
STEPS, WARMUP, EVAL_EVERY, EVAL_ROWS = 3000, 60, 100, 512
SMOKE_STEPS, SMOKE_EVAL_EVERY, SMOKE_EVAL_ROWS = 4, 2, 4
TASK = {'kind': 'bpe_names', 'vocab_size': VOCAB, 'corpus_stories': 4000, 'tokenizer_seed': 0,
        'body_min': 2, 'body_max': 4}
SMOKE_TASK = {**TASK, 'vocab_size': 384, 'corpus_stories': 200}

DEVICES = 1  # mesh.shape below: the research sweep runs each variant on one device


def non_embedding_params(size: str) -> int:
  d, layers = SIZES[size]
  return 13 * d * d * layers


def get_config(arg: str = 'd0,1m'):
  variant, *opts = arg.split(',')
  sizes = [o for o in opts if o in SIZES]
  if (variant not in VARIANTS or len(sizes) > 1
      or any(o != 'smoke' and o not in SIZES for o in opts)):
    raise ValueError(f'configs/induction_bpe.py: unknown argument {arg!r}; use '
                     f'configs/induction_bpe.py:<variant>,<size>[,smoke] with variant one of '
                     f'{", ".join(VARIANTS)} and size one of {", ".join(SIZES)}')
  smoke = 'smoke' in opts
  c = config_lib.base_config()
  c.model.dtype = 'float32'  # research results compare across hosts: not the host-chosen 'auto'
  if smoke:
    c.model.d_model, c.model.n_layers, c.model.mlp_dim = 32, 1, 96
    c.data.seq_len, c.data.batch_size = 64, 4
    c.model.vocab_size = SMOKE_TASK['vocab_size']
  else:
    d, layers = SIZES[sizes[0] if sizes else '1m']
    c.model.d_model, c.model.n_layers, c.model.mlp_dim = d, layers, 3 * d
    c.data.seq_len, c.data.batch_size = 128, 16
    c.model.vocab_size = VOCAB
  c.model.head_dim = 32 if not smoke else 16
  c.model.n_heads = c.model.n_kv_heads = c.model.d_model // c.model.head_dim
  c.data.tokenizer = 'byte'  # unused: the task's batches are its own tokenizer's ids
  c.model.mtp.depth, c.model.mtp.kind = VARIANTS[variant]
  c.model.mtp.lambda_values = (1.0,)  # Gloeckle et al.: the heads' losses summed unweighted
  c.train.lr = 3e-3
  c.train.min_lr_ratio = 1.0
  c.train.steps, c.train.warmup_steps = (SMOKE_STEPS, 1) if smoke else (STEPS, WARMUP)
  c.train.progress = False
  c.mesh.shape = (1, 1, 1)
  return c
