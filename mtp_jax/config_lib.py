"""The configuration's face: what config files and callers use, from the modules of
`mtp_jax/config/` (`base_config` in config/base.py documents every field; `validate` in
config/validation.py checks them before anything compiles, raising `ConfigError` naming
the offending field; the kinds a config may name are config/kinds.py's table).
"""
from mtp_jax.config.base import REMAT_POLICIES, base_config
from mtp_jax.config.kernel_limits import (
  ATTENTION_CORES,
  TRITON_BLOCKS,
  attention_kernel_problem,
  triton_blocks,
)
from mtp_jax.config.kinds import (
  ATTENTION,
  ATTENTION_KINDS,
  DATA_SOURCES,
  MLP,
  MLP_KINDS,
  MOE_DISPATCHES,
  MOE_EXCHANGES,
  MTP_HEADS,
  MTP_KINDS,
  AttentionFacts,
  HeadFacts,
  MLPFacts,
)
from mtp_jax.config.mesh import (
  DEFAULT_AXES,
  DEFAULT_RULES,
  MESH_AXES,
  fixed_devices,
  mesh_axes_form,
  resolved_mesh_axes,
  resolved_mesh_shape,
)
from mtp_jax.config.readers import (
  decode_prompt_len,
  optional,
  profile_window,
  rope_scaling_tuple,
  target_offsets,
)
from mtp_jax.config.schema import check_schema, require_positive_int
from mtp_jax.config.validation import staged_layers, validate, validate_data_source
from mtp_jax.errors import ConfigError

__all__ = [
    'ATTENTION', 'ATTENTION_CORES', 'ATTENTION_KINDS', 'DATA_SOURCES', 'DEFAULT_AXES',
    'DEFAULT_RULES', 'MESH_AXES', 'MLP', 'MLP_KINDS', 'MOE_DISPATCHES', 'MOE_EXCHANGES',
    'MTP_HEADS', 'MTP_KINDS', 'REMAT_POLICIES', 'TRITON_BLOCKS', 'AttentionFacts', 'ConfigError',
    'HeadFacts', 'MLPFacts', 'attention_kernel_problem', 'base_config', 'check_schema',
    'decode_prompt_len', 'fixed_devices', 'mesh_axes_form', 'optional', 'profile_window',
    'require_positive_int', 'resolved_mesh_axes', 'resolved_mesh_shape', 'rope_scaling_tuple',
    'staged_layers',
    'target_offsets', 'triton_blocks', 'validate', 'validate_data_source',
]
