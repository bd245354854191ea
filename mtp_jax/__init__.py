"""mtp_jax: multi-token prediction pretraining and self-speculative decoding in JAX."""

__version__ = '0.1.0'
