"""The device mesh's named axes, the logical-axis rules, and the mesh read without devices."""
from __future__ import annotations

import math

from mtp_jax.errors import ConfigError

# The mesh axes, outermost first: the axes whose collectives tolerate the slowest links
# (data, then pipeline stages) lead, so that on a multislice job they are the ones that
# cross the data-center network (runtime/sharding.py); context and tensor, whose
# collectives sit inside every layer, are innermost, on neighbouring chips.
MESH_AXES = ('data', 'stage', 'fsdp', 'context', 'tensor')
# The older positional form, mesh.shape: one size for each of these three axes.
LEGACY_SHAPE_AXES = ('data', 'fsdp', 'tensor')
DEFAULT_AXES = {'data': -1, 'stage': 1, 'fsdp': 1, 'context': 1, 'tensor': 1}

# Logical axis -> mesh axis. Layers only ever name logical axes.
DEFAULT_RULES = (
    ('batch', ('data', 'fsdp')),  # activations: batch split over data and fsdp
    ('length', 'context'),  # sequence positions: context parallelism (model/context.py)
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


def _is_int(s) -> bool:
  return isinstance(s, int) and not isinstance(s, bool)


def legacy_shape_form(shape) -> tuple[int, ...]:
  """The older mesh.shape, (data, fsdp, tensor) sizes, as a tuple of ints."""
  ok = isinstance(shape, (tuple, list)) and all(_is_int(s) for s in shape)
  if not ok or len(shape) != len(LEGACY_SHAPE_AXES):
    raise ConfigError(f'mesh.shape must be {len(LEGACY_SHAPE_AXES)} integers '
                      f'{LEGACY_SHAPE_AXES} such as (-1, 1, 1), got {shape!r} '
                      "(or name the axes: mesh.axes = {'data': -1, 'context': 2})")
  return tuple(shape)


def mesh_axes_form(mesh) -> dict[str, int]:
  """The size of every mesh axis (MESH_AXES order; one may be -1, the remaining devices),
  checked without a device count, from config.mesh: its named `axes`, or the older
  positional `shape` (data, fsdp, tensor) of configs and saved config.json files written
  before the axes were named (then `axes` may add only stage and context)."""
  axes = mesh.get('axes', None) if hasattr(mesh, 'get') else None
  axes = dict(DEFAULT_AXES) if axes is None else dict(axes)
  unknown = sorted(set(axes) - set(MESH_AXES))
  if unknown:
    raise ConfigError(f'mesh.axes has unknown axis {unknown[0]!r}; axes are {MESH_AXES}')
  sizes = {a: axes.get(a, 1) for a in MESH_AXES}
  shape = mesh.get('shape', None) if hasattr(mesh, 'get') else None
  if shape is not None:
    shape = legacy_shape_form(shape)
    named = [a for a in LEGACY_SHAPE_AXES if sizes[a] != DEFAULT_AXES[a]]
    if named:
      raise ConfigError(f'mesh.shape {shape} and mesh.axes.{named[0]} both size the '
                        f'{named[0]} axis: set mesh.axes only (mesh.shape is the older form)')
    sizes.update(zip(LEGACY_SHAPE_AXES, shape))
  for a, s in sizes.items():
    if not _is_int(s) or s == 0 or s < -1:
      raise ConfigError(f'mesh.axes.{a} must be a positive integer or -1 (the remaining '
                        f'devices), got {s!r}')
  if list(sizes.values()).count(-1) > 1:
    raise ConfigError(f'mesh axes {describe(sizes)}: only one axis may be -1')
  return sizes


def describe(sizes: dict) -> str:
  """'data -1 x fsdp 16' style text of axis sizes (axes of size 1 left out)."""
  return ' x '.join(f'{a} {s}' for a, s in sizes.items() if s != 1) or 'one device'


def resolved_mesh_axes(mesh, num_devices: int) -> dict[str, int]:
  """mesh_axes_form with its -1 filled so that the sizes multiply to num_devices."""
  sizes = mesh_axes_form(mesh)
  known = math.prod(s for s in sizes.values() if s != -1)
  if -1 in sizes.values():
    if num_devices % known:
      raise ConfigError(f'mesh {describe(sizes)}: {num_devices} devices are not divisible '
                        f'by {known}')
    sizes = {a: num_devices // known if s == -1 else s for a, s in sizes.items()}
  if math.prod(sizes.values()) != num_devices:
    raise ConfigError(f'mesh {describe(sizes)} has {math.prod(sizes.values())} devices but '
                      f'{num_devices} are available')
  return sizes


def resolved_mesh_shape(shape, num_devices: int) -> tuple[int, ...]:
  """The older positional mesh.shape (data, fsdp, tensor) with its -1 filled."""
  shape = legacy_shape_form(shape)
  sizes = dict(DEFAULT_AXES, **dict(zip(LEGACY_SHAPE_AXES, shape)))
  sizes = resolved_mesh_axes({'axes': sizes}, num_devices)
  return tuple(sizes[a] for a in LEGACY_SHAPE_AXES)


def fixed_devices(mesh) -> int:
  """The devices the mesh's sized axes take (the -1 axis counted as 1)."""
  return math.prod(s for s in mesh_axes_form(mesh).values() if s != -1)
