"""The Hugging Face bridge, both directions.

- hf.py: import: `--init_from hf:DIR`, `load_dir` / `load_model` of a local directory, and
  `params_from_hf`, the same from tensors already in memory.
- export.py: export: `export_workdir` / `export_model` to safetensors, config.json and the
  tokenizer.
- layouts.py: the tensor-name tables of each layout; hf_config.py: config.json <-> config.
- safetensors_io.py: reading and writing the files; fp8.py: DeepSeek-V3's block scales.
"""
from mtp_jax.interop.export import (
                                    LAYOUTS,
                                    export_model,
                                    export_workdir,
                                    model_params,
                                    to_hf_tensors,
)
from mtp_jax.interop.hf import apply_to_config, check_weights, load_dir, load_model, params_from_hf
from mtp_jax.interop.safetensors_io import InteropError

__all__ = ['InteropError', 'LAYOUTS', 'apply_to_config', 'check_weights', 'export_model',
           'export_workdir', 'load_dir', 'load_model', 'model_params', 'params_from_hf',
           'to_hf_tensors']
