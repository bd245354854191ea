"""Induction on stories with random names (Gloeckle et al. 2024, section 4.1, scaled down):
`configs/induction_names.py:<variant>[,smoke]`.

The task is mtp_jax/data/induction.py's NameStoryTask: template children's-story sentences
whose two characters get random names of 3-6 letters (several byte tokens each), packed
as documents into rows of 128 tokens; the score is the main head's accuracy on the
second token of a name at its second mention (chance 1/26). Variants, all with the same
2-layer d 128 trunk (0.4 M non-embedding parameters), 16 x 128 tokens per step, optimizer
and warmup-then-constant learning rate:
- `d0`: next-token prediction only;
- `p2`: parallel n = 2 (one parallel head on h^0 predicting t_(i+2), Gloeckle et al.);
- `d1`: sequential M = 1 (a DeepSeek-V3 MTP module).
Every variant trains STEPS steps (equal steps and tokens) and is evaluated every
EVAL_EVERY steps on EVAL_ROWS fixed rows; the learning rate is constant after warmup,
so the state at step n is what an n-step run ends with, and the equal-FLOP comparison
reads M = 0 at STEPS against each MTP variant at the most steps whose FLOPs fit
(configs/ablation.py's equal_flop_steps), from the same curves.
`,smoke`: a few steps of a smaller model (tests).

  mtp-ablation --groups names --seeds 0,1,2,3,4
"""
import os

from mtp_jax import config_files

# configs/_induction.py: the argument and the research run every induction config shares
INDUCTION = config_files.load_module(os.path.join(os.path.dirname(__file__), '_induction.py'))

VARIANTS = {'d0': (0, 'sequential'), 'p2': (1, 'parallel'), 'd1': (1, 'sequential')}
BASELINE = 'd0'
STEPS, WARMUP, EVAL_EVERY, EVAL_ROWS = 1500, 30, 50, 512
SMOKE_STEPS, SMOKE_EVAL_EVERY, SMOKE_EVAL_ROWS = 8, 4, 8
TASK = {'kind': 'names', 'name_min': 3, 'name_max': 6, 'body_min': 2, 'body_max': 4}
SMOKE_TASK = dict(TASK)
CHANCE = 1 / 26  # the second letter of a name is uniform over the 26 lower-case letters


DEVICES = 1  # mesh.axes below: the research sweep runs each variant on one device


def get_config(arg: str = 'd0'):
  variant, opts = INDUCTION.split_argument('configs/induction_names.py', arg, VARIANTS)
  smoke = 'smoke' in opts
  # Gloeckle et al.: the heads' losses summed unweighted (lambda 1)
  c = INDUCTION.research_config(VARIANTS[variant], 1.0,
                                *((SMOKE_STEPS, 2) if smoke else (STEPS, WARMUP)))
  if smoke:
    c.model.d_model, c.model.n_layers, c.model.mlp_dim = 32, 1, 64
    c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 2, 2, 16
    c.data.seq_len, c.data.batch_size = 64, 4
  else:
    c.model.d_model, c.model.n_layers, c.model.mlp_dim = 128, 2, 384
    c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 4, 4, 32
    c.data.seq_len, c.data.batch_size = 128, 16
  return c
