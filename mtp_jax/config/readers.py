"""Values read off a config: a field of an older config, and the forms other code takes
(target offsets, RoPE scaling, the profiler window, the decode prompt length)."""
from __future__ import annotations

import mtp_jax.config.kinds as kinds
from mtp_jax.errors import ConfigError


def optional(config, dotted: str, default):
  """config's `dotted` field, or `default` in a config saved before the field existed
  (decoding and --init_from read the configs of older runs)."""
  node = config
  for part in dotted.split('.'):
    if part not in node:
      return default
    node = node[part]
  return node


def decode_prompt_len(config) -> int:
  """Prompt tokens of the decode evaluation: half a training sequence."""
  return config.data.seq_len // 2


def target_offsets(config) -> tuple:
  """(1, o_1, ..., o_M): the target offset of every head of `config`, the main one first.
  config/kinds.py's target_offsets is the rule (ModelArgs and LossArgs read it too)."""
  return kinds.target_offsets(optional(config, 'model.mtp.kind', 'sequential'),
                              config.model.mtp.depth,
                              optional(config, 'model.mtp.target_offsets', ()))


def rope_scaling_tuple(config) -> tuple:
  """config.model.rope_scaling in layers.rope_inv_freq's form (() when off or absent)."""
  rs = optional(config, 'model.rope_scaling', None)
  if rs is None or not rs.kind:
    return ()
  if rs.kind == 'linear':
    return ('linear', float(rs.factor))
  return ('llama3', float(rs.factor), float(rs.low_freq_factor), float(rs.high_freq_factor),
          int(rs.original_max_positions))


def profile_window(config) -> tuple[int, int] | None:
  """train.profile_steps 'A:B' as (A, B): the trace covers steps A..B-1 (1-based, as logged).

  None when off. ConfigError when malformed, or when an evaluation or a checkpoint falls
  inside the window (their time would be traced as if it were training).
  """
  t = config.train
  text = t.profile_steps
  if text in ('', None):
    return None
  parts = str(text).split(':')
  try:
    a, b = (int(p) for p in parts) if len(parts) == 2 else (None, None)
  except ValueError:
    a = b = None
  if a is None or not 1 <= a < b:
    raise ConfigError(f"train.profile_steps must be 'A:B' with 1 <= A < B (trace steps A to "
                      f'B-1), got {text!r}')
  if a > t.steps:
    raise ConfigError(f'train.profile_steps {text!r} starts after the last step '
                      f'(train.steps={t.steps})')
  for name in ('eval_every', 'checkpoint_every'):
    every = t[name]
    if every and isinstance(every, int) and every > 0:
      inside = [s for s in range(a, min(b, t.steps + 1) - 1) if s % every == 0]
      if inside:
        what = 'an evaluation' if name == 'eval_every' else 'a checkpoint save'
        raise ConfigError(f'train.profile_steps {text!r}: step {inside[0]} inside the window '
                          f'is followed by {what} (train.{name}={every}); pick a window '
                          'between them so only training is traced')
  return a, b
