"""The optimizer: AdamW with warmup + cosine and global-norm clipping, and what it updates."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mtp_jax.config.readers import optional


def schedule_inputs(config) -> dict:
  """The optimizer's settings as arrays the compiled train step takes at run time.

  train.steps, warmup_steps, lr, min_lr_ratio, b1, b2, weight_decay and grad_clip are inputs
  of the program, not constants in it: a rerun that changes only them (the common "resume
  with more steps") loads the compiled step from the persistent compilation cache. Whether
  grad_clip is 0 (no clipping) is the one structural choice: it changes the optimizer state.
  """
  t = config.train
  return {'steps': np.int32(t.steps), 'warmup_steps': np.int32(t.warmup_steps),
          'lr': np.float32(t.lr), 'min_lr_ratio': np.float32(t.min_lr_ratio),
          'b1': np.float32(t.b1), 'b2': np.float32(t.b2),
          'weight_decay': np.float32(t.weight_decay), 'grad_clip': np.float32(t.grad_clip)}


def lr_at(count, inputs: dict):
  """Linear warmup from 0 to lr over min(warmup_steps, steps - 1) steps, then cosine decay
  to lr * min_lr_ratio at `steps` (held there after); `inputs` as schedule_inputs gives."""
  count = jnp.asarray(count, jnp.int32)
  steps = jnp.asarray(inputs['steps'], jnp.int32)
  warmup = jnp.minimum(jnp.asarray(inputs['warmup_steps'], jnp.int32),
                       jnp.maximum(steps - 1, 0))
  decay = jnp.maximum(steps, warmup + 1) - warmup
  peak = jnp.asarray(inputs['lr'], jnp.float32)
  end = peak * jnp.asarray(inputs['min_lr_ratio'], jnp.float32)
  ramp = peak * count.astype(jnp.float32) / jnp.maximum(warmup, 1).astype(jnp.float32)
  done = jnp.clip(count - warmup, 0, decay).astype(jnp.float32) / decay.astype(jnp.float32)
  cosine = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * done))
  return jnp.where(count < warmup, ramp, cosine)


def lr_schedule(config) -> optax.Schedule:
  """Linear warmup to train.lr, then cosine decay to train.lr * train.min_lr_ratio."""
  inputs = schedule_inputs(config)
  return lambda count: lr_at(count, inputs)


def _scale_by_runtime_lr(config) -> optax.GradientTransformationExtraArgs:
  """optax.scale_by_learning_rate(lr_schedule(config)) whose schedule settings may come
  with each update (`schedule=` schedule_inputs of the step); same state (the count)."""
  default = schedule_inputs(config)

  def init_fn(params):
    del params
    return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, *, schedule=None, **extra):
    del params, extra
    step_size = -lr_at(state.count, default if schedule is None else schedule)
    updates = jax.tree.map(lambda g: jnp.asarray(step_size, g.dtype) * g, updates)
    return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _with_runtime_settings(make, config) -> optax.GradientTransformationExtraArgs:
  """The optax transformation `make(settings)` with its settings read from the update's
  `schedule` argument (schedule_inputs of the step) when given, else the config's. Its
  state's structure does not depend on the settings, so init uses the config's."""
  default = schedule_inputs(config)

  def init_fn(params):
    return make(default).init(params)

  def update_fn(updates, state, params=None, *, schedule=None, **extra):
    del extra
    return make(default if schedule is None else schedule).update(updates, state, params)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _is_matrix(params):
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def build_optimizer(config) -> optax.GradientTransformation:
  """AdamW with warmup + cosine, global-norm clipping; no decay on norms (1-D params).

  optax.adamw's own chain (clip_by_global_norm, scale_by_adam, add_decayed_weights, the
  learning rate), each reading its settings from the update's `schedule` argument when
  given (schedule_inputs), so none of them is compiled in.
  """
  adamw = optax.chain(
      _with_runtime_settings(lambda s: optax.scale_by_adam(b1=s['b1'], b2=s['b2']), config),
      _with_runtime_settings(
          lambda s: optax.add_decayed_weights(s['weight_decay'], _is_matrix), config),
      _scale_by_runtime_lr(config))
  if config.train.grad_clip > 0:
    return optax.chain(_with_runtime_settings(
        lambda s: optax.clip_by_global_norm(s['grad_clip']), config), adamw)
  return adamw


def trainable(config):
  """The nnx filter of the parameters the optimizer updates (model.mtp.freeze_trunk: MTP only).

  Frozen parameters are left out of the optimizer rather than given zero updates
  (optax.set_to_zero): no gradient is computed for them, they hold no Adam moments, and
  they are never written, so they stay bit-identical (p + 0.0 would turn -0.0 into 0.0).
  """
  if optional(config, 'model.mtp.freeze_trunk', False):
    return nnx.All(nnx.Param, nnx.PathContains('mtp'))
  return nnx.Param
