"""The model and optimizer built together: abstractly, or straight onto the mesh.

`init_state` creates the parameters under the mesh's shardings (no full-size host copy).
"""
from __future__ import annotations

import jax
from flax import nnx

from mtp_jax.checkpoint.store import abstract_like
from mtp_jax.model.args import ModelArgs
from mtp_jax.model.mtp import MTPModel
from mtp_jax.runtime import sharding
from mtp_jax.train_state.optimizer import build_optimizer, trainable


def create_model_and_optimizer(config) -> tuple[MTPModel, nnx.Optimizer]:
  model = MTPModel(ModelArgs.from_config(config), rngs=nnx.Rngs(config.seed))
  return model, nnx.Optimizer(model, build_optimizer(config), wrt=trainable(config))


def abstract_train_state(config):
  """ShapeDtypeStructs of the (model, optimizer) state, without creating any array."""
  return nnx.eval_shape(lambda: nnx.split(create_model_and_optimizer(config))[1])


def init_state(config, mesh, rules):
  """(graphdef, state, shardings, abstract): parameters created directly on the mesh."""
  with sharding.use_mesh(mesh, rules):
    abstract = nnx.eval_shape(lambda: create_model_and_optimizer(config))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = sharding.state_shardings(abstract_state, mesh)
    state = jax.jit(lambda: nnx.split(create_model_and_optimizer(config))[1],
                    out_shardings=shardings)()
  abstract_state = abstract_like(abstract_state, shardings)
  return graphdef, state, shardings, abstract_state
