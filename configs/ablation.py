"""Head-kind ablation at equal training compute: `--config configs/ablation.py:<variant>`.

Variants (DESIGN.md §2): `none` (D = 0, plain next-token model), `sequential`
(DeepSeek-V3 MTP modules, D = 2) and `parallel` (D = 2 independent blocks on h^0,
Gloeckle et al. 2024). Every variant has the same trunk, tokens per step, optimizer,
LR-schedule shape and evaluation; only the heads and the number of steps differ. The
steps are the training-FLOP budget over the variant's FLOPs per step (mtp_jax/flops.py,
3 x forward matmul FLOPs), rounded down, so D = 0 gets proportionally more steps.

Budget: BUDGET_FLOPS = 10 TFLOP per variant (d 128, 4 layers, 2,048 tokens per step:
794 / 489 / 509 steps for none / sequential / parallel), sized for about 25-30 minutes
of training for all three on 2 shared CPU cores; measured 15-32 min of training steps
(18-41 min for the whole run) at load 4-8 (README, research recipe on head kinds).
`:<variant>,smoke` is the same ablation on a tiny model with a tiny budget (tests: the
whole script end to end in about a minute).
`scripts/ablation.py` trains all three and tabulates them.
"""
from mtp_jax import config_lib

VARIANTS = {'none': (0, 'sequential'), 'sequential': (2, 'sequential'),
            'parallel': (2, 'parallel')}  # variant -> (model.mtp.depth, model.mtp.kind)
BUDGET_FLOPS = 10e12  # training FLOPs per variant (flops.py's count)
SMOKE_BUDGET_FLOPS = 1e10  # tiny model: 25 / 11 / 11 steps


def _base(smoke: bool):
  c = config_lib.base_config()
  if smoke:  # configs/tiny.py's model and data shapes
    c.model.d_model, c.model.n_layers, c.model.mlp_dim = 64, 2, 192
    c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 4, 2, 16
    c.data.seq_len, c.data.batch_size = 64, 8
    c.train.eval_batches = 2
  else:
    c.model.d_model = 128
    c.model.n_layers = 4
    c.model.n_heads = 2
    c.model.n_kv_heads = 2
    c.model.head_dim = 64
    c.model.mlp_dim = 384
    c.data.seq_len = 256
    c.data.batch_size = 8  # 2,048 tokens per step: more updates for a small budget
    c.train.eval_batches = 16  # 32,768 validation tokens, the same for every variant
  c.data.tokenizer = 'byte'
  # Document order: with seed 0, pydoc_data/topics.py (757 KB of English prose, ~370
  # steps) starts at step 608, so only D = 0 (794 steps) would end its training on
  # non-code text, and its validation loss on code rose from step 600 to 794. Seed 1
  # has no file over 150 KB in the first 1.6 M tokens (README, Research recipes).
  c.data.shuffle_seed = 1
  c.model.mtp.lambda_values = (0.3,)  # DeepSeek-V3's first-phase lambda, constant here
  c.train.lr = 3e-3
  c.train.log_every = 10
  c.train.eval_every = 0  # evaluate once, at the end (same for every variant)
  c.train.checkpoint_every = 100  # resumable; a killed variant redoes < 100 steps
  return c


def step_flops(config) -> float:
  """Training FLOPs of one optimizer step of `config`."""
  from mtp_jax import flops  # imports JAX: only when a config is built
  tokens = config.data.batch_size * config.data.seq_len
  return flops.config_flops_per_token(config).train * tokens


def get_config(arg: str = 'sequential'):
  variant, *opts = arg.split(',')
  if variant not in VARIANTS or any(o != 'smoke' for o in opts):
    raise ValueError(f'configs/ablation.py: unknown argument {arg!r}; use '
                     f'configs/ablation.py:<variant>[,smoke] with variant one of '
                     f'{", ".join(VARIANTS)}')
  smoke = 'smoke' in opts
  c = _base(smoke)
  c.model.mtp.depth, c.model.mtp.kind = VARIANTS[variant]
  budget = SMOKE_BUDGET_FLOPS if smoke else BUDGET_FLOPS
  c.train.steps = max(1, int(budget // step_flops(c)))
  c.train.warmup_steps = c.train.steps // 10  # same schedule shape for every variant
  return c
