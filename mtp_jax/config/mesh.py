"""The device mesh's axes, the logical-axis rules, and mesh.shape read without devices."""
from __future__ import annotations

import math

from mtp_jax.errors import ConfigError

MESH_AXES = ('data', 'fsdp', 'tensor')

# Logical axis -> mesh axis. Layers only ever name logical axes.
DEFAULT_RULES = (
    ('batch', ('data', 'fsdp')),  # activations: batch split over data and fsdp
    ('length', None),  # sequence positions stay whole
    ('act_embed', None),  # activation feature dim (replicated: fsdp gathers params)
    ('act_heads', 'tensor'),  # attention heads of activations
    ('act_mlp', 'tensor'),  # MLP hidden of activations
    ('act_vocab', 'tensor'),  # logits
    ('embed', 'fsdp'),  # parameter model dim, sharded ZeRO-3 style
    ('mlp', 'tensor'),  # parameter MLP hidden dim
    ('heads', 'tensor'),  # query heads
    ('kv_heads', 'tensor'),  # key/value heads
    ('head_dim', None),
    ('vocab', 'tensor'),  # embedding / output head vocab dim
    ('norm', None),  # RMSNorm scales
    ('depth', None),  # stacked MTP depth axis
    ('latent', None),  # MLA's compressed q / kv latent dims
    ('expert', 'data'),  # MoE routed experts: expert parallelism over the data axis
)


def mesh_shape_form(shape) -> tuple[int, ...]:
  """mesh.shape as a tuple of ints, checked without a device count: one entry per mesh
  axis, each positive or a single -1."""
  ok = (isinstance(shape, (tuple, list))
        and all(isinstance(s, int) and not isinstance(s, bool) for s in shape))
  if not ok or len(shape) != len(MESH_AXES):
    raise ConfigError(f'mesh.shape must be {len(MESH_AXES)} integers {MESH_AXES} such as '
                      f'(-1, 1, 1), got {shape!r}')
  shape = tuple(shape)
  if any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
    raise ConfigError(f'mesh.shape entries must be positive or a single -1, got {shape}')
  return shape


def resolved_mesh_shape(shape, num_devices: int) -> tuple[int, ...]:
  """Fills one -1 entry so the product equals num_devices."""
  shape = mesh_shape_form(shape)
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if num_devices % known:
      raise ConfigError(
          f'mesh.shape {shape}: {num_devices} devices are not divisible by {known}')
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ConfigError(
        f'mesh.shape {shape} has {math.prod(shape)} devices but {num_devices} are available')
  return shape
