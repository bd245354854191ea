"""MTP ablation on the stdlib corpus: `--config configs/ablation.py:<variant>[,decay][,smoke]`.

Every variant has the same trunk (d 128, 2 layers, byte level, T 128, 1,024 tokens a step),
optimizer, λ = 0.3 and evaluation; only the heads and their schedule differ (docs/design.md
§2–3). 0.47 M parameters at d0, 1.2 M at d3. Results and what they support:
docs/research.md.

`,decay` (the sized sweep, `mtp-ablation --groups sized`): a cosine decay to
DECAY_MIN_LR_RATIO x the peak learning rate over each run's own length, so each budget
(equal tokens, equal training FLOPs) is its own run. SIZED_VARIANTS: `d0` (next-token
only), `d1` and `d3` (DeepSeek-V3 sequential modules, M = 1 and 3), `d3f` and `d3r`
(M = 3 under the forward and reverse depth curriculum, model.mtp.curriculum, phases of a
quarter of the run), `d3p` (M = 3 parallel heads on h^0, Gloeckle et al. 2024) and `t1`
(token order prediction, Zuhri et al. 2025: one ranking head on h^0, window
model.mtp.top_window). The design (seeds, steps, the families of tests) comes from
mtp_jax/research/design.py.

Without `,decay` (the `lm` group): a linear warmup of WARMUP steps, then a constant
learning rate, STEPS steps for every variant in VARIANTS. The state of such a run at step
n is what an n-step run ends with, so one run per variant and seed gives both budgets:
every variant at STEPS (equal tokens), and variant v at equal_flop_steps(v), the most
steps whose FLOPs (mtp_jax/train/flops.py) do not exceed M = 0's.

`,deep` (with `,decay`: the compute study, mtp_jax/research/design.py's COMPUTE_*):
the same trunk at DEEP_LAYERS layers and the same MTP module, so one module costs at most
15 % of a d1 training step's FLOPs (mtp_jax/train/flops.py; 2 layers: 38 %).

`,smoke` is the same on configs/tiny.py's shapes with a few steps (tests).

  python scripts/train.py --config configs/ablation.py:d3f,decay
"""
from mtp_jax import config_lib

VARIANTS = {'d0': (0, 'sequential'), 'd1': (1, 'sequential'), 'd3': (3, 'sequential'),
            'd3p': (3, 'parallel')}  # variant -> (model.mtp.depth, model.mtp.kind)
BASELINE = 'd0'
# The sized sweep's variants: (model.mtp.depth, model.mtp.kind, model.mtp.curriculum).
SIZED_VARIANTS = {'d0': (0, 'sequential', 'none'), 'd1': (1, 'sequential', 'none'),
                  'd3': (3, 'sequential', 'none'), 'd3f': (3, 'sequential', 'forward'),
                  'd3r': (3, 'sequential', 'reverse'), 'd3p': (3, 'parallel', 'none'),
                  't1': (1, 'top', 'none')}
DECAY_MIN_LR_RATIO = 0.1  # ',decay': cosine to this fraction of train.lr at the run's end
STEPS, WARMUP = 320, 20
SMOKE_STEPS, SMOKE_WARMUP = 12, 2
DEEP_LAYERS = 8  # ',deep': one MTP module is 13.9 % of a d1 step's training FLOPs
SMOKE_DEEP_LAYERS = 3
OPTIONS = ('smoke', 'decay', 'deep')


def _base(smoke: bool):
  c = config_lib.base_config()
  c.model.dtype = 'float32'  # research results compare across hosts: not the host-chosen 'auto'
  if smoke:  # configs/tiny.py's model and data shapes
    c.model.d_model, c.model.n_layers, c.model.mlp_dim = 64, 2, 192
    c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 4, 2, 16
    c.data.seq_len, c.data.batch_size = 64, 4
  else:
    c.model.d_model = 128
    c.model.n_layers = 2
    c.model.n_heads = 2
    c.model.n_kv_heads = 2
    c.model.head_dim = 64
    c.model.mlp_dim = 384
    c.data.seq_len = 128
    c.data.batch_size = 8  # 1,024 tokens per step
  c.data.tokenizer = 'byte'
  c.model.mtp.lambda_values = (0.3,)  # DeepSeek-V3's first-phase lambda, constant here
  c.train.lr = 3e-3
  c.train.min_lr_ratio = 1.0  # constant after warmup: see the module docstring
  c.train.steps, c.train.warmup_steps = (SMOKE_STEPS, SMOKE_WARMUP) if smoke else (STEPS, WARMUP)
  c.train.log_every = 10
  c.train.eval_every = 0
  c.train.progress = False
  c.mesh.axes.data = 1
  return c


def step_flops(config) -> float:
  """Training FLOPs of one optimizer step of `config`."""
  from mtp_jax.train import flops  # imports JAX: only when a config is built
  tokens = config.data.batch_size * config.data.seq_len
  return flops.config_flops_per_token(config).train * tokens


def equal_flop_steps(config, baseline) -> int:
  """The most steps of `config` whose training FLOPs do not exceed `baseline`'s run."""
  return max(1, int(step_flops(baseline) * baseline.train.steps // step_flops(config)))


DEVICES = 1  # mesh.axes below: the research sweep runs each variant on one device


def get_config(arg: str = 'd3'):
  variant, *opts = arg.split(',')
  decay = 'decay' in opts
  known = SIZED_VARIANTS if decay else VARIANTS
  if variant not in known or any(o not in OPTIONS for o in opts) or (
      'deep' in opts and not decay):
    raise ValueError(f'configs/ablation.py: unknown argument {arg!r}; use '
                     f'configs/ablation.py:<variant>[,smoke][,decay[,deep]] with variant one of '
                     f'{", ".join(VARIANTS)} (with ,decay: {", ".join(SIZED_VARIANTS)})')
  c = _base('smoke' in opts)
  if 'deep' in opts:
    c.model.n_layers = SMOKE_DEEP_LAYERS if 'smoke' in opts else DEEP_LAYERS
  if decay:
    c.model.mtp.depth, c.model.mtp.kind, c.model.mtp.curriculum = SIZED_VARIANTS[variant]
    c.train.min_lr_ratio = DECAY_MIN_LR_RATIO
  else:
    c.model.mtp.depth, c.model.mtp.kind = VARIANTS[variant]
  return c
