"""The Hugging Face bridge, both directions: safetensors_io (files), hf_config (config.json),
layouts (tensor names), fp8 (DeepSeek-V3's block scales), hf (import), export (export)."""
