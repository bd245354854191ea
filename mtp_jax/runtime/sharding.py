"""The device mesh and the logical-axis sharding table.

Layers name logical axes only (`batch`, `embed`, `heads`, ...); the config's
`mesh.rules` table maps them onto the named mesh axes (MESH_AXES: data, stage,
fsdp, context, tensor, outermost first).
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtp_jax.config.mesh import MESH_AXES, resolved_mesh_axes
from mtp_jax.errors import ConfigError


def make_mesh(config, devices=None) -> jax.sharding.Mesh:
  """The mesh of the config's named axes (MESH_AXES), with Auto axis types."""
  devices = jax.devices() if devices is None else devices
  shape = tuple(resolved_mesh_axes(config.mesh, len(devices)).values())
  axis_types = (jax.sharding.AxisType.Auto,) * len(shape)
  slices = len({getattr(d, 'slice_index', 0) for d in devices})
  if slices > 1:  # multislice: the slices meet over the data-center network
    return _multislice_mesh(shape, devices, slices, axis_types)
  return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)


def _multislice_mesh(shape, devices, slices: int, axis_types) -> jax.sharding.Mesh:
  """The mesh over several TPU slices: the first axis, outermost first, that the slice count
  divides (data, else stage, else fsdp, ...) spans the slices, so only its collectives cross the
  slower network."""
  axis = next((i for i, s in enumerate(shape) if s % slices == 0), None)
  if axis is None:
    raise ConfigError(
        f'mesh {dict(zip(MESH_AXES, shape))}: no axis is divisible by the '
        f'{slices} slices of this job')
  dcn = tuple(slices if i == axis else 1 for i in range(len(shape)))
  ici = tuple(s // slices if i == axis else s for i, s in enumerate(shape))
  grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
  return jax.sharding.Mesh(grid, MESH_AXES, axis_types=axis_types)


def rules_of(config) -> tuple:
  return tuple((name, tuple(ax) if isinstance(ax, (list, tuple)) else ax)
               for name, ax in config.mesh.rules)


@contextlib.contextmanager
def use_mesh(mesh, rules):
  """Makes `mesh` current and binds the logical-axis rules for layers."""
  with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
    yield


def logical_spec(names) -> P:
  """PartitionSpec for logical axis names under the active rules."""
  return flax_spmd.get_pspec(tuple(names))


def constrain(x, names):
  """Sharding hint for an activation; a no-op outside a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not flax_spmd.get_logical_axis_rules():
    return x
  return jax.lax.with_sharding_constraint(x, logical_spec(names))


def state_shardings(abstract_state, mesh):
  """NamedShardings for an nnx State from its params' logical annotations."""
  return nnx.get_named_sharding(abstract_state, mesh)


def batch_sharding(mesh) -> NamedSharding:
  """Sharding of a [B, T] input batch: batch axis over the data-parallel axes."""
  return NamedSharding(mesh, logical_spec(('batch', 'length')))


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def host_batch_to_global(batch: dict, mesh) -> dict:
  """Assembles per-process numpy batches into global sharded jax Arrays."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}
