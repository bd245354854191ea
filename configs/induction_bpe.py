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
  mtp-ablation --groups bpe_names --variants d0@1m,n2@1m --seeds 0,1,2,3,4   # one size
"""
import os

from mtp_jax import config_files

# configs/_induction.py: the argument and the research run every induction config shares
INDUCTION = config_files.load_module(os.path.join(os.path.dirname(__file__), '_induction.py'))

VARIANTS = {'d0': (0, 'sequential'), 'n2': (1, 'parallel'), 'd1': (1, 'sequential')}
BASELINE = 'd0'
# size -> (d_model, n_layers): 13 d^2 non-embedding parameters a layer (attention 4 d^2,
# SwiGLU MLP of 3 d: 9 d^2), so about 1.06 M and 2.9 M, the paper's two smallest models.
# 10 M (d 256, 12 layers; about 125 GFLOP a step) would take hours a run on 2 CPU cores.
SIZES = {'1m': (128, 5), '3m': (192, 6)}
VOCAB = 512
STEPS, WARMUP, EVAL_EVERY, EVAL_ROWS = 3000, 60, 100, 512
SMOKE_STEPS, SMOKE_EVAL_EVERY, SMOKE_EVAL_ROWS = 4, 2, 4
TASK = {'kind': 'bpe_names', 'vocab_size': VOCAB, 'corpus_stories': 4000, 'tokenizer_seed': 0,
        'body_min': 2, 'body_max': 4}
SMOKE_TASK = {**TASK, 'vocab_size': 384, 'corpus_stories': 200}

DEVICES = 1  # mesh.axes below: the research sweep runs each variant on one device


def non_embedding_params(size: str) -> int:
  d, layers = SIZES[size]
  return 13 * d * d * layers


def get_config(arg: str = 'd0,1m'):
  path, usage, more = 'configs/induction_bpe.py', '<variant>,<size>[,smoke]', (
      f' and size one of {", ".join(SIZES)}')
  variant, opts = INDUCTION.split_argument(path, arg, VARIANTS, usage, ('smoke', *SIZES), more)
  sizes = [o for o in opts if o in SIZES]
  if len(sizes) > 1:
    raise INDUCTION.bad_argument(path, arg, usage, VARIANTS, more)
  smoke = 'smoke' in opts
  # Gloeckle et al.: the heads' losses summed unweighted (lambda 1)
  c = INDUCTION.research_config(VARIANTS[variant], 1.0,
                                *((SMOKE_STEPS, 1) if smoke else (STEPS, WARMUP)))
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
  # data.tokenizer 'byte' is unused: the task's batches are its own tokenizer's ids
  return c
