"""What the induction configs share: their `<variant>[,option...]` argument and a research
run of one device, float32, byte tokens, a constant learning rate after warmup.

Not a config itself (no get_config): configs/induction*.py start from `research_config()`
and set their model and data sizes.
"""
from mtp_jax import config_lib


def bad_argument(path: str, arg: str, usage: str, variants, more: str = '') -> ValueError:
  return ValueError(f'{path}: unknown argument {arg!r}; use {path}:{usage} with variant one '
                    f'of {", ".join(variants)}{more}')


def split_argument(path: str, arg: str, variants, usage: str = '<variant>[,smoke]',
                   options=('smoke',), more: str = '') -> tuple[str, list[str]]:
  """(variant, options) of `arg`; ValueError naming the usage when either is unknown."""
  variant, *opts = arg.split(',')
  if variant not in variants or any(o not in options for o in opts):
    raise bad_argument(path, arg, usage, variants, more)
  return variant, opts


def research_config(depth_and_kind: tuple[int, str], lambda_value: float, steps: int,
                    warmup: int):
  """base_config() as every induction variant trains it: model.mtp.(depth, kind) and the
  MTP loss weight from the variant, lr 3e-3 held after `warmup` steps, one device."""
  c = config_lib.base_config()
  c.model.dtype = 'float32'  # research results compare across hosts: not the host-chosen 'auto'
  c.data.tokenizer = 'byte'
  c.model.mtp.depth, c.model.mtp.kind = depth_and_kind
  c.model.mtp.lambda_values = (lambda_value,)
  c.train.lr = 3e-3
  c.train.min_lr_ratio = 1.0
  c.train.steps, c.train.warmup_steps = steps, warmup
  c.train.progress = False
  c.mesh.axes.data = 1
  return c
