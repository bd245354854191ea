"""The synthetic induction benchmark (mtp_jax/data/induction.py): `configs/induction.py:<v>`.

Rows of 64 tokens uniform over a 32-letter alphabet in which one span of 8-16
tokens occurs three times in a row; the score is the main head's accuracy on the
second occurrence (chance 1/32). Variants `d0`, `d1`, `d3` (sequential MTP), all with the same 2-layer
d 64 trunk, 16 x 64 tokens per step, optimizer and warmup-then-constant learning rate, at EQUAL TRAINING
FLOPs: M = 0 trains STEPS steps, M = k the most steps that fit the same FLOPs
(configs/ablation.py's equal_flop_steps); 0.13 M trunk parameters. scripts/ablation.py
evaluates every EVAL_EVERY steps on EVAL_ROWS fixed rows (a seed no training batch uses).
`,smoke`: a few steps of a smaller model (tests).

  python scripts/ablation.py --groups induction --seeds 0,1,2
"""
import os

from mtp_jax import config_files

# configs/_induction.py: the argument and the research run every induction config shares
INDUCTION = config_files.load_module(os.path.join(os.path.dirname(__file__), '_induction.py'))

VARIANTS = {'d0': (0, 'sequential'), 'd1': (1, 'sequential'), 'd3': (3, 'sequential')}
BASELINE = 'd0'
STEPS, WARMUP, EVAL_EVERY, EVAL_ROWS = 1200, 20, 40, 256
SMOKE_STEPS, SMOKE_EVAL_EVERY, SMOKE_EVAL_ROWS = 8, 4, 8
TASK = {'alphabet': 32, 'span_min': 8, 'span_max': 16, 'repeats': 3}
SMOKE_TASK = {'alphabet': 16, 'span_min': 4, 'span_max': 8, 'repeats': 3}


DEVICES = 1  # mesh.axes below: the research sweep runs each variant on one device


def get_config(arg: str = 'd0'):
  variant, opts = INDUCTION.split_argument('configs/induction.py', arg, VARIANTS)
  smoke = 'smoke' in opts
  c = INDUCTION.research_config(VARIANTS[variant], 0.3,
                                *((SMOKE_STEPS, 2) if smoke else (STEPS, WARMUP)))
  c.model.d_model, c.model.n_layers, c.model.mlp_dim = 64, 2, 192
  c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 2, 2, 32
  c.data.seq_len, c.data.batch_size = (32, 4) if smoke else (64, 16)
  return c
