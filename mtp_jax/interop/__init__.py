"""The Hugging Face bridge, both directions.

- hf.py: import: `--init_from hf:DIR`, `load_dir` / `load_model` of a local directory, and
  `params_from_hf`, the same from tensors already in memory.
- export.py: export: `export_workdir` / `export_model` to safetensors, config.json and the
  tokenizer.
- layouts.py: the tensor-name tables of each layout; hf_config.py: config.json <-> config.
- safetensors_io.py: reading and writing the files; fp8.py: DeepSeek-V3's block scales.

Public names load lazily (mtp_jax/exports.py), as in every sub-package.
"""
from mtp_jax.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    'InteropError': 'safetensors_io',
    'LAYOUTS': 'export',
    'apply_to_config': 'hf',
    'check_weights': 'hf',
    'export_model': 'export',
    'export_workdir': 'export',
    'load_dir': 'hf',
    'load_model': 'hf',
    'model_params': 'export',
    'params_from_hf': 'hf',
    'to_hf_tensors': 'export',
})
