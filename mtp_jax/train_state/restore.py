"""The model of a training workdir's checkpoint, restored read-only on one device."""
from __future__ import annotations

import copy

import jax
from flax import nnx

from mtp_jax.checkpoint.reader import restore_state, warn
from mtp_jax.model.mtp import MTPModel
from mtp_jax.runtime import peak as peak_lib
from mtp_jax.train_state.state import create_model_and_optimizer


def restore_model_at(config, workdir: str, step: int, *, fallback: bool = False,
                     notify=warn, job: str = 'decode') -> tuple[MTPModel, int]:
  """(model, step restored) of a workdir's checkpoint `step`, on one device; read-only.

  The optimizer state is read too (the fingerprint covers the whole state) and dropped.
  fallback: a broken `step` gives way to the newest intact older one (one warning line).
  job: what the model is for (runtime/peak.py JOBS): a run trained under model.dtype 'auto'
  computes in what 'auto' means for it (decoding: float32, whatever training resolved).
  """
  config = copy.deepcopy(config)
  peak_lib.resolve_model_dtype(config, job)
  abstract = nnx.eval_shape(lambda: create_model_and_optimizer(config))
  graphdef, abstract_state = nnx.split(abstract)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        abstract_state)
  restored = restore_state(workdir, step, target, fallback=fallback, notify=notify)
  model, _ = nnx.merge(graphdef, restored.state)
  return model, restored.step


def restore_model(config, workdir: str, step: int, *, fallback: bool = False,
                  notify=warn, job: str = 'decode') -> MTPModel:
  """The model of checkpoint `step` (see restore_model_at), on one device."""
  return restore_model_at(config, workdir, step, fallback=fallback, notify=notify, job=job)[0]
