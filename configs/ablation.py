"""MTP ablation on the stdlib corpus: `--config configs/ablation.py:<variant>[,smoke]`.

Variants (docs/design.md §2): `d0` (plain next-token model), `d1` and `d3` (DeepSeek-V3
sequential MTP modules, M = 1 and 3) and `d3p` (M = 3 parallel heads on h^0,
Gloeckle et al. 2024). Every variant has the same trunk (d 128, 2 layers, byte level,
T 128), tokens per step, optimizer and evaluation; only the heads differ.

The schedule is a linear warmup of WARMUP steps, then a CONSTANT learning rate (no
decay), and every variant trains STEPS steps. With a schedule that does not depend on
the run's length, the state of a run at step n is the state a run of n steps would
end with, so one run per variant and seed gives both budgets (scripts/ablation.py):
- equal tokens (the DeepSeek-V3 framing, MTP added on top): every variant at STEPS;
- equal training FLOPs: M = 0 at STEPS, variant v at equal_flop_steps(v), the most
  steps whose FLOPs (mtp_jax/train/flops.py, 3 x forward matmuls) do not exceed M = 0's.

0.47 M parameters at d0, 1.2 M at d3. Sized for the whole 3-seed sweep (with
configs/induction.py) in about 40 minutes of unpaused wall time on 2 shared CPU cores;
results and what they support: docs/research.md.
`,smoke` is the same on configs/tiny.py's shapes with a few steps (tests).

  python scripts/ablation.py --seeds 0,1,2

The sized sweep (`mtp-ablation --groups sized`, docs/research.md) uses `,decay`: the same
model and data with a cosine decay to 0.1 x the peak learning rate over each run's own
length, one run per budget, and two more variants, M = 3 sequential under the depth
curriculum: `d3f` (forward) and `d3r` (reverse), phases of a quarter of the run
(model.mtp.curriculum). SIZED_VARIANTS lists them; the design (seeds, steps) comes from
mtp_jax/research/design.py.
"""
from mtp_jax import config_lib

VARIANTS = {'d0': (0, 'sequential'), 'd1': (1, 'sequential'), 'd3': (3, 'sequential'),
            'd3p': (3, 'parallel')}  # variant -> (model.mtp.depth, model.mtp.kind)
BASELINE = 'd0'
# The sized sweep's variants: (model.mtp.depth, model.mtp.kind, model.mtp.curriculum).
SIZED_VARIANTS = {'d0': (0, 'sequential', 'none'), 'd1': (1, 'sequential', 'none'),
                  'd3': (3, 'sequential', 'none'), 'd3f': (3, 'sequential', 'forward'),
                  'd3r': (3, 'sequential', 'reverse'), 'd3p': (3, 'parallel', 'none')}
DECAY_MIN_LR_RATIO = 0.1  # ',decay': cosine to this fraction of train.lr at the run's end
STEPS, WARMUP = 320, 20
SMOKE_STEPS, SMOKE_WARMUP = 12, 2


def _base(smoke: bool):
  c = config_lib.base_config()
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
  c.mesh.shape = (1, 1, 1)
  return c


def step_flops(config) -> float:
  """Training FLOPs of one optimizer step of `config`."""
  from mtp_jax.train import flops  # imports JAX: only when a config is built
  tokens = config.data.batch_size * config.data.seq_len
  return flops.config_flops_per_token(config).train * tokens


def equal_flop_steps(config, baseline) -> int:
  """The most steps of `config` whose training FLOPs do not exceed `baseline`'s run."""
  return max(1, int(step_flops(baseline) * baseline.train.steps // step_flops(config)))


DEVICES = 1  # mesh.shape below: the research sweep runs each variant on one device


def get_config(arg: str = 'd3'):
  variant, *opts = arg.split(',')
  decay = 'decay' in opts
  known = SIZED_VARIANTS if decay else VARIANTS
  if variant not in known or any(o not in ('smoke', 'decay') for o in opts):
    raise ValueError(f'configs/ablation.py: unknown argument {arg!r}; use '
                     f'configs/ablation.py:<variant>[,smoke][,decay] with variant one of '
                     f'{", ".join(VARIANTS)} (with ,decay: {", ".join(SIZED_VARIANTS)})')
  c = _base('smoke' in opts)
  if decay:
    c.model.mtp.depth, c.model.mtp.kind, c.model.mtp.curriculum = SIZED_VARIANTS[variant]
    c.train.min_lr_ratio = DECAY_MIN_LR_RATIO
  else:
    c.model.mtp.depth, c.model.mtp.kind = VARIANTS[variant]
  return c
