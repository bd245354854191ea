"""Names kept for code written against the earlier converter module; the bridge lives in
safetensors_io.py, hf_config.py, layouts.py, fp8.py, hf.py (import) and export.py."""
from mtp_jax.interop.export import export_model, export_workdir  # noqa: F401
from mtp_jax.interop.fp8 import dequantize as dequantize_fp8  # noqa: F401
from mtp_jax.interop.fp8 import quantize as quantize_fp8  # noqa: F401
from mtp_jax.interop.hf import load_dir  # noqa: F401
from mtp_jax.interop.safetensors_io import InteropError as ConvertError  # noqa: F401
