"""The slice a program is compiled for: accelerator types as chip grids, their compile-only
devices (libtpu for a TPU slice, the CUDA plugin for a GPU host; neither needs the hardware),
and tracing as if on that platform."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re

import jax
from jax.experimental import topologies
from jax.experimental.compilation_cache import compilation_cache

from mtp_jax.errors import RequestError
from mtp_jax.runtime import chips as chips_lib


@dataclasses.dataclass(frozen=True)
class Topology:
  """A Cloud TPU accelerator type (v5p-64) as a chip grid, or a GPU target."""
  name: str  # as given: v5p-64, v5litepod-16, ...
  chip: chips_lib.Chip
  shape: tuple  # chips along each ICI axis
  num_slices: int = 1

  @property
  def chips(self) -> int:
    return math.prod(self.shape) * self.num_slices


def _grid(chips: int, dims: int) -> tuple | None:
  """The standard slice shape of `chips` chips: 2x2(x1) doubled one axis at a time
  (3-D: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ...; 2-D: 2x2, 2x4, 4x4, 4x8, ...)."""
  if chips == 1 and dims == 2:
    return (1, 1)
  shape = [2, 2, 1] if dims == 3 else [2, 2]
  while math.prod(shape) < chips:
    low = min(shape)
    i = max(j for j, s in enumerate(shape) if s == low)
    shape[i] *= 2
  return tuple(shape) if math.prod(shape) == chips else None


def parse_topology(name: str, num_slices: int = 1) -> Topology:
  """v4-N / v5p-N (N TensorCores, 2 per chip), v5e-N / v5litepod-N / v6e-N (N chips);
  h100-N / h200-N: N GPUs of one host (1 to 8)."""
  g = re.fullmatch(r'(h100|h200)-(\d+)', name.strip().lower())
  if g:
    n = int(g.group(2))
    if not 1 <= n <= 8 or num_slices != 1:
      raise RequestError(f'--topology {name!r}: a GPU target is 1 to 8 GPUs of one host '
                         '(and --num_slices 1)')
    return Topology(name, chips_lib.chip(g.group(1)), (n,), 1)
  m = re.fullmatch(r'(v4|v5p|v5e|v5litepod|v6e)-(\d+)', name.strip().lower())
  if not m:
    raise RequestError(f'--topology {name!r}: expected a Cloud TPU accelerator type such as '
                       'v4-8, v5p-64, v5e-16 (v5litepod-16) or v6e-256')
  if not isinstance(num_slices, int) or num_slices < 1:
    raise RequestError(f'--num_slices must be a positive integer, got {num_slices!r}')
  chip = chips_lib.chip(m.group(1))
  n = int(m.group(2))
  dims = 3 if chip.name in ('v4', 'v5p') else 2
  chips = n // chip.cores if n % chip.cores == 0 else 0
  shape = _grid(chips, dims) if chips else None
  if shape is None or (dims == 2 and chips > 256):
    sizes = ('8, 16, 32, 64, 128, ... (TensorCores, 2 per chip)' if dims == 3
             else '1, 4, 8, 16, 32, 64, 128, 256 (chips)')
    raise RequestError(f'--topology {name!r}: {m.group(1)} slices come in sizes {sizes}')
  return Topology(name, chip, shape, num_slices)


def topology_devices(topo: Topology) -> list:
  """The compile-only devices of the slice (libtpu, no TPU needed; for a GPU target the
  CUDA plugin, no GPU needed)."""
  if topo.chip.platform == 'gpu':
    try:
      desc = topologies.get_topology_desc(
          platform='cuda', target_config=chips_lib.gpu_target_config(topo.chip),
          topology=f'1x1x{topo.shape[0]}')
    except Exception as e:  # pylint: disable=broad-except
      raise RequestError(
          f'cannot describe GPU target {topo.name} (the CUDA plugin is needed: pip install '
          f'jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__}): '
          f'{" ".join(str(e).split())[:300]}') from e
    return list(desc.devices)
  # libtpu takes a machine-wide lock file when it loads; compile-only use touches no chip,
  # so several compiling processes (or a TPU job beside this one) may share the machine.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  dims = len(topo.shape)
  shape3 = topo.shape + (1,) * (3 - dims)
  # Wraparound links: 3-D slices whose every side is a multiple of 4; the full 16x16 2-D pod.
  torus = (all(s % 4 == 0 for s in topo.shape) if dims == 3 else topo.shape == (16, 16))
  host = tuple(min(s, b) for s, b in zip(shape3, (2, 2, 1)))
  try:
    desc = topologies.get_topology_desc(
        platform='tpu', topology_name=f'{topo.chip.name}:' + 'x'.join(map(str, topo.shape)),
        chip_config_name='megacore' if topo.chip.cores == 2 else 'default',
        chips_per_host_bounds=host, num_slices=topo.num_slices,
        wrap=(torus,) * 2 + ((torus,) if dims == 3 else (False,)))
  except Exception as e:  # pylint: disable=broad-except
    raise RequestError(f'cannot describe TPU topology {topo.name} (is libtpu installed? '
                       f'pip install libtpu): {" ".join(str(e).split())[:300]}') from e
  return list(desc.devices)


@contextlib.contextmanager
def traced_for(platform: str):
  """Makes jax.default_backend() name `platform` while programs for it are built."""
  real = jax.default_backend
  jax.default_backend = lambda: platform
  try:
    yield
  finally:
    jax.default_backend = real


@contextlib.contextmanager
def no_jax_cache():
  """JAX's persistent cache off: it writes compile-only executables it cannot read back.

  JAX decides once per process whether the cache is in use, so a cache an earlier training
  run in the same process switched on is reset, and reset again on the way out so the
  flag is read afresh.
  """
  was = jax.config.jax_enable_compilation_cache
  jax.config.update('jax_enable_compilation_cache', False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update('jax_enable_compilation_cache', was)
    compilation_cache.reset_cache()

