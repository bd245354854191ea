"""The model and optimizer: their construction, sharded initialisation, and restoring a model.

The optimizer is AdamW with warmup + cosine and global-norm clipping; `trainable` says
which parameters it updates. `init_state` builds both straight onto the mesh (no
full-size host copy); `restore_model` reads the model of a training workdir's checkpoint.
"""
from __future__ import annotations

import jax
import optax
from flax import nnx

from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import config_lib
from mtp_jax.runtime import sharding
from mtp_jax.model.mtp import MTPModel, ModelArgs


# -- optimizer ----------------------------------------------------------------------------
def lr_schedule(config) -> optax.Schedule:
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


def create_model_and_optimizer(config) -> tuple[MTPModel, nnx.Optimizer]:
  model = MTPModel(ModelArgs.from_config(config), rngs=nnx.Rngs(config.seed))
  return model, nnx.Optimizer(model, build_optimizer(config), wrt=trainable(config))


def abstract_train_state(config):
  """ShapeDtypeStructs of the (model, optimizer) state, without creating any array."""
  return nnx.eval_shape(lambda: nnx.split(create_model_and_optimizer(config))[1])


# -- state on the mesh -------------------------------------------------------------------
def init_state(config, mesh, rules):
  """(graphdef, state, shardings, abstract): parameters created directly on the mesh."""
  with sharding.use_mesh(mesh, rules):
    abstract = nnx.eval_shape(lambda: create_model_and_optimizer(config))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = sharding.state_shardings(abstract_state, mesh)
    state = jax.jit(lambda: nnx.split(create_model_and_optimizer(config))[1],
                    out_shardings=shardings)()
  abstract_state = ckpt_lib.abstract_like(abstract_state, shardings)
  return graphdef, state, shardings, abstract_state


def restore_model_at(config, workdir: str, step: int, *, fallback: bool = False,
                     notify=ckpt_lib.warn) -> tuple[MTPModel, int]:
  """(model, step restored) of a workdir's checkpoint `step`, on one device; read-only.

  The optimizer state is read too (the fingerprint covers the whole state) and dropped.
  fallback: a broken `step` gives way to the newest intact older one (one warning line).
  """
  abstract = nnx.eval_shape(lambda: create_model_and_optimizer(config))
  graphdef, abstract_state = nnx.split(abstract)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        abstract_state)
  restored = ckpt_lib.restore_state(workdir, step, target, fallback=fallback, notify=notify)
  model, _ = nnx.merge(graphdef, restored.state)
  return model, restored.step


def restore_model(config, workdir: str, step: int, *, fallback: bool = False,
                  notify=ckpt_lib.warn) -> MTPModel:
  """The model of checkpoint `step` (see restore_model_at), on one device."""
  return restore_model_at(config, workdir, step, fallback=fallback, notify=notify)[0]
