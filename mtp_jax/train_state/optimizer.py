"""The optimizer: AdamW with warmup + cosine and global-norm clipping, and what it updates."""
from __future__ import annotations

import jax
import optax
from flax import nnx

from mtp_jax import config_lib


def lr_schedule(config) -> optax.Schedule:
  """Linear warmup to train.lr, then cosine decay to train.lr * train.min_lr_ratio."""
  t = config.train
  warmup = min(t.warmup_steps, max(t.steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.lr, warmup_steps=warmup,
      decay_steps=max(t.steps, warmup + 1), end_value=t.lr * t.min_lr_ratio)


def build_optimizer(config) -> optax.GradientTransformation:
  """AdamW with warmup + cosine, global-norm clipping; no decay on norms (1-D params)."""
  t = config.train
  adamw = optax.adamw(lr_schedule(config), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                      mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
  if t.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw)
  return adamw


def trainable(config):
  """The nnx filter of the parameters the optimizer updates (model.mtp.freeze_trunk: MTP only).

  Frozen parameters are left out of the optimizer rather than given zero updates
  (optax.set_to_zero): no gradient is computed for them, they hold no Adam moments, and
  they are never written, so they stay bit-identical (p + 0.0 would turn -0.0 into 0.0).
  """
  if config_lib.optional(config, 'model.mtp.freeze_trunk', False):
    return nnx.All(nnx.Param, nnx.PathContains('mtp'))
  return nnx.Param
